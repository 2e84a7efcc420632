#!/bin/bash
# Fresh nvidia-h200: cold default with --compile-cache /tmp/cc (empty), then warm on the same caches (the mark);
# the saved cache's size by kind, packed with xz and split into 15 MB parts under $OUT.
set -u; source .anchor/s66/common.sh
trap "tar czf \$OUT/logs_fill.tgz -C /tmp/logs . 2>/dev/null" EXIT
SHORT=(--steps 60 --extension-steps 4 --val-every 64)
rm -rf /tmp/ind_a /tmp/tri_a /tmp/cc; export TORCHINDUCTOR_CACHE_DIR=/tmp/ind_a TRITON_CACHE_DIR=/tmp/tri_a
run cold 230 "${SHORT[@]}" --compile-cache /tmp/cc
{ du -sh /tmp/cc /tmp/cc/* /tmp/cc/inductor/* /tmp/ind_a /tmp/tri_a; echo "files by suffix (count, MiB):"
  find /tmp/cc -type f -printf '%s %f\n' | awk '{n=$2; sub(/^[^.]*/,"",n); if(n=="")n="(none)"; c[n]++; s[n]+=$1} END{for(k in c) printf "%6d %9.1f %s\n", c[k], s[k]/1048576, k}' | sort -k2 -n -r | head -25
} > $OUT/q/cc_sizes.txt 2>&1
t0=$SECONDS; tar -C /tmp -cf - cc | xz -T16 -6 > /tmp/cc.tar.xz; echo "xz $(stat -c %s /tmp/cc.tar.xz) bytes in $((SECONDS-t0)) s" >> $OUT/q/cc_sizes.txt
run warm 150 "${SHORT[@]}"
sz=$(stat -c %s /tmp/cc.tar.xz)
if [ $sz -lt 36000000 ]; then split -b 15000000 -d /tmp/cc.tar.xz $OUT/cc.part; sha256sum /tmp/cc.tar.xz > $OUT/q/cc.sha256; fi
cat $OUT/q/cc_sizes.txt; ls -la $OUT
