#!/bin/bash
# call 1, a FRESH nvidia-h200, alone: the default cold (filling --compile-cache /tmp/cc, back in 15 MB parts), the
# same warm, then a 248-step run for the step-time pair (call 2 runs it static on this card).
# usage: bash .anchor/s65/call1.sh [flags for every run]
set -u; source .anchor/s65/common.sh
trap "tar czf \$OUT/logs_call1.tgz -C /tmp/logs . 2>/dev/null" EXIT
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
run cold 260 "${SHORT[@]}" --compile-cache /tmp/cc "$@"
(cd /tmp/cc && tar czf /tmp/cc.tgz .) && split -b 15M /tmp/cc.tgz $OUT/cc.part. && ls -la $OUT | tail -6
run warm 120 "${SHORT[@]}" "$@"
run pairdyn $((590 - SECONDS)) --steps 240 --extension-steps 8 --val-every 0 "$@"
