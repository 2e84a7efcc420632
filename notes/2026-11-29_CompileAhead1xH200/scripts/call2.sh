#!/bin/bash
# call 2, the machine of call 1 right after it: the pair's static run on the same card (it compiles cold: three
# training graphs). usage: bash .anchor/s65/call2.sh [flags]
set -u; source .anchor/s65/common.sh
trap "tar czf \$OUT/logs_call2.tgz -C /tmp/logs . 2>/dev/null" EXIT
run pairstatic $((590 - SECONDS)) --steps 240 --extension-steps 8 --val-every 0 "$@"
