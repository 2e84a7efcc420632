"""GPU time by category, two profiled runs side by side: ``python records/profile_compare.py A B [--steps N]``.

A and B are torch.profiler chrome traces of the same number of training steps (``train_gpt.py --profile-steps N``
writes one per stage next to the log, ``*_profile_stage<i>_rank0.json``), or the compact form of one
(``--compact TRACE OUT.json.gz`` keeps only the GPU's kernels, copies and annotations: a trace of 4 speedrun steps
is ~10^2 MB, its compact form ~1 MB). Prints a Markdown table: ms per step and per micro-step by category, then
the 15 kernels of each with the most time.

Categories (first match wins): ``optimizer``: every kernel that runs inside a GPU range named ``optimizer_step``
(``torch.profiler.record_function`` around the optimizer step: the trainer's ``Trainer.train_step`` has it) or
with one of our optimizer kernels' names; ``attention fwd`` / ``attention bwd``: FlashAttention's kernels;
``cross entropy``: the soft-capped CE kernels; ``matmul``: cuBLAS/CUTLASS GEMMs and fused Triton matmuls;
``copies``: memcpy/memset and transposes or copies outside the optimizer; ``elementwise/norms``: the rest
(inductor's fused kernels, embeddings). ``idle``: the span from the first kernel's start to the last kernel's end,
minus the union of kernel intervals (the GPU waiting for the host). Kernels launched in the backward's gradient
hooks (our fp32 gradient accumulation) run outside the optimizer range and count as elementwise.
"""
import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profiling import busy_us  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
OPT_RANGE = "optimizer_step"
OPT_NAMES = ("_adamw_kernel", "_momentum_", "_normuon_", "_gram_kernel", "_gemm_epilogue_kernel",
             "_normalize_kernel", "xxt_kernel", "xtx_kernel", "ba_plus_caa_kernel")
CATEGORIES = ("matmul", "attention fwd", "attention bwd", "cross entropy", "elementwise/norms", "optimizer",
              "copies", "idle")
TOP = 15


