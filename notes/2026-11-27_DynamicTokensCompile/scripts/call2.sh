#!/bin/bash
cd "$(dirname "$0")/../.."
date
bash .anchor/dyn/dyn_gpu.sh warm 2>&1 | grep -v "^  compile_report: frame\|stage_step_avg" | tail -40
# fill a --compile-cache from the warm dynamic caches
A=$(pwd)/.anchor; export TIKTOKEN_CACHE_DIR=$A/tiktoken_cache PYTHONUNBUFFERED=1
rm -rf /tmp/dyn/cc /tmp/dyn/ckpt/ccfill
TORCHINDUCTOR_CACHE_DIR=/tmp/dyn/cache/dynamic/inductor TRITON_CACHE_DIR=/tmp/dyn/cache/dynamic/triton timeout -k 5 120 \
  torchrun --standalone --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
  --log-dir $OUT/dyn/logs --checkpoint-dir /tmp/dyn/ckpt --run-id ccfill --steps 60 --extension-steps 4 --val-every 0 --dynamic-tokens \
  --compile-cache /tmp/dyn/cc > $OUT/dyn/ccfill.console 2>&1
grep "compile_warmup_s\|compile_cache" $OUT/dyn/logs/ccfill.txt; du -sm /tmp/dyn/cc
mkdir -p $OUT/cc && tar -C /tmp/dyn -cf - cc | zstd -q -3 -o $OUT/cc/cc.tar.zst 2>/dev/null || tar -C /tmp/dyn -czf $OUT/cc/cc.tar.gz cc; ls -la $OUT/cc
date
