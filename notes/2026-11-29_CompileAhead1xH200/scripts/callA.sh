#!/bin/bash
# a FRESH nvidia-h200, alone: the default cold (filling --compile-cache /tmp/cc, back in 15 MB parts), then the GPU
# suite. usage: GIT_SHA=... bash .anchor/s65/callA.sh [flags]
set -u; source .anchor/s65/common.sh
trap "tar czf \$OUT/logs_callA.tgz -C /tmp/logs . 2>/dev/null" EXIT
run cold 230 --steps 60 --extension-steps 4 --val-every 64 --compile-cache /tmp/cc "$@"
(cd /tmp/cc && tar czf /tmp/cc.tgz .) && split -b 15M /tmp/cc.tgz $OUT/cc.part. && ls -la $OUT | tail -6
nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv,noheader
GPU_SUITE_TIMEOUT=$((590 - SECONDS)) bash .ci/gpu_suite $OUT > /dev/null 2>&1; echo "suite rc=$? at $SECONDS s"
tail -4 $OUT/gpu_suite.log
