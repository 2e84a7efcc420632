#!/bin/bash
# --dynamic-tokens (branch dyn) on the GPU: the compile warmup cold and warm, and the step time, default beside the flag.
# From the repo root of branch dyn, carry .anchor.   bash .anchor/dyn/dyn_gpu.sh cold|warm|pair|suite   logs: $OUT/dyn
set -u
PHASE=$1; NG=$(nvidia-smi -L | wc -l)
A=$(pwd)/.anchor W=/tmp/dyn L=$OUT/dyn; mkdir -p $W $L
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > $L/corpus.log 2>&1 || exit 1
SHORT=(--steps 60 --extension-steps 4 --val-every 0)  # every stage's length compiled and run, ~64 short steps
run() {  # run NAME GPUS LIMIT_S [flags]: train_gpt.py on GPUS; compile caches per configuration under $W/cache
  local name=$1 gpus=$2 lim=$3; shift 3
  local n=$(echo $gpus | tr , '\n' | wc -l) kind=static
  [[ " $* " == *" --dynamic-tokens "* ]] && kind=dynamic
  rm -rf $W/ckpt/$name
  CUDA_VISIBLE_DEVICES=$gpus TORCHINDUCTOR_CACHE_DIR=$W/cache/$kind/inductor TRITON_CACHE_DIR=$W/cache/$kind/triton \
    timeout -k 5 $lim torchrun --standalone --master_port=$((29500 + ${gpus:0:1})) --nproc_per_node=$n train_gpt.py \
    --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir $L/logs --checkpoint-dir $W/ckpt --run-id $name "$@" > $L/$name.console 2>&1 < /dev/null
}
ALL=$(seq -s, 0 $((NG - 1)))
case $PHASE in
  cold) rm -rf $W/cache
        run static_cold $ALL 300 "${SHORT[@]}"
        run dynamic_cold $ALL 230 "${SHORT[@]}" --dynamic-tokens ;;
  warm) run static_warm $ALL 140 "${SHORT[@]}"
        run dynamic_warm $ALL 140 "${SHORT[@]}" --dynamic-tokens ;;
  pair) [ "$NG" -ge 4 ] || { echo "pair needs 4 GPUs" >&2; exit 2; }
        run static_full 0,1 560 & run dynamic_full 2,3 560 --dynamic-tokens & wait ;;
  suite) timeout -k 5 560 python3 -m pytest -q -p no:cacheprovider > $L/suite.log 2>&1; tail -3 $L/suite.log ;;
esac
python3 $A/dyn/dyn_sum.py $(ls $L/logs/*.txt 2>/dev/null)
