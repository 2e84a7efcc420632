#!/bin/bash
# cand2 = main + mlpop (the fused MLP as triton ops): GPU tests, then the compile warmup cold and warm, default and --dynamic-tokens
cd "$(dirname "$0")/../.."
A=$(pwd)/.anchor; export TIKTOKEN_CACHE_DIR=$A/tiktoken_cache PYTHONUNBUFFERED=1
date; nvidia-smi -L
t0=$(date +%s); [ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > $OUT/corpus.log 2>&1; echo "corpus $(( $(date +%s) - t0 )) s"
mkdir -p $OUT/dyn
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider tests/test_mlp.py tests/test_model.py -k "mlp or relu2" > $OUT/tests_mlp.log 2>&1; tail -3 $OUT/tests_mlp.log
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/test_train_gpt.py -k "dynamic_tokens" > $OUT/tests_dyn.log 2>&1; tail -2 $OUT/tests_dyn.log
echo "tests done at $SECONDS s"
bash .anchor/dyn/dyn_gpu.sh cold > $OUT/dyn/cold.sum 2>&1; echo "cold done at $SECONDS s"
[ $SECONDS -lt 470 ] && bash .anchor/dyn/dyn_gpu.sh warm > $OUT/dyn/warm.sum 2>&1; echo "warm done at $SECONDS s"
python3 $A/dyn/dyn_sum.py $OUT/dyn/logs/*.txt 2>&1 | grep -v "compile_phase\|compile_options\|stage_step_avg"
