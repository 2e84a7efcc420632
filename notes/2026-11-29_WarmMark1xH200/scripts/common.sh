# sourced by the calls: corpus, stamp, run NAME LIMIT_S [train_gpt flags...] -> $OUT/q/NAME.console
A=$(pwd)/.anchor; mkdir -p $OUT/q
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
pkill -f train_gpt.py; sleep 1; mkdir -p /tmp/logs
nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv,noheader > /tmp/apps_before.txt
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || { tail /tmp/corpus.log; exit 1; }
echo "corpus ready at $SECONDS s; apps before: $(cat /tmp/apps_before.txt | wc -l)"
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
run() { local name=$1 lim=$2; shift 2; local log=$OUT/q/$name.console
  echo "launch $EPOCHREALTIME $(nvidia-smi --query-gpu=name --format=csv,noheader -i 0) $(hostname) job=ours $*" > $log
  timeout -k 5 $lim torchrun --standalone --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" \
    --val-files "/tmp/code/fineweb_val_*.bin" --log-dir /tmp/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" \
    2>&1 < /dev/null | stamp >> $log
  local rc=${PIPESTATUS[0]}; echo "end $EPOCHREALTIME rc=$rc" >> $log; rm -rf /tmp/ck/$name
  echo "$name rc=$rc at $SECONDS s: $(grep -h 'startup_s\|compile_warmup_s\|stage_step_avg\|compile_cache:' $log | cut -c19- | cut -c1-200 | tr '\n' ' ')"; }
