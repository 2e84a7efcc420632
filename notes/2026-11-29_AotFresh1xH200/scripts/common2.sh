# sourced by aot2.sh and fresh2.sh: common.sh's corpus and stamp, and runin2 DIR NAME LIMIT_S TAG [flags...]: runin's
# run under rusage_run.py (an 'rusage:' line at the end of $OUT/q/NAME.console), with the files in its inductor and
# Triton caches and in /tmp/cc's counted before and after ('cache_files:' lines; a run loading /tmp/cc compiles
# into /tmp/cc/inductor and /tmp/cc/triton: files it added there were compiled by it).
source .anchor/s68/common.sh
count() { local n; n() { find "$@" -type f 2>/dev/null | wc -l; }
  echo "$EPOCHREALTIME cache_files: $1 inductor $(n /tmp/ind_$2) triton $(n /tmp/tri_$2) cc/inductor $(n /tmp/cc/inductor) cc/triton $(n /tmp/cc/triton) cc/aot $(n /tmp/cc/aot)"; }
runin2() { local dir=$1 name=$2 lim=$3 tag=$4; shift 4; local log=$OUT/q/$name.console
  echo "launch $EPOCHREALTIME $name $dir $*" > $log
  count before $tag >> $log
  ( cd $dir && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tag TRITON_CACHE_DIR=/tmp/tri_$tag timeout -k 5 $lim python3 \
    $A/s72/rusage_run.py torchrun --standalone --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" \
    --val-files "/tmp/code/fineweb_val_*.bin" --log-dir /tmp/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" \
    2>&1 < /dev/null | stamp >> $log )
  echo "end $EPOCHREALTIME" >> $log; count after $tag >> $log; rm -rf /tmp/ck/$name
  awk -v n=$name 'NR==1{t0=$2} /step:0\/[0-9]* val_loss/{printf "%s: launch to step-0 val %.1f s\n", n, $1-t0; exit}' $log
  grep -h 'startup_s\|compile_phase\|compile_warmup_s\|compile_cache\|precompiled: \|rusage:\|cache_files:\|Error' $log \
    | cut -d' ' -f2- | cut -c1-260 | head -30; }
