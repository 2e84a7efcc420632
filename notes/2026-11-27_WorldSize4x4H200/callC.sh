#!/bin/bash
# Call C (warm): ours at world size 4, full schedule, --profile-steps 3; then the GPU suite over the four GPUs.
set -u
t0=$(date +%s)
.anchor/multi.sh ${LIM:-330} 'ours4 0,1,2,3 ours --profile-steps 3'
mkdir -p $OUT/full
f=$(ls /tmp/multi/logs/ours4/*.txt 2>/dev/null | grep -v profile | head -1); [ -n "$f" ] && cp "$f" $OUT/full/ours4.txt
(cd /tmp/multi/logs/ours4 && tar czf /tmp/traces.tgz *profile_stage*_rank0.json 2>/dev/null) && \
  [ $(stat -c %s /tmp/traces.tgz) -lt 15000000 ] && cp /tmp/traces.tgz $OUT/full/ours4_traces.tgz
left=$(( ${TOTAL:-585} - ($(date +%s) - t0) ))
echo "suite gets $left s"
GPU_SUITE_TIMEOUT=$left bash .ci/gpu_suite $OUT/suite > /dev/null 2>&1
tail -30 $OUT/suite/gpu_suite.log
