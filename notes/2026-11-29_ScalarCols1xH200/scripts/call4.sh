#!/bin/bash
# fresh machine: branch scalarcols (.anchor/cols, post table in stored order) cold, then main cold, one after the
# other (two cold runs at once ran out of GPU memory), then the launch counts of both caches
source .anchor/s68/common.sh
runin $A/cols cold_cols 215 cols "${SHORT[@]}"
runin $R cold_main $((455 - SECONDS < 215 ? 455 - SECONDS : 215)) main "${SHORT[@]}"
for v in cols main; do timeout 30 python3 records/launch_counts.py /tmp/ind_$v --names 12 > $OUT/q/launch_counts_$v.md 2>&1; head -10 $OUT/q/launch_counts_$v.md; done
for f in $OUT/q/*.console; do echo "$f $(grep -c 'train_loss' $f) $(grep -o 'val_loss[:=][^ ]*' $f | tail -1)"; grep -m3 "Error" $f | cut -c1-300; done
