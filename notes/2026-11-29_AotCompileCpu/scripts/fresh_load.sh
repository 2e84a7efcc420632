#!/bin/bash
# Usage: bash .anchor/s71/fresh_load.sh BUDGET_S   (a fresh machine; .anchor/s71/cc.tar.xz: aot.sh's packed /tmp/cc from
# another machine of this kind, same tree). Unpacks it to /tmp/cc and runs the short schedule loading it, twice:
# the fresh machine's first start (issue 51's bar: <= 30 s to the step-0 validation) and its second.
source .anchor/s68/common.sh
budget=$1
sha256sum $A/s71/cc.tar.xz
mkdir -p /tmp/cc && tar -C /tmp/cc -xJf $A/s71/cc.tar.xz && du -sh /tmp/cc/*
for name in fresh fresh2; do
  lim=$((budget - SECONDS)); [ $lim -gt 200 ] && lim=200; [ $lim -lt 90 ] && { echo "no time for $name"; break; }
  runin $R $name $lim aotF "${SHORT[@]}" --compile-cache /tmp/cc
  awk -v n=$name 'NR==1{t0=$2} /step:0\/[0-9]* val_loss/{printf "%s: launch to step-0 val %.1f s\n", n, $1-t0; exit}' \
    $OUT/q/$name.console
  grep -h 'precompiled: \|compile_cache\|compile_warmup_s\|startup_s' $OUT/q/$name.console | cut -c19- | cut -c1-260
done
