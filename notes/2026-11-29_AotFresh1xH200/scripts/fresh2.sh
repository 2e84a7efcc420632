#!/bin/bash
# Usage: bash .anchor/s72/fresh2.sh BUDGET_S   (a fresh machine; .anchor/s72/cc.tar.xz: aot2.sh's parts, joined here
# with cat, from another machine of this kind and the same tree). Unpacks it to /tmp/cc and runs the short schedule
# loading it, twice: the fresh machine's first start (issue 51's bar: <= 30 s to the step-0 validation) and its second.
# Each run's rusage line says how much it read from disk (inblock, majflt): the first start's extra reads against
# the second's, beside its extra seconds, say whether the fresh machine's wait is its cold disk.
source .anchor/s72/common2.sh
budget=$1
sha256sum $A/s72/cc.tar.xz
mkdir -p /tmp/cc && tar -C /tmp/cc -xJf $A/s72/cc.tar.xz && du -sh /tmp/cc/*
for name in fresh fresh2; do
  lim=$((budget - SECONDS)); [ $lim -gt 200 ] && lim=200; [ $lim -lt 90 ] && { echo "no time for $name"; break; }
  runin2 $R $name $lim aotF "${SHORT[@]}" --compile-cache /tmp/cc
done
