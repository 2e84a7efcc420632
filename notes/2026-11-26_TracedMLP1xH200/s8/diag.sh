#!/bin/bash
# usage: DIAG_MODE=async|lagK .bench/diag.sh LIMIT_S [trainer args]; corpus and paths as .anchor/side.sh
set -u
LIM=$1; shift
A=$(pwd)/.anchor; mkdir -p $OUT
# a worker left by an earlier call (a timeout that killed torchrun but not its child) would share the GPU
busy=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)
[ -n "$busy" ] && { echo "the GPU is in use by pid(s) $busy: not measuring" >&2; exit 3; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > $OUT/corpus.log 2>&1 || exit 1
nvidia-smi dmon -s pc -d 1 > $OUT/dmon_${DIAG_MODE}.txt 2>&1 &
DM=$!
timeout -k 5 $LIM torchrun --standalone --master_port=29613 --nproc_per_node=1 .bench/diag_run.py \
  --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
  --log-dir /tmp/diag/logs --checkpoint-dir /tmp/diag/ckpt "$@" > $OUT/diag_${DIAG_MODE}.log 2>&1 < /dev/null
kill $DM
grep -E "^diag|^  " $OUT/diag_${DIAG_MODE}.log; grep -E "step:(250|500)/" $OUT/diag_${DIAG_MODE}.log | grep val
