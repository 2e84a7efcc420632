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
    kernels = None if cuda else cpu_top_level(prof)
    if kernels is None:
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == device_type and (cuda or e.cpu_parent is None)]
    return profile_table(kernels, wall_us, n_steps)[0]


def cpu_top_level(prof):
    """The top-level CPU operators of a finished torch.profiler run, [(name, start_us, end_us)]: the CPU events of
    ``prof.events()`` without a ``cpu_parent``, in its order, read from the profiler's raw events as torch 2.13's
    ``prof.events()`` reads them (the same filter, names, times, threads, async test, sort and nesting), without
    building its Python event tree (seconds per profiled smoke step on the CPU: a CPU profile holds every operator,
    tens of thousands per step). None when torch lacks the private helpers it reuses, or the profile holds memory
    events (``prof.events()`` adds some of them as events): then ``prof.events()``. tests/test_profiling.py
    compares it with ``prof.events()``."""
    cpu = torch.autograd.DeviceType.CPU
    events, frontend, linked = [], [], {}  # [name, start_us, end_us, thread, cpu, sync, correlation id]
    try:
        from torch.autograd.profiler_util import (MEMORY_EVENT_NAME, OUT_OF_MEMORY_EVENT_NAME, _filter_name,
                                                  _rewrite_name)
        result = prof.profiler.kineto_results
        t0 = result.trace_start_ns()
        for k in result.events():
            name = k.name()
            if name in (MEMORY_EVENT_NAME, OUT_OF_MEMORY_EVENT_NAME):
                return None
            if _filter_name(name) or getattr(k, "is_hidden_event", lambda: False)():
                continue
            on_cpu = k.device_type() == cpu
            sync = on_cpu and not (k.is_async() or k.start_thread_id() != k.end_thread_id())
            e = [_rewrite_name(name=name, with_wildcard=True), (k.start_ns() - t0) / 1000,
                 (k.end_ns() - t0) / 1000, k.start_thread_id(), on_cpu, sync, k.correlation_id()]
            events.append(e)
            corr = k.linked_correlation_id()
            if corr > 0:
                linked.setdefault(corr, []).append(e)
            elif corr == 0:
                frontend.append(e)
            else:  # torch raises
                return None
    except (ImportError, AttributeError):  # a torch without these helpers or accessors
        return None
    for fe in frontend:  # a CPU event linked to a frontend operator takes that operator's thread
        if fe[5] and fe[6] in linked:
            for e in linked[fe[6]]:
                if e[4]:
                    e[3] = fe[3]
    events.sort(key=lambda e: (e[1], -e[2]))
    child = set()  # ids of the sync CPU events inside another one of their thread (torch's _populate_cpu_children)
    by_thread = {}
    for e in events:
        if e[5]:
            by_thread.setdefault(e[3], []).append(e)
    for thread_events in by_thread.values():
        stack = []
        for e in thread_events:
            while stack and (e[1] >= stack[-1][2] or e[2] > stack[-1][2]):
                stack.pop()
            if stack:
                child.add(id(e))
            stack.append(e)
    return [(e[0], e[1], e[2]) for e in events if e[4] and id(e) not in child]


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
