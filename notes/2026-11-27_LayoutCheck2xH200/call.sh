#!/bin/bash
# Final call (2 GPUs): GPU 1 runs the GPU suite at this commit; GPU 0 the layout check: --deterministic 20 steps
# of the tree before the refactor (.anchor/before, d4549d7) then of this tree, compared bit for bit.
set -u
R=$(pwd); D=/tmp/det; mkdir -p $D $OUT/full $OUT/suite
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$R/.anchor/tiktoken_cache
(CUDA_VISIBLE_DEVICES=1 GPU_SUITE_TIMEOUT=${SUITE_LIM:-420} bash .ci/gpu_suite $OUT/suite > /dev/null 2>&1) &
det() {  # det NAME DIR PORT
  (cd $2 && CUDA_VISIBLE_DEVICES=0 timeout -k 5 240 torchrun --standalone --master_port=$3 \
     --nproc_per_node=1 train_gpt.py --deterministic --steps 16 --extension-steps 4 --val-every 10 --train-loss \
     --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" --run-id $1 \
     --log-dir $D/logs --checkpoint-dir $D/ckpt > $OUT/full/$1.out 2>&1)
}
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 .anchor/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1
det det_before $R/.anchor/before 29801; det det_after $R 29802
{ grep -E "^step:|compile_warmup_s" $OUT/full/det_before.out | tail -4; grep -E "^step:|compile_warmup_s" $OUT/full/det_after.out | tail -4
  python3 .anchor/cmp_ckpt.py $D/logs/det_before.txt $D/ckpt/det_before/step_000020 \
    $D/logs/det_after.txt $D/ckpt/det_after/step_000020; } > $OUT/full/det_compare.txt 2>&1
wait
cat $OUT/full/det_compare.txt
tail -25 $OUT/suite/gpu_suite.log