def load(path):
    """{"kernels": [[name, start_us, dur_us, cat]], "ranges": [[name, start_us, dur_us]]} of a chrome trace or of
    its compact form."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    if "kernels" in data:
        return data
    kernels, ranges = [], []
    for e in data.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        if e.get("cat") in GPU_CATS:
            kernels.append([e["name"], float(e["ts"]), float(e.get("dur", 0.0)), e["cat"]])
        elif e.get("cat") == "gpu_user_annotation":
            ranges.append([e["name"], float(e["ts"]), float(e.get("dur", 0.0))])
    return {"kernels": kernels, "ranges": ranges}


def category(name, cat, start, opt_ranges):
    low = name.lower()
    if any(a <= start < b for a, b in opt_ranges) or any(p in low for p in OPT_NAMES):
        return "optimizer"
    if cat != "kernel":
        return "copies"
    if "flash" in low or "fmha" in low:
        return "attention bwd" if "bwd" in low or "backward" in low else "attention fwd"
    if "_ce_" in low or "softcapped_entropy" in low or "cross_entropy" in low:
        return "cross entropy"
    if low.startswith("triton_tem"):      # inductor's matmul templates
        return "matmul"
    if low.startswith("triton_"):         # inductor's fused pointwise/reduction kernels (names list fused ops)
        return "elementwise/norms"
    if any(p in low for p in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "linear_relu_square", "_mm_",
                              "fused_mm", "matmul")):
        return "matmul"
    if "transpose" in low or "copy" in low:
        return "copies"
    return "elementwise/norms"


def summarise(trace, skip=0):
    """(ms per category, {(kernel, category): (ms, calls)}, span ms, optimizer ranges found) over the trace (a
    kernel that runs both inside and outside the optimizer gets two rows). skip: leave out the kernels up to the
    end of the skip-th optimizer range (the first steps, e.g. one that recompiled: its autotuning runs kernels)."""
    opt = sorted((a, a + d) for name, a, d in trace["ranges"] if name == OPT_RANGE)
    if skip:
        if len(opt) <= skip:
            raise SystemExit(f"profile_compare.py: --skip-steps {skip} needs more than {skip} `{OPT_RANGE}` ranges "
                             f"(the trace has {len(opt)})")
        cut = opt[skip - 1][1]
        trace = {"kernels": [k for k in trace["kernels"] if k[1] >= cut], "ranges": trace["ranges"]}
        opt = opt[skip:]
    per_cat = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel = {}
    intervals = []
    for name, a, d, cat in trace["kernels"]:
        c = category(name, cat, a, opt)
        per_cat[c] += d / 1e3
        t, n = per_kernel.get((name, c), (0.0, 0))
        per_kernel[(name, c)] = (t + d / 1e3, n + 1)
        intervals.append((a, a + d))
    if not intervals:
        raise SystemExit("profile_compare.py: no GPU kernels in the trace (a CPU-only profile?)")
    span = (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e3
    per_cat["idle"] = max(span - busy_us(intervals) / 1e3, 0.0)
    return per_cat, per_kernel, span, len(opt)


def table(paths, names, steps, micro, skip=0):
    """steps: the training steps in each trace (one int for all, or one per trace)."""
    out = []
    sums = [summarise(load(p), skip) for p in paths]
    counts = [n - skip for n in (steps if isinstance(steps, (list, tuple)) else [steps] * len(paths))]
    said = str(counts[0]) if len(set(counts)) == 1 else " / ".join(map(str, counts))
    out.append(f"| ms per step ({said} profiled steps; per micro-step: / {micro}) | "
               + " | ".join(names) + (" | ratio |" if len(names) == 2 else " |"))
    out.append("|---" * (len(names) + 1 + (len(names) == 2)) + "|")
    rows = list(CATEGORIES) + ["span (kernels' first start to last end)"]
    for r in rows:
        vals = [(s[0][r] if r in s[0] else s[2]) / n for s, n in zip(sums, counts)]
        cells = [f"{v:.3f} ({v / micro:.3f})" for v in vals]
        ratio = [f"{vals[0] / vals[1]:.2f}" if vals[1] > 0 else "-"] if len(vals) == 2 else []
        out.append(f"| {r} | " + " | ".join(cells + ratio) + " |")
    for name, s, steps in zip(names, sums, counts):
        out.append("")
        out.append(f"{name}: {s[3]} `{OPT_RANGE}` ranges; the {TOP} kernels with the most time (ms per step):")
        out.append("")
        out.append("| ms/step | calls/step | category | kernel |")
        out.append("|---|---|---|---|")
        for (k, c), (t, n) in sorted(s[1].items(), key=lambda kv: -kv[1][0])[:TOP]:
            out.append(f"| {t / steps:.3f} | {n / steps:g} | {c} | `{k[:90]}` |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="*", help="chrome traces (or compact .json.gz) of the runs to compare")
    p.add_argument("--names", default="ours,record #74", help="column names, comma-separated")
    p.add_argument("--steps", default="4", metavar="N[,N]",
                   help="training steps in each trace: one count for all, or one per trace (e.g. 3,4)")
    p.add_argument("--micro", type=int, default=8, help="micro-steps per step (8 at world size 1)")
    p.add_argument("--skip-steps", type=int, default=0, metavar="K",
                   help="leave out the first K steps of each trace (ends found by the optimizer_step ranges)")
    p.add_argument("--compact", nargs=2, metavar=("TRACE", "OUT"), help="write the compact form of TRACE")
    a = p.parse_args(argv)
    if a.compact:
        src, dst = a.compact
        if not Path(src).is_file():
            p.exit(2, f"profile_compare.py: --compact: no file {src}\n")
        with gzip.open(dst, "wt") as f:
            json.dump(load(src), f)
        return
    for t in a.traces:
        if not Path(t).is_file():
            p.exit(2, f"profile_compare.py: no file {t}\n")
    if not a.traces:
        p.exit(2, "profile_compare.py: name one or two traces (or --compact TRACE OUT)\n")
    names = a.names.split(",")[:len(a.traces)]
    try:
        steps = [int(n) for n in a.steps.split(",")]
    except ValueError:
        steps = []
    if len(steps) == 1:
        steps *= len(a.traces)
    if len(steps) != len(a.traces):
        p.exit(2, f"profile_compare.py: --steps takes one count or one per trace ({len(a.traces)}), got {a.steps!r}\n")
    if not all(0 <= a.skip_steps < n for n in steps):
        p.exit(2, f"profile_compare.py: --skip-steps must be in [0, --steps) ({a.skip_steps}, {a.steps})\n")
    print(table(a.traces, names, steps, a.micro, a.skip_steps))


if __name__ == "__main__":
    main()
