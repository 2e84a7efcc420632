#!/bin/bash
# Usage: bash .anchor/s70/start_probe.sh BUDGET_S N   (a warm machine: main's cache /tmp/ind_main already filled)
# Issue 51: the warm wait with and without torchrun at world size 1. N rounds of: torchrun, then plain python, each
# ended once its step-0 validation line is out. Prints launch to step-0 val and the startup_s line per run.
source .anchor/s68/common.sh
budget=$1; rounds=$2
one() { local name=$1; shift; local log=$OUT/q/$name.console
  [ $((budget - SECONDS)) -lt 90 ] && { echo "no time for $name"; return 1; }
  echo "launch $EPOCHREALTIME $name $*" > $log
  ( TORCHINDUCTOR_CACHE_DIR=/tmp/ind_main TRITON_CACHE_DIR=/tmp/tri_main timeout -k 5 120 "$@" train_gpt.py \
    --train-files "/tmp/code/fineweb_train_*.bin" --val-files "/tmp/code/fineweb_val_*.bin" --log-dir /tmp/logs \
    --checkpoint-dir /tmp/ck/$name --run-id $name 2>&1 < /dev/null | stamp >> $log ) &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do
    grep -q 'step:0/[0-9]* val_loss' $log && { pkill -INT -f "run-id $name"; sleep 8; pkill -9 -f "run-id $name"; break; }
    sleep 0.5; done; wait $pid; rm -rf /tmp/ck/$name
  awk -v n=$name 'NR==1{t0=$2} /startup_s/{s=substr($0, index($0,"startup_s"), 150)} /step:0\/[0-9]* val_loss/{printf "%s launch to step-0 val %.1f s | %s\n", n, $1-t0, s; exit}' $log; }
for r in $(seq 1 $rounds); do
  one tr$r torchrun --standalone --nproc_per_node=1 || break
  one py$r python3 || break
done
