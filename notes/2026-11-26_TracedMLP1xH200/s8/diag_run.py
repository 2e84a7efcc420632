"""Diagnostic launcher (never committed): train_gpt.main() with CUDA events around every step and micro-batch.
DIAG_MODE: async (as train_gpt), lagK (the host waits, before launching micro-batch j, until the GPU has started
micro-batch j-K). Prints GPU-side per-step times (end event to end event), the GPU's wait for the host at step
starts, and the host-side times, for stage 0 and the first 100 steps of stage 1."""
import os, sys, statistics, time
sys.path.insert(0, os.getcwd())
import torch
import train_gpt as tg

MODE = os.environ.get("DIAG_MODE", "async")
K = int(MODE[3:]) if MODE.startswith("lag") else 0
OUT = os.environ.get("OUT", "/tmp")
rec = {}          # step -> (host_start, host_end, ev_start, ev_end)
micro = []        # start events of training micro-batches
orig_forward, orig_step = tg.forward, tg.Trainer.train_step


def forward(*a, train=False, **kw):
    if train:
        if K and len(micro) >= K:
            micro[-K].synchronize()
        ev = torch.cuda.Event(); ev.record(); micro.append(ev)
        if len(micro) > 64:
            del micro[:32]
    return orig_forward(*a, train=train, **kw)


def dump(lo, hi, tag):
    torch.cuda.synchronize()
    gpu, gap, host = [], [], []
    for s in range(lo + 1, hi):
        if s in rec and s - 1 in rec:
            gpu.append((rec[s - 1][3].elapsed_time(rec[s][3]), s))
            gap.append(rec[s - 1][3].elapsed_time(rec[s][2]))
            host.append((1000 * (rec[s][1] - rec[s - 1][1]), s))
    if not gpu:
        return
    g = [x for x, _ in gpu]; h = [x for x, _ in host]
    lines = [f"diag {MODE} {tag} steps {lo + 1}..{hi - 1} n={len(g)}",
             f"  GPU end-to-end ms: median {statistics.median(g):.1f} min {min(g):.1f} max {max(g):.1f} "
             f"max/min {max(g) / min(g):.2f} mean {statistics.mean(g):.1f}",
             f"  host ms: median {statistics.median(h):.1f} min {min(h):.1f} max {max(h):.1f} max/min {max(h) / min(h):.2f}"
             f" mean {statistics.mean(h):.1f}",
             f"  GPU waiting for the host at step starts: total {sum(x for x in gap if x > 0):.1f} ms, "
             f"steps with > 1 ms: {sum(x > 1 for x in gap)}, max {max(gap):.1f}",
             "  slowest GPU steps (ms, step): " + str([(round(x, 1), s) for x, s in sorted(gpu)[-8:]]),
             "  slowest host steps (ms, step): " + str([(round(x, 1), s) for x, s in sorted(host)[-8:]])]
    with open(f"{OUT}/diag_{MODE}.txt", "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def train_step(self, step, want_loss):
    e0 = torch.cuda.Event(enable_timing=True); e0.record(); t0 = time.perf_counter()
    r = orig_step(self, step, want_loss)
    e1 = torch.cuda.Event(enable_timing=True); e1.record()
    rec[step] = (t0, time.perf_counter(), e0, e1)
    s1 = tg.stage_bounds(self.hp)[1][0]
    if step == s1 - 1:
        dump(1, s1, "stage0")
    if step == s1 + 101:
        dump(s1 + 1, s1 + 101, "stage1")
    return r


tg.forward, tg.Trainer.train_step = forward, train_step
if __name__ == "__main__":
    tg.main()
