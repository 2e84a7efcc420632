#!/bin/bash
# nvidia-h200: main (the working tree) and branch scalarcols (.anchor/cols) compiled cold at once into
# caches of their own (their step times are contended: not used), launch counts of both caches, then warm timed
# runs one at a time: main, cols, main, cols (as time allows).
source .anchor/s68/common.sh
# cold, both at once
runin $R cold_main 300  main "${SHORT[@]}" &
runin $A/cols cold_cols 300  cols "${SHORT[@]}" &
wait
for v in main cols; do timeout 60 python3 records/launch_counts.py /tmp/ind_$v --names 12 > $OUT/q/launch_counts_$v.md 2>&1; head -9 $OUT/q/launch_counts_$v.md; done
left() { echo $((575 - SECONDS)); }
for pass in 1 2; do
  for v in main cols; do d=$R; [ $v = cols ] && d=$A/cols
    l=$(left); [ $l -lt 100 ] && { echo "no time for $v$pass ($l s)"; break 2; }
    runin $d ${v}$pass $((l < 140 ? l : 140))  $v "${SHORT[@]}"; done; done
for f in $OUT/q/main1.console $OUT/q/cols1.console $OUT/q/main2.console $OUT/q/cols2.console; do [ -f $f ] && echo "$f $(grep -c 'train_loss' $f) $(grep -o 'train_loss[:=][^ ]*' $f | md5sum)"; done
