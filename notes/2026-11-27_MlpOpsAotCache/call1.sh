#!/bin/bash
# Session 59, call 1, 4 GPUs (carry .anchor), from main's root. One job per GPU, separate compile caches:
#  g0: branch next (.anchor/t_next): MLP GPU tests, default cold -> warm (AOT autograd cache hit?), then --dynamic-tokens cold -> warm
#  g1: main default --profile-steps 3 (cold), then warm unprofiled       g2: the same with --dynamic-tokens
#  g3: next: --deterministic default vs --mlp-act-only (loss lines identical?), then benchmarks --only mlp
set -u
TOTAL=${TOTAL:-560}
R=$(pwd) A=$(pwd)/.anchor N=$(pwd)/.anchor/t_next
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
date; nvidia-smi -L
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || { tail /tmp/corpus.log; exit 1; }
echo "corpus at $SECONDS s"
SHORT=(--steps 60 --extension-steps 4 --val-every 0)
left() { echo $(( TOTAL - SECONDS )); }
tr_() {  # tr_ TREE SHA NAME GPU CACHE LIM flags...
  local tree=$1 sha=$2 name=$3 gpu=$4 cache=$5 lim=$6; shift 6
  [ $lim -gt 20 ] || { echo "$name: no time left"; return 1; }
  mkdir -p /tmp/r/logs
  (cd $tree && CUDA_VISIBLE_DEVICES=$gpu GIT_SHA=$sha TORCHINDUCTOR_CACHE_DIR=/tmp/c/$cache/inductor TRITON_CACHE_DIR=/tmp/c/$cache/triton \
    timeout -k 5 $lim torchrun --standalone --master_port=$((29600 + gpu)) --nproc_per_node=1 train_gpt.py \
    --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir /tmp/r/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" > /tmp/r/$name.console 2>&1 < /dev/null)
  echo "$name rc=$? at $SECONDS s"
}
g0() {
  (cd $N && CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=/tmp/c/t0 timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_mlp.py > /tmp/r/tests_mlp_next.log 2>&1); echo "g0 tests: $(tail -1 /tmp/r/tests_mlp_next.log)"
  tr_ $N next g0_next_static_cold 0 nexts 250 "${SHORT[@]}"
  tr_ $N next g0_next_static_warm 0 nexts 120 "${SHORT[@]}"
  tr_ $N next g0_next_dyn_cold 0 nextd $(( $(left) - 80 < 160 ? $(left) - 80 : 160 )) "${SHORT[@]}" --dynamic-tokens
  tr_ $N next g0_next_dyn_warm 0 nextd $(( $(left) - 5 )) "${SHORT[@]}" --dynamic-tokens
}
g1() {
  tr_ $R main g1_main_static_prof 1 mains 280 "${SHORT[@]}" --profile-steps 3
  tr_ $R main g1_main_static_warm 1 mains 130 "${SHORT[@]}"
  tr_ $R main g1_main_static_warm2 1 mains $(( $(left) - 5 )) "${SHORT[@]}"
}
g2() {
  tr_ $R main g2_main_dyn_prof 2 maind 280 "${SHORT[@]}" --profile-steps 3 --dynamic-tokens
  tr_ $R main g2_main_dyn_warm 2 maind 130 "${SHORT[@]}" --dynamic-tokens
  tr_ $R main g2_main_dyn_warm2 2 maind $(( $(left) - 5 )) "${SHORT[@]}" --dynamic-tokens
}
g3() {
  tr_ $N next g3_det_default 3 det 240 --steps 60 --extension-steps 4 --val-every 20 --train-loss --deterministic
  tr_ $N next g3_det_act 3 detact $(( $(left) - 70 < 240 ? $(left) - 70 : 240 )) --steps 60 --extension-steps 4 --val-every 20 --train-loss --deterministic --mlp-act-only
  diff <(grep -E "^step:.*loss" /tmp/r/logs/g3_det_default.txt | sed 's/train_time.*//') \
       <(grep -E "^step:.*loss" /tmp/r/logs/g3_det_act.txt | sed 's/train_time.*//') > /tmp/r/det_diff.txt && echo "g3: loss lines identical ($(grep -c loss /tmp/r/logs/g3_det_act.txt) lines)" || echo "g3: loss lines differ: $(wc -l < /tmp/r/det_diff.txt) diff lines"
  (cd $N && CUDA_VISIBLE_DEVICES=3 timeout -k 5 $(( $(left) - 5 )) python3 -m benchmarks --only mlp > /tmp/r/bench_mlp_next.txt 2>&1); echo "g3 bench rc=$?"
}
g0 & g1 & g2 & g3 & wait
echo "all done at $SECONDS s"
cd /tmp/r
for t in logs/*_profile_stage*_rank0.json; do [ -f "$t" ] && python3 $R/records/profile_compare.py --compact $t ${t%.json}.json.gz > /dev/null && rm $t; done
tar czf $OUT/logs.tgz logs/*.txt *.console *.log *.txt 2>/dev/null; tar czf $OUT/prof.tgz logs/*.json.gz 2>/dev/null
ls -la $OUT
for s in 0 1 2 3; do a=$(ls logs/g1_*stage${s}_rank0.json.gz 2>/dev/null); b=$(ls logs/g2_*stage${s}_rank0.json.gz 2>/dev/null)
  [ -n "$a" ] && [ -n "$b" ] && { echo "== stage $s default vs dynamic"; python3 $R/records/profile_compare.py $a $b --names default,dynamic --steps 3 | head -30; }; done
python3 $A/dyn/dyn_sum.py logs/*.txt 2>&1 | grep -v "compile_phase\|compile_options\|stage_step_avg" | head -60
