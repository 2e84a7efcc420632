#!/bin/bash
# nvidia-h200: main (the working tree) and branch scalarcols (.anchor/cols) compiled cold at once into
# caches of their own (their step times are contended: not used), launch counts of both caches, then warm timed
# runs one at a time: main, cols, main, cols (as time allows).
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
# cold, both at once
runin $R cold_main 300  main "${SHORT[@]}" &
runin $A/cols cold_cols 300  cols "${SHORT[@]}" &
wait
for v in main cols; do timeout 60 python3 records/launch_counts.py /tmp/ind_$v --names 12 > $OUT/q/launch_counts_$v.md 2>&1; head -9 $OUT/q/launch_counts_$v.md; done
left() { echo $((575 - SECONDS)); }
for pass in 1 2; do
  for v in main cols; do d=$R; [ $v = cols ] && d=$A/cols
    l=$(left); [ $l -lt 100 ] && { echo "no time for $v$pass ($l s)"; break 2; }
    runin $d ${v}$pass $((l < 140 ? l : 140))  $v "${SHORT[@]}"; done; done
for f in $OUT/q/main1.console $OUT/q/cols1.console $OUT/q/main2.console $OUT/q/cols2.console; do [ -f $f ] && echo "$f $(grep -c 'train_loss' $f) $(grep -o 'train_loss[:=][^ ]*' $f | md5sum)"; done
