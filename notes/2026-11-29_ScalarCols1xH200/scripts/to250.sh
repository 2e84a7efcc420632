#!/bin/bash
# Usage: bash .anchor/s70/to250.sh BUDGET_S JOB...   JOB = "NAME TAG SEED", TAG main or a folder of .anchor (cols, lb)
# Runs each job one after the other, at world size 1 on the full default schedule, and ends it once its step-250
# validation line is out (stage 0 is steps 0-458: every step timed is a stage-0 step). main is the working tree,
# any other TAG is .anchor/TAG (cols: branch scalarcols, lb: branch lambank); each keeps its own inductor/Triton cache (/tmp/ind_TAG), so the first job of each is cold.
# Prints per job: startup, compile warmup, launch to step-0 val, stage-0 median step ms (steps 2-250), val@250;
# then writes $OUT/q/launch_counts_TAG.md for each TAG and prints its table's rows.
source .anchor/s68/common.sh
budget=$1; shift
to250() { local name=$1 tag=$2 seed=$3 d=$R; [ $tag = main ] || d=$A/$tag
  local lim=$((budget - SECONDS)); [ $lim -gt 300 ] && lim=300
  [ $lim -lt 150 ] && { echo "no time for $name ($lim s)"; return 1; }
  runin $d $name $lim $tag --seed $seed &
  local pid=$!
  while kill -0 $pid 2>/dev/null; do
    grep -q 'step:250/[0-9]* val_loss' $OUT/q/$name.console 2>/dev/null && { pkill -INT -f "run-id $name" ; sleep 8; pkill -9 -f "run-id $name"; break; }
    sleep 1; done; wait $pid
  python3 - $OUT/q/$name.console <<'PY'
import re, sys, statistics as st
lines = open(sys.argv[1]).read().splitlines()
t0 = float(lines[0].split()[1]); out = {}
tt = {}
for l in lines[1:]:
    ts, _, body = l.partition(' ')
    m = re.search(r'step:(\d+)/\d+ val_loss:([\d.]+)', body)
    if m and m.group(1) == '0': out['launch_to_val0'] = f"{float(ts) - t0:.1f}"
    if m and m.group(1) == '250': out['val250'] = m.group(2)
    m = re.search(r'step:(\d+)/\d+ train_time:(\d+)ms', body)
    if m: tt[int(m.group(1))] = int(m.group(2))
    for k in ('startup_s', 'compile_warmup_s'):
        m = re.search(k + r': ([\d.]+)', body)
        if m: out[k] = m.group(1)
d = [tt[s] - tt[s - 1] for s in range(3, 251) if s in tt and s - 1 in tt]
if d: out['stage0_ms_median'] = st.median(d); out['stage0_ms_mean'] = round(st.mean(d), 2)
print(sys.argv[1].split('/')[-1], out)
PY
}
for job in "$@"; do to250 $job || break; done
# the launch counts of every cache these jobs used (inductor's output per graph: records/launch_counts.py)
for tag in $(for job in "$@"; do set -- $job; echo $2; done | sort -u); do [ -d /tmp/ind_$tag ] || continue
  timeout 30 python3 records/launch_counts.py /tmp/ind_$tag --names 12 > $OUT/q/launch_counts_$tag.md 2>&1
  echo "$tag:"; sed -n 3,9p $OUT/q/launch_counts_$tag.md | cut -d'|' -f3-5; done
