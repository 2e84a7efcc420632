"""train_gpt.py --profile-steps N: run steps under torch.profiler, write a chrome trace, summarise it as a table.

``profile_stages`` profiles N steps from each stage start (the trainer's steps come in as functions);
``profile`` runs a function under torch.profiler, exports the chrome trace and returns the lines of
``profile_table``: the kernels with the most total time, the time by category (communication, optimizer,
attention, matmul, copies, elementwise/other, by kernel-name patterns in ``PROFILE_CATEGORIES``; idle = wall
time minus the union of kernel intervals), and how much of the communication ran while other kernels ran
(overlapped) or alone (exposed). On the CPU the "kernels" are the top-level operators.
"""
import time

import torch

# Kernel name patterns -> category, first match wins (lower-case substrings). Our optimizer kernels come before
# matmul: Polar Express's Gram and GEMM kernels are matmuls, counted as optimizer. Copies: kernels.transpose's
# kernel (the FP8 head's e4m3 operands and e5m2 gradient, and while tied the optimizer's embedding fold and
# write-back: the table has no ranges to tell them apart) and the GPU's memcpy / memset.
PROFILE_CATEGORIES = (
    ("communication", ("nccl", "all_reduce", "allreduce", "reduce_scatter", "reducescatter", "all_gather",
                       "allgather", "gloo", "c10d::")),
    ("optimizer", ("_adamw_kernel", "_momentum_", "_normuon_", "_gram_kernel", "_gemm_epilogue_kernel",
                   "_normalize_kernel")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "_mm_",
                "fused_mm", "matmul")),
    ("copies", ("_transpose_kernel", "memcpy", "memset")),
)


PROFILE_TOP = 15  # kernels listed by total time


def kernel_category(name):
    low = name.lower()
    for category, patterns in PROFILE_CATEGORIES:
        if any(p in low for p in patterns):
            return category
    return "elementwise/other"


def busy_us(intervals):
    """Length of the union of [start, end) intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profile_table(kernels, wall_us, n_steps, top=PROFILE_TOP):
    """Lines of the profile summary. kernels: [(name, start_us, end_us)] of the device (or, on the CPU, the
    top-level operators); wall_us: wall time of the n_steps profiled steps. Idle = wall - busy (union).
    Communication overlap: of the time some communication kernel runs (the union of their intervals), the part
    during which another kernel runs too (hidden behind compute) and the rest (exposed: only collectives run)."""
    per_name, per_cat = {}, {c: 0.0 for c, _ in PROFILE_CATEGORIES}
    per_cat["elementwise/other"] = 0.0
    for name, a, b in kernels:
        t, n = per_name.get(name, (0.0, 0))
        per_name[name] = (t + (b - a), n + 1)
        per_cat[kernel_category(name)] += b - a
    busy = busy_us([(a, b) for _, a, b in kernels])
    lines = [f"profile: {n_steps} steps, wall {wall_us / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
             f"(per step: {wall_us / 1e3 / max(n_steps, 1):.2f} ms)",
             f"  {'total ms':>9} {'%wall':>6} {'calls':>6}  category           kernel"]
    for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:9.3f} {100 * t / max(wall_us, 1e-9):6.1f} {n:6d}  {kernel_category(name):<18} "
                     f"{name[:100]}")
    comm = busy_us([(a, b) for name, a, b in kernels if kernel_category(name) == "communication"])
    other = busy_us([(a, b) for name, a, b in kernels if kernel_category(name) != "communication"])
    overlap = max(comm + other - busy, 0.0)  # |C and K| = |C| + |K| - |C or K|
    lines.append(f"  communication: busy {comm / 1e3:.2f} ms, overlapped {overlap / 1e3:.2f} ms "
                 f"({100 * overlap / max(comm, 1e-9):.1f}%), exposed {(comm - overlap) / 1e3:.2f} ms")
    per_cat["idle"] = max(wall_us - busy, 0.0)
    lines.append("  by category: " + "  ".join(f"{c} {t / 1e3:.2f} ms ({100 * t / max(wall_us, 1e-9):.1f}%)"
                                               for c, t in per_cat.items()))
    return lines, per_cat


def profile(run, n_steps, device, trace):
    """Run ``run()`` (n_steps training steps) under torch.profiler on ``device``, write the chrome trace to the
    path ``trace`` and return the lines of its profile_table (device kernels; on the CPU, top-level operators)."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    with torch.profiler.profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        wall_us = 1e6 * (time.perf_counter() - t0)
    prof.export_chrome_trace(str(trace))
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == device_type and (cuda or e.cpu_parent is None)]
    return profile_table(kernels, wall_us, n_steps)[0]


def profile_stages(stages, n_steps, rewind, train_step, reset, log, d):
    """--profile-steps N, before the timed run: for each stage (start, end) of ``stages`` (the last ends the run),
    rewind(start) (the first documents, the schedule at start), then steps start .. start + N - 1 (train_step(s),
    N cut at the run's end) under torch.profiler (``profile``): a chrome trace per stage and rank next to the log,
    a table in the log; then reset() (the trainer's full state reset, as after the compile warmup). Untimed: the
    record's train time never includes the profiler. The steps start from the initial weights, not from the
    weights the run has at that stage: kernel times depend on shapes, not values. d: the run's ranks and device."""
    for i, (start, end) in enumerate(stages):
        if start >= end:
            continue
        rewind(start)
        n = min(n_steps, stages[-1][1] - start)
        trace = log.path.parent / f"{log.path.stem}_profile_stage{i}_rank{d.rank}.json"
        lines = profile(lambda: [train_step(s) for s in range(start, start + n)], n, d.device, trace)
        log(f"profile_stage{i}: steps {start}..{start + n - 1}, trace {trace}"
            + ("" if d.device.type == "cuda" else " (CPU: top-level operators, not GPU kernels)"))
        for line in lines:
            log(line)
    reset()
