#!/bin/bash
# Call B, branch dynfix, a FRESH nvidia-h100-x2, carry .anchor (.anchor/cc/cc.part.* = call A's --compile-cache).
# 1) --dynamic-tokens loading that cache, alone on the machine (issue 51: <= 30 s); 2) default cold on GPU 1 alone;
# 3) step-time pairs, default and --dynamic-tokens at once, then with the GPUs swapped. Logs timestamped (launch line).
set -u; echo "start $(date +%T)"
A=$(pwd)/.anchor L=$OUT/logs; mkdir -p $L /tmp/cc
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || exit 1
echo "corpus ready at $SECONDS s"
cat $A/cc/cc.part.* | tar xzf - -C /tmp/cc
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
stamp() { while IFS= read -r l; do printf '%s %s\n' "$EPOCHREALTIME" "$l"; done; }
run() { local name=$1 gpu=$2 cache=$3 lim=$4; shift 4
  echo "launch $EPOCHREALTIME $(nvidia-smi --query-gpu=name --format=csv,noheader -i $gpu) $(hostname)" > $L/$name.console
  CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_CACHE_DIR=/tmp/c/$cache/inductor TRITON_CACHE_DIR=/tmp/c/$cache/triton \
    timeout -k 5 $lim torchrun --standalone --master_port=$((29500 + gpu)) --nproc_per_node=1 train_gpt.py \
    --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" --log-dir $L \
    --checkpoint-dir /tmp/ck/$name --run-id $name "$@" 2>&1 < /dev/null | stamp >> $L/$name.console
  local rc=${PIPESTATUS[0]}; echo "end $EPOCHREALTIME rc=$rc" >> $L/$name.console
  echo "$name rc=$rc at $SECONDS s: $(grep -h '^compile_warmup_s\|^stage_step_avg\|^compile_cache' $L/$name.txt | tr '\n' ' ')"; }
run dyn_loaded 0 d 150 "${SHORT[@]}" --dynamic-tokens --compile-cache /tmp/cc
run static_cold 1 s 270 "${SHORT[@]}" & run dyn_beside_cold 0 d 130 "${SHORT[@]}" --dynamic-tokens & wait
run static_p1 0 s 120 "${SHORT[@]}" & run dyn_p1 1 d 120 "${SHORT[@]}" --dynamic-tokens & wait
