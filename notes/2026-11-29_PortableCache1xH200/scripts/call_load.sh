#!/bin/bash
# A FRESH nvidia-h200: the --compile-cache filled on another machine (call_fill.sh), unpacked, loaded into empty
# caches; then, on it, a --profile-steps 1 run with Python stacks (stackprof.py), stage 0's host time by function.
set -u; source .anchor/s66/common.sh
trap "tar czf \$OUT/logs_load.tgz -C /tmp/logs . --exclude='*.json' 2>/dev/null" EXIT
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
t0=$SECONDS; (cd .anchor/s67/cc && sha256sum -c <(sed 's#/tmp/cc.tar.xz#cc.part00#' cc.sha256)) || exit 1
rm -rf /tmp/cc; xz -dc .anchor/s67/cc/cc.part00 | tar -C /tmp -xf - ; echo "unpacked in $((SECONDS-t0)) s: $(du -sh /tmp/cc)"
rm -rf /tmp/ind_b /tmp/tri_b; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_b TRITON_CACHE_DIR=/tmp/tri_b
run cached 160 "${SHORT[@]}" --compile-cache /tmp/cc
ls /tmp/ind_b /tmp/tri_b 2>&1 | head -3
name=stack; log=$OUT/q/$name.console; echo "launch $EPOCHREALTIME" > $log
timeout -k 5 $((345 - SECONDS)) torchrun --standalone --nproc_per_node=1 .anchor/s67/stackprof.py --train-files "/tmp/code/fineweb_train_*.bin" \
  --val-files "/tmp/code/fineweb_val_*.bin" --log-dir /tmp/logs --checkpoint-dir /tmp/ck/$name --run-id $name \
  --steps 60 --extension-steps 4 --val-every 64 --profile-steps 1 --compile-cache /tmp/cc 2>&1 < /dev/null | stamp >> $log
echo "stack rc=${PIPESTATUS[0]} at $SECONDS s"; grep -h "launch_probe\|stage_step_avg" $log | cut -c19-
f=/tmp/logs/stack_profile_stage0_rank0.json; ls -la /tmp/logs
[ -f $f ] && timeout 60 python3 .anchor/s67/thread_self.py $f 1 60 > $OUT/q/thread_self_stage0.txt 2>&1
[ -f $f ] && gzip -c $f > $OUT/q/stage0_stack.json.gz; ls -la $OUT/q; echo "done at $SECONDS s"
