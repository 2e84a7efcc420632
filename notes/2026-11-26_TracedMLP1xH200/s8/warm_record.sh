#!/bin/bash
# Warm record #74's inductor cache on this machine: its cold start, stopped once its first timed step is logged.
set -u
timeout 590 .anchor/side.sh 470 --only record > $OUT/warm_side.txt 2>&1 &
P=$!
t0=$(date +%s)
until grep -q "step:2/" $OUT/side/anchor.log 2>/dev/null || ! kill -0 $P 2>/dev/null; do sleep 2; done
echo "first steps after $(( $(date +%s) - t0 )) s"
pkill -TERM -f "master_port=29611"; sleep 5; pkill -KILL -f "master_port=29611"; pkill -KILL -f "train_gpt.py"
wait $P
mv $OUT/side $OUT/warm
ls /tmp/torchinductor_$(whoami) 2>/dev/null | head -3; du -sh /tmp/torchinductor_* 2>/dev/null
