#!/bin/bash
# Fresh nvidia-h200: a cold --profile-steps 3 run of the default (launch_probe lines, traces -> host_stats), then
# test_train_gpt.py's GPU tests.
set -u; source .anchor/s66/common.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_p TRITON_CACHE_DIR=/tmp/tri_p
run prof 290 --steps 60 --extension-steps 4 --val-every 64 --profile-steps 3 "$@"
cp /tmp/logs/prof.txt $OUT/q/ 2>/dev/null; ls -la /tmp/logs | head
for i in 0 1; do f=$(ls /tmp/logs/prof*_profile_stage${i}_rank0.json 2>/dev/null | head -1); [ -n "$f" ] && \
  timeout 60 python3 .anchor/s67/host_stats.py $f 3 > $OUT/q/host_stats_stage$i.txt 2>&1; done
echo "host stats done at $SECONDS s"
rest=$((585 - SECONDS)); echo "tests get $rest s"
GIT_SHA=b2b15f5 GPU_SUITE_TIMEOUT=$rest bash .ci/gpu_suite $OUT/q tests/test_train_gpt.py -k gpu 2>&1 | tail -5
