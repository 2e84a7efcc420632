#!/bin/bash
# Not run yet. A FRESH nvidia-h200: read the torch, Triton and NVIDIA library files once (16 readers), then load a
# --compile-cache packed by call_fill.sh (.anchor/s67/cc/cc.part00 and cc.sha256, from a fill on another machine
# with the same code) into empty caches, as call_load.sh does without the read-ahead. Compare launch to step-0 val
# with call_load.sh's 87.3 s (and the second load's 19.4 s warmup).
set -u; source .anchor/s66/common.sh
trap "tar czf \$OUT/logs_readahead.tgz -C /tmp/logs --exclude='*.json' . 2>/dev/null" EXIT
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
(cd .anchor/s67/cc && sha256sum -c <(sed 's#/tmp/cc.tar.xz#cc.part00#' cc.sha256)) || exit 1
rm -rf /tmp/cc; xz -dc .anchor/s67/cc/cc.part00 | tar -C /tmp -xf -
site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
t0=$SECONDS; bytes=$(find $site/torch $site/triton $site/nvidia -type f -printf '%s\n' 2>/dev/null | awk '{s+=$1} END{print s}')
find $site/torch $site/triton $site/nvidia -type f -print0 2>/dev/null | xargs -0 -P 16 -n 64 cat > /dev/null
echo "read ahead $bytes bytes in $((SECONDS - t0)) s" | tee $OUT/q/readahead.txt
rm -rf /tmp/ind_b /tmp/tri_b; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_b TRITON_CACHE_DIR=/tmp/tri_b
run cached_readahead 200 "${SHORT[@]}" --compile-cache /tmp/cc
