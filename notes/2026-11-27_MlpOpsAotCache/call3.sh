#!/bin/bash
# Session 59, call 3, 4 GPUs (carry .anchor), from the root of branch next (3af0aa6); main's tree in .anchor/t_main.
#  g0: next's whole GPU suite (-n 16), then benchmarks --only mlp
#  g1: next --deterministic default, then main default cold (inductor cache kept: kernel sources)
#  g2: next --deterministic --mlp-act-only (loss lines against g1's), then main --dynamic-tokens cold (kernel sources)
#  g3: next --dynamic-tokens cold -> warm (the AOT autograd cache of the one dynamic graph)
set -u
TOTAL=${TOTAL:-560}; NEXT_SHA=${NEXT_SHA:-next}
R=$(pwd) A=$(pwd)/.anchor M=$(pwd)/.anchor/t_main
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache
date; nvidia-smi -L; mkdir -p /tmp/r/logs
[ -f /tmp/code/fineweb_val_000000.bin ] || python3 $A/bench/make_code_corpus.py /tmp/code > /tmp/corpus.log 2>&1 || { tail /tmp/corpus.log; exit 1; }
echo "corpus at $SECONDS s"
SHORT=(--steps 60 --extension-steps 4 --val-every 0)
DET=(--steps 60 --extension-steps 4 --val-every 20 --train-loss --deterministic)
left() { echo $(( TOTAL - SECONDS )); }
tr_() {  # tr_ TREE SHA NAME GPU CACHE LIM flags...
  local tree=$1 sha=$2 name=$3 gpu=$4 cache=$5 lim=$6; shift 6
  [ $lim -gt 20 ] || { echo "$name: no time left"; return 1; }
  (cd $tree && CUDA_VISIBLE_DEVICES=$gpu GIT_SHA=$sha TORCHINDUCTOR_CACHE_DIR=/tmp/c/$cache/inductor TRITON_CACHE_DIR=/tmp/c/$cache/triton \
    timeout -k 5 $lim torchrun --standalone --master_port=$((29600 + gpu)) --nproc_per_node=1 train_gpt.py \
    --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" \
    --log-dir /tmp/r/logs --checkpoint-dir /tmp/ck/$name --run-id $name "$@" > /tmp/r/$name.console 2>&1 < /dev/null)
  echo "$name rc=$? at $SECONDS s"
}
g0() {
  CUDA_VISIBLE_DEVICES=0 GIT_SHA=$NEXT_SHA GPU_SUITE_TIMEOUT=$(( $(left) - 110 )) bash .ci/gpu_suite /tmp/r/suite -n 16 > /dev/null 2>&1
  echo "g0 suite: $(grep -E '(passed|failed)' /tmp/r/suite/gpu_suite.log | tail -1) $(tail -1 /tmp/r/suite/gpu_suite.log)"
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 $(( $(left) - 5 )) python3 -m benchmarks --only mlp > /tmp/r/bench_mlp.txt 2>&1; echo "g0 bench rc=$? at $SECONDS s"
}
g1() {
  tr_ $R $NEXT_SHA g1_det_default 1 det 300 "${DET[@]}"
  tr_ $M main g1_main_static_cold 1 ms $(( $(left) - 30 )) "${SHORT[@]}"
}
g2() {
  tr_ $R $NEXT_SHA g2_det_act 2 detact 300 "${DET[@]}" --mlp-act-only
  tr_ $M main g2_main_dyn_cold 2 md $(( $(left) - 30 )) "${SHORT[@]}" --dynamic-tokens
}
g3() {
  tr_ $R $NEXT_SHA g3_next_dyn_cold 3 nd 250 "${SHORT[@]}" --dynamic-tokens
  tr_ $R $NEXT_SHA g3_next_dyn_warm 3 nd 120 "${SHORT[@]}" --dynamic-tokens
  tr_ $R $NEXT_SHA g3_next_static_cold 3 ns $(( $(left) - 30 )) "${SHORT[@]}"
}
g0 & g1 & g2 & g3 & wait
echo "all done at $SECONDS s"
cd /tmp/r
diff <(grep -E "^step:.*loss" logs/g1_det_default.txt | sed 's/train_time.*//') <(grep -E "^step:.*loss" logs/g2_det_act.txt | sed 's/train_time.*//') > det_diff.txt \
  && echo "det: loss lines identical ($(grep -c 'loss' logs/g2_det_act.txt) lines)" || echo "det: loss lines differ: $(wc -l < det_diff.txt) diff lines"
tar czf $OUT/logs.tgz logs/*.txt *.console *.txt suite/gpu_suite.log 2>/dev/null
for c in ms md; do (cd /tmp/c/$c/inductor 2>/dev/null && find . -name "*.py" -size -2M | tar czf $OUT/src_$c.tgz -T - ); done
ls -la $OUT
for f in logs/*.txt; do printf "%-24s %s | %s | %s\n" $(basename $f .txt) "$(grep -E '^compile_warmup_s' $f)" "$(grep -E '^stage_step_avg' $f)" "$(grep -E '^compile_report: [0-9]' $f | cut -c1-60)"; done
grep -h "^compile_report: frame" logs/g3_next_dyn_warm.txt
grep -E "passed|failed|FAILED|exit code" suite/gpu_suite.log | tail -8
grep -E "relu2" bench_mlp.txt | cut -c1-150 | head -14
