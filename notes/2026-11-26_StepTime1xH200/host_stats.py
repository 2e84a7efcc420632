"""Host-side statistics of a torch.profiler chrome trace (not part of the repo): python host_stats.py TRACE N_STEPS"""
import json, sys, collections
path, nsteps = sys.argv[1], int(sys.argv[2])
ev = json.load(open(path))["traceEvents"]
X = [e for e in ev if e.get("ph") == "X"]
gpu = [e for e in X if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
rt = [e for e in X if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
ops = [e for e in X if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
gpu.sort(key=lambda e: e["ts"])
if not gpu: gpu=[{"ts":0,"dur":0,"args":{}}]
span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
busy = 0; end = -1
for e in gpu:
    s, f = e["ts"], e["ts"] + e["dur"]
    if f > end:
        busy += f - max(s, end); end = f
print(f"GPU: {len(gpu)/nsteps:.0f} kernels/step, span {span/nsteps/1000:.1f} ms/step, busy {busy/nsteps/1000:.1f}, idle {(span-busy)/nsteps/1000:.1f}")
corr = {e["args"].get("correlation"): e for e in rt if "correlation" in e.get("args", {})}
lag = []; starved = 0; starved_us = 0
prev_end = None
for e in gpu:
    r = corr.get(e["args"].get("correlation"))
    if r is None: continue
    wait = e["ts"] - (r["ts"] + r["dur"])  # kernel start after its launch returned
    if prev_end is not None and e["ts"] - prev_end > 1.0 and wait < 5.0:
        starved += 1; starved_us += e["ts"] - prev_end
    prev_end = max(prev_end or 0, e["ts"] + e["dur"])
print(f"kernels that started <5us after their launch returned, after a GPU gap >1us: {starved/nsteps:.0f}/step, their gaps {starved_us/nsteps/1000:.1f} ms/step")
c = collections.Counter(); d = collections.Counter()
for e in rt:
    c[e["name"]] += 1; d[e["name"]] += e["dur"]
print("runtime calls per step (count, ms):")
for n, _ in d.most_common(12):
    print(f"  {c[n]/nsteps:8.0f} {d[n]/nsteps/1000:8.2f}  {n}")
tids = collections.Counter(e["tid"] for e in ops)
main = tids.most_common(1)[0][0]
mo = sorted([e for e in ops if e["tid"] == main], key=lambda e: (e["ts"], -e["dur"]))
# self time by name (stack nesting)
selft = collections.Counter(); cnt = collections.Counter(); incl = collections.Counter(); stack = []
rts = sorted([e for e in rt if e["tid"] == main], key=lambda e: e["ts"])
allev = sorted(mo + rts, key=lambda e: (e["ts"], -e["dur"]))
for e in allev:
    while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
        stack.pop()
    if stack:
        selft[stack[-1]["name"][:100]] -= e["dur"]
    selft[e["name"][:100]] += e["dur"]; cnt[e["name"][:100]] += 1; incl[e["name"][:100]] += e["dur"]
    stack.append(e)
tot = sum(selft.values())
print(f"main thread ({main}): events' self time {tot/nsteps/1000:.1f} ms/step; top by self time (count/step, self ms/step, incl ms/step):")
for n, v in selft.most_common(40):
    print(f"  {cnt[n]/nsteps:7.0f} {v/nsteps/1000:8.2f} {incl[n]/nsteps/1000:8.2f}  {n}")
top = [e for e in mo]
if top:
    w = (max(e["ts"] + e["dur"] for e in mo) - min(e["ts"] for e in mo))
    print(f"main thread wall from first to last op: {w/nsteps/1000:.1f} ms/step")
