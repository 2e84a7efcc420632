# sourced by the next calls (call_cols.sh): corpus, stamp, runin DIR NAME LIMIT_S TAG [train_gpt flags...] ->
# $OUT/q/NAME.console, with caches /tmp/ind_TAG and /tmp/tri_TAG (call1.sh and call2.sh, as they ran, inline it)
set -u; A=$(pwd)/.anchor; R=$(pwd); mkdir -p $OUT/q /tmp/logs
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
trap "tar czf \$OUT/logs.tgz -C /tmp/logs . 2>/dev/null" EXIT
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || { tail /tmp/corpus.log; exit 1; }
echo "corpus ready at $SECONDS s"
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
SHORT=(--steps 60 --extension-steps 4 --val-every 64 --log-train-loss)
runin() { local dir=$1 name=$2 lim=$3 tag=$4; shift 4; local log=$OUT/q/$name.console
  echo "launch $EPOCHREALTIME $name $dir $*" > $log
  ( cd $dir && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tag TRITON_CACHE_DIR=/tmp/tri_$tag timeout -k 5 $lim torchrun --standalone \
    --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir /tmp/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" 2>&1 < /dev/null | stamp >> $log )
  echo "end $EPOCHREALTIME" >> $log; rm -rf /tmp/ck/$name
  echo "$name at $SECONDS s: $(grep -h 'startup_s\|compile_warmup_s\|stage_step_avg' $log | cut -c19- | cut -c1-160 | tr '\n' ' ')"; }
