#!/bin/bash
# warm machine after call_cols.sh: warm timed runs one at a time, cols, main, cols, main (as time allows)
source .anchor/s68/common.sh
left() { echo $((410 - SECONDS)); }
for v in cols2 main2 cols3 main3; do d=$R; t=main; case $v in cols*) d=$A/cols; t=cols;; esac
  l=$(left); [ $l -lt 95 ] && { echo "no time for $v ($l s)"; break; }
  runin $d $v $((l < 130 ? l : 130)) $t "${SHORT[@]}"; done
for f in $OUT/q/*.console; do echo "$f $(grep -c 'train_loss' $f) $(grep -o 'val_loss[:=][^ ]*' $f | tail -1)"; done
