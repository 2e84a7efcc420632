import sys, collections
sys.path.insert(0, 'records'); sys.path.insert(0, '.')
from profile_compare import load
a, b = (load(p) for p in sys.argv[1:3])
def agg(t):
    d = collections.defaultdict(lambda: [0.0, 0])
    for name, start, dur, cat in t["kernels"]:
        import re; n = re.sub(r"_\d+$", "", name); d[n][0] += dur; d[n][1] += 1
    return d
A, B = agg(a), agg(b)
rows = []
for k in set(A) | set(B):
    ta, na = A.get(k, [0, 0]); tb, nb = B.get(k, [0, 0])
    rows.append((tb - ta, ta, tb, na, nb, k))
rows.sort()
steps = 3
print("delta_ms/step static dynamic n_s n_d kernel")
for r in rows[:12] + [None] + rows[-25:]:
    if r is None: print("..."); continue
    print(f"{r[0]/1e3/steps:8.3f} {r[1]/1e3/steps:8.3f} {r[2]/1e3/steps:8.3f} {r[3]:5d} {r[4]:5d} {r[5][:110]}")
