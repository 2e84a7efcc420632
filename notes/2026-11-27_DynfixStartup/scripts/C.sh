#!/bin/bash
# Call C (nvidia-h100-x2, fresh): the GPU suite at this commit (the corpus built beside it), then an eager
# (--no-compile) 6-step run to read startup_s and checkpoint_saved at the real model size.
set -u; echo "start $(date +%T)"
A=$(pwd)/.anchor L=$OUT/logs; mkdir -p $L
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
(python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1; echo "corpus rc=$? at $SECONDS s") &
timeout -k 5 420 python3 -m pytest -q -p no:cacheprovider --durations=15 > $OUT/suite.log 2>&1
echo "suite rc=$? at $SECONDS s"; tail -3 $OUT/suite.log
wait
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
echo "launch $EPOCHREALTIME" > $L/eager.console
timeout -k 5 100 torchrun --standalone --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" \
  --val-files "/tmp/code/fineweb_val_*.bin" --log-dir $L --checkpoint-dir /tmp/ck --run-id eager --no-compile \
  --steps 6 --extension-steps 0 --val-every 0 2>&1 < /dev/null | stamp >> $L/eager.console
echo "eager rc=${PIPESTATUS[0]} at $SECONDS s"; grep -h '^startup_s\|^checkpoint_saved\|^compile_warmup' $L/eager.txt
