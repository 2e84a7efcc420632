#!/bin/bash
cd "$(dirname "$0")/../.."
A=$(pwd)/.anchor; export TIKTOKEN_CACHE_DIR=$A/tiktoken_cache PYTHONUNBUFFERED=1
date; nvidia-smi -L; ls /tmp
t0=$(date +%s); [ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > $OUT/corpus.log 2>&1; echo "corpus $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/dyn && tar -C /tmp/dyn -xzf $A/s57/cc.tar.gz && du -sm /tmp/dyn/cc
mkdir -p $OUT/dyn/logs; t0=$(date +%s.%N)
timeout -k 5 150 torchrun --standalone --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
  --log-dir $OUT/dyn/logs --checkpoint-dir /tmp/dyn/ckpt --run-id ccload --steps 60 --extension-steps 4 --val-every 0 --dynamic-tokens \
  --compile-cache /tmp/dyn/cc > $OUT/dyn/ccload.console 2>&1
echo "ccload process wall $(python3 -c "import time; print(round(time.time() - $t0, 1))") s rc $?"
python3 $A/dyn/dyn_sum.py $OUT/dyn/logs/ccload.txt
GIT_SHA=0e21dfa GPU_SUITE_TIMEOUT=330 bash .ci/gpu_suite $OUT > /dev/null 2>&1; grep -E "passed|failed|FAILED|exit code" $OUT/gpu_suite.log | tail -12
timeout 120 python3 $A/s57/dalpha_probe.py 2>&1 | grep -v Warning | tail -8
date
