#!/bin/bash
# Call B (warm): record #74 at world size 4, full schedule.
set -u
.anchor/multi.sh ${LIM:-560} 'rec4 0,1,2,3 record'
mkdir -p $OUT/full; f=$(ls -t .anchor/pr233/logs/*.txt 2>/dev/null | head -1); [ -n "$f" ] && cp "$f" $OUT/full/rec4.txt
ls -la $OUT/q $OUT/full
