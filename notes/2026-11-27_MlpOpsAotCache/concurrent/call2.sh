# Session call 2 (4 H100s, warm caches of call1.sh, the same machine): the four warm 64-step runs at once, each on
# another GPU than in call 1 (cards swapped). Run from branch next's root with main's tree in .anchor/t_main.
set -u; TOTAL=230
R=$(pwd) A=$(pwd)/.anchor N=$(pwd)/.anchor/t_next
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
SHORT=(--steps 60 --extension-steps 4 --val-every 0)
tr_() { local tree=$1 sha=$2 name=$3 gpu=$4 cache=$5 lim=$6; shift 6
  (cd $tree && CUDA_VISIBLE_DEVICES=$gpu GIT_SHA=$sha TORCHINDUCTOR_CACHE_DIR=/tmp/c/$cache/inductor TRITON_CACHE_DIR=/tmp/c/$cache/triton \
    timeout -k 5 $lim torchrun --standalone --master_port=$((29600 + gpu)) --nproc_per_node=1 train_gpt.py \
    --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir /tmp/r2/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" > /tmp/r2/$name.console 2>&1 < /dev/null); echo "$name rc=$? at $SECONDS s"; }
mkdir -p /tmp/r2/logs
tr_ $R main c2_static_g2 2 mains 220 "${SHORT[@]}" &
tr_ $R main c2_dyn_g1 1 maind 220 "${SHORT[@]}" --dynamic-tokens &
tr_ $N next c2_next_static_g3 3 nexts 220 "${SHORT[@]}" &
tr_ $N next c2_next_dyn_g0 0 nextd 220 "${SHORT[@]}" --dynamic-tokens &
wait; cd /tmp/r2; tar czf $OUT/logs2.tgz logs/*.txt *.console
