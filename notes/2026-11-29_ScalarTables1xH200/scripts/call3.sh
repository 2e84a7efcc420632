#!/bin/bash
# warm nvidia-h200 after call2: the whole GPU suite on the working tree, then launch_probe runs (--profile-steps 3),
# old then new, cut at 85 s each (stage 0's probe comes right after the warmup).
set -u; A=$(pwd)/.anchor; R=$(pwd); mkdir -p $OUT/q /tmp/logs
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
pkill -f train_gpt.py; sleep 1
GIT_SHA=1b3f4fa+take GPU_SUITE_TIMEOUT=340 timeout 350 bash .ci/gpu_suite $OUT/suite 2>&1 | tail -8
echo "suite done at $SECONDS s"
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
SHORT=(--steps 60 --extension-steps 4 --val-every 64 --log-train-loss --profile-steps 3)
runin() { local dir=$1 name=$2 lim=$3 tag=$4; shift 4; local log=$OUT/q/$name.console
  echo "launch $EPOCHREALTIME $name $dir $*" > $log
  ( cd $dir && TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$tag TRITON_CACHE_DIR=/tmp/tri_$tag timeout -k 5 $lim torchrun --standalone \
    --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir /tmp/logs/p --checkpoint-dir /tmp/ck/$name --run-id $name "$@" 2>&1 < /dev/null | stamp >> $log )
  echo "$name at $SECONDS s: $(grep -h 'launch_probe\|compile_warmup_s' $log | cut -c19- | cut -c1-200 | tr '\n' ' ')"; }
for v in old new; do d=$R; [ $v = old ] && d=$A/old; l=$((585 - SECONDS)); [ $l -lt 60 ] && break
  runin $d probe_$v $((l < 85 ? l : 85)) $v "${SHORT[@]}"; pkill -f train_gpt.py; sleep 1; done
