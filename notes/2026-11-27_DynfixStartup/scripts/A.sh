#!/bin/bash
# Next session, call A, branch dynfix (pair_heads), a FRESH nvidia-h100-x1, carry .anchor. Alone on the machine:
#   --dynamic-tokens cold (filling --compile-cache /tmp/cc from an empty inductor cache) -> warm; default cold -> warm;
#   the --compile-cache comes back split in 15 MB parts ($OUT/cc.part.*) for call B on another fresh machine.
# Then on the CPU: python3 .anchor/dyn/dyn_sum.py $OUT/logs/*.txt; profile both if dynamic is still > 1% slower.
set -u; echo "start $(date +%T)"
A=$(pwd)/.anchor L=$OUT/logs; mkdir -p $L
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || exit 1
echo "corpus ready at $SECONDS s"
SHORT=(--steps 60 --extension-steps 4 --val-every 0)
run() { local name=$1 cache=$2 lim=$3; shift 3
  TORCHINDUCTOR_CACHE_DIR=/tmp/c/$cache/inductor TRITON_CACHE_DIR=/tmp/c/$cache/triton timeout -k 5 $lim \
    torchrun --standalone --nproc_per_node=1 train_gpt.py --train-files "/tmp/code/fineweb_train_*.bin" \
    --val-files "/tmp/code/fineweb_val_*.bin" --log-dir $L --checkpoint-dir /tmp/ck/$name --run-id $name "$@" > /tmp/$name.console 2>&1
  echo "$name rc=$? at $SECONDS s: $(grep -h '^compile_warmup_s\|^stage_step_avg\|^compile_cache' $L/$name.txt | tr '\n' ' ')"; }
run dyn_cold d 200 "${SHORT[@]}" --dynamic-tokens --compile-cache /tmp/cc
(cd /tmp/cc && tar czf /tmp/cc.tgz . ) && split -b 15M /tmp/cc.tgz $OUT/cc.part. && ls -la $OUT
run dyn_warm d 120 "${SHORT[@]}" --dynamic-tokens
run static_cold s 240 "${SHORT[@]}"
run static_warm s 100 "${SHORT[@]}"
