#!/bin/bash
# A FRESH nvidia-h200, alone. Each run names its own inductor and Triton caches (fresh() empties them: cold).
#  noahead: the default cold with --no-compile-ahead: its wait, and stage 0 compiled and tuned with the GPU alone
#  cold:    the default cold (second processes on), as a newcomer runs it
#  warm:    the same again on cold's caches: the compiled mark, so no second processes
set -u; source .anchor/s66/common.sh
trap "tar czf \$OUT/logs_callC.tgz -C /tmp/logs . 2>/dev/null" EXIT
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
fresh() { rm -rf /tmp/ind_$1 /tmp/tri_$1; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1; }
fresh c; run noahead 235 "${SHORT[@]}" --no-compile-ahead "$@"
fresh a; run cold 185 "${SHORT[@]}" "$@"
ls /tmp/ind_a/train_gpt_compiled
run warm $((588 - SECONDS)) "${SHORT[@]}" "$@"
