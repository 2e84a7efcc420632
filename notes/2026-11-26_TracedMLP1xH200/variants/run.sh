#!/bin/bash
export PYTHONPATH=.
mkdir -p $OUT
for vm in ptr:cppS ptr:cppSA dev:cppSP dev:cppSAP hostq:cppS hostq:cppSA; do v=${vm%%:*}; mode=${vm##*:}
  TORCH_LOGS=output_code timeout ${T:-400} python .bench/variants/gpu_check.py $v $mode > $OUT/check_${v}_${mode}.log 2> $OUT/code_${v}_${mode}.log &
done
TORCH_LOGS=output_code timeout 300 python .bench/variants/probe.py > $OUT/probe.log 2> $OUT/code_probe.log &
wait
timeout 60 python .bench/variants/bench.py host hostq dev > $OUT/bench.log 2>&1
for f in $OUT/check_*.log $OUT/probe.log $OUT/bench.log; do cat $f; done
for f in $OUT/code_*.log; do echo "== $f"; grep -o 'loadKernel("[^)]*)\|int64_t [a-z_]*scratch_[0-9]*_size\[\] = {[0-9]*}\|[A-Za-z]*Error[^\n]\{0,200\}' $f | sort | uniq -c | head -12; done
tar czf $OUT/code.tgz $OUT/code_*.log 2>/dev/null; rm -f $OUT/code_*.log
