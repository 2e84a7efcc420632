#!/bin/bash
# Call A2: the same nvidia-h100-x1 as call A, the next call (its caches under /tmp kept), inline as it ran:
# the run() function of A.sh, then default "cold" (a retry of call A's cut run), default warm, --dynamic-tokens warm.
sed -n '/^run() {/,/; }$/p' .anchor/s60/A.sh > /tmp/fn.sh; A=$(pwd)/.anchor L=$OUT/logs; mkdir -p $L
export PYTHONUNBUFFERED=1 TIKTOKEN_CACHE_DIR=$A/tiktoken_cache; SHORT=(--steps 60 --extension-steps 4 --val-every 0)
source /tmp/fn.sh
run static_cold2 s 230 "${SHORT[@]}"; run static_warm s 110 "${SHORT[@]}"; run dyn_warm2 d 110 "${SHORT[@]}" --dynamic-tokens
