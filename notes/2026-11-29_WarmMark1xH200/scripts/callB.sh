#!/bin/bash
# A FRESH nvidia-h200, alone. Each run names its own inductor and Triton caches (fresh() empties them: cold).
#  cold:    the default, cold, as a newcomer runs it (no --compile-cache), second processes on
#  warm:    the same, warm (cold's caches), filling --compile-cache /tmp/cc
#  cached:  empty caches but --compile-cache /tmp/cc (a fresh machine's load, minus its cold page cache)
#  noahead: the default cold with --no-compile-ahead (its wait, and stage 0 without second processes)
set -u; source .anchor/s66/common.sh
trap "tar czf \$OUT/logs_callB.tgz -C /tmp/logs . 2>/dev/null" EXIT
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
fresh() { rm -rf /tmp/ind_$1 /tmp/tri_$1; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1; }
fresh a; run cold 200 "${SHORT[@]}" "$@"
run warm 110 "${SHORT[@]}" --compile-cache /tmp/cc "$@"
fresh b; run cached 110 "${SHORT[@]}" --compile-cache /tmp/cc "$@"
fresh c; run noahead $((588 - SECONDS)) "${SHORT[@]}" --no-compile-ahead "$@"
