#!/bin/bash
# Usage: bash .anchor/s72/aot2.sh BUDGET_S   (the device's tree: branch next = main + aotcache + gatesum)
# --compile-cache's whole functions on the short schedule at world size 1, one after the other on one machine:
#   cold:    empty inductor/Triton caches (/tmp/ind_aot), empty --compile-cache /tmp/cc: compiles and saves
#   loaded:  empty inductor/Triton caches of its own (/tmp/ind_aotB), loads /tmp/cc
#   loaded2: the same again (its second start on those caches)
# then packs /tmp/cc into $OUT/cc.tar.xz.partNN (15 MiB each: files back are 16 MiB at most) for fresh2.sh.
source .anchor/s72/common2.sh
budget=$1
job() { local name=$1 tag=$2 lim=$3; shift 3
  local left=$((budget - SECONDS)); [ $left -lt $lim ] && lim=$left
  [ $lim -lt 90 ] && { echo "no time for $name ($lim s)"; return 1; }
  runin2 $R $name $lim $tag "${SHORT[@]}" "$@"; }
job cold aot 320 --compile-cache /tmp/cc || exit 0
# the launches of the graphs the cold run compiled (inductor writes each graph's code into its cache folder)
timeout 30 python3 records/launch_counts.py /tmp/ind_aot --names 12 > $OUT/q/launch_counts_next.md 2>&1
sed -n 3,9p $OUT/q/launch_counts_next.md | cut -d'|' -f3-5
du -sh /tmp/cc/* 2>&1; ls -la /tmp/cc/aot/*/ 2>&1 | head
XZ_OPT=-T0 tar -C /tmp/cc -cJf /tmp/cc.tar.xz . && split -b 15M -d /tmp/cc.tar.xz $OUT/cc.tar.xz.part && sha256sum /tmp/cc.tar.xz && ls -la $OUT
job loaded aotB 200 --compile-cache /tmp/cc || exit 0
job loaded2 aotB 150 --compile-cache /tmp/cc || exit 0
