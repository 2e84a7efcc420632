#!/bin/bash
# Usage: bash .anchor/s73/prefetch_fresh.sh BUDGET_S   (a fresh machine; .anchor/s72/cc.tar.xz as in fresh2.sh)
# Is the fresh machine's first start slow because of its cold disk? fresh2.sh's first start (65.3 s) read 1568 MiB
# through 1865 major faults; its second start (28.3 s) read none. Here the first start runs with every large shared
# library of torch, nvidia and triton read sequentially in the background (8 readers) from the launch on.
source .anchor/s72/common2.sh
budget=$1
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
find $SP/torch $SP/nvidia $SP/triton -name '*.so*' -size +1M -print0 > /tmp/libs.list
echo "libs: $(tr '\0' '\n' < /tmp/libs.list | wc -l) files, $(xargs -0 du -cm < /tmp/libs.list | tail -1)"
xargs -0 du -m < /tmp/libs.list | sort -n | tail -12
mkdir -p /tmp/cc && tar -C /tmp/cc -xJf $A/s72/cc.tar.xz && du -sh /tmp/cc
( t=$EPOCHREALTIME; xargs -0 -P 8 -n 4 cat < /tmp/libs.list > /dev/null; echo "prefetch done in $(awk -v a=$t -v b=$EPOCHREALTIME "BEGIN{printf \"%.1f\", b-a}") s" > $OUT/q/prefetch.txt ) &
runin2 $R pfresh 200 aotF "${SHORT[@]}" --compile-cache /tmp/cc
wait; cat $OUT/q/prefetch.txt
lim=$((budget - SECONDS)); [ $lim -gt 120 ] && lim=120
[ $lim -ge 60 ] && runin2 $R pfresh2 $lim aotF "${SHORT[@]}" --compile-cache /tmp/cc
