"""Median step time of the slow-Adam steps against the others, per stage, from a log's step lines.

python notes/2026-11-27_MlpOpsAotCache/slow_steps.py LOG...   (ours' or record #74's; both print step:N/T train_time:Xms)
The line of step N gives the time of 0-indexed step N - 1 (train_time is cumulative); every Adam parameter steps on
the odd 0-indexed steps (adam_every=2, both scripts), so a line with N even closes a slow step. Stages as ours:
lines 2-480, 500-960, 980-1440 (the first line of a stage and the steps near its change left out).
"""
import re
import statistics
import sys

for path in sys.argv[1:]:
    prev, times = None, []
    for line in open(path, errors="ignore"):
        m = re.match(r"step:(\d+)/\d+ train_time:(\d+)ms", line)
        if m and "val_loss" not in line:
            n, t = int(m.group(1)), int(m.group(2))
            if prev is not None:
                times.append((n, t - prev))
            prev = t
    for i, (lo, hi) in enumerate(((2, 480), (500, 960), (980, 1440))):
        slow = [d for n, d in times if lo <= n <= hi and n % 2 == 0]
        other = [d for n, d in times if lo <= n <= hi and n % 2 == 1]
        if slow and other:
            print(f"{path}: stage {i}: slow-Adam steps {statistics.median(slow):.1f} ms, others "
                  f"{statistics.median(other):.1f} ms (median, n = {len(slow)} / {len(other)})")
