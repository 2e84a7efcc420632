"""Tests of profiling.py (train_gpt.py --profile-steps): the profile table's categories, busy and idle time, the
communication overlap line that records/compare.py reads back, profile_stages' steps per stage, and cpu_top_level
(the CPU path's top-level operators) against torch's own reading. The profiled smoke run itself is tested in
test_train_gpt.py."""
import types

import pytest
import torch

from profiling import busy_us, cpu_top_level, kernel_category, profile_stages, profile_table
from test_train_gpt import compare  # records/compare.py, the one parser of the trainer's logs


def test_profile_table_categorises_kernels():
    """Synthetic kernels (name, start us, end us): categories by name, busy time as the union of overlapping
    intervals (a reduce-scatter on another stream under a GEMM), idle = wall - busy, top list by total time."""
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 50, 150),   # overlaps the GEMM by 50
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 150, 170),
        ("pytorch_flash::flash_fwd_kernel", 170, 230),       
        ("_normuon_apply_kernel", 230, 240),
        ("_gram_kernel", 240, 260),                                  # Polar Express: optimizer, not matmul
        ("_adamw_kernel", 260, 265),
        ("triton_poi_fused_add_mul_0", 265, 270),
        ("_ce_fwd_kernel", 300, 310),                                # gap 270..300 is idle
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 310, 330),
    ]
    lines, cat = profile_table(kernels, wall_us=400.0, n_steps=2, top=3)
    assert cat == {"communication": 100.0, "optimizer": 35.0, "attention": 60.0, "matmul": 140.0, "copies": 0.0,
                   "elementwise/other": 15.0, "idle": 400.0 - 330.0 + 30.0}
    assert busy_us([(a, b) for _, a, b in kernels]) == 300.0
    top = [line.split()[-1] for line in lines[2:5]]
    assert top == ["sm90_xmma_gemm_bf16bf16_bf16f32", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
                   "pytorch_flash::flash_fwd_kernel"]
    assert "calls" in lines[1] and lines[2].split()[2] == "2", "the two GEMM calls are one row"
    assert lines[-1].startswith("  by category:") and "idle 0.10 ms (25.0%)" in lines[-1]


def test_profile_table_reports_communication_overlap():
    """The communication line: busy = the union of the communication kernels' intervals (two collectives that
    overlap each other count once), overlapped = the part of it during which another kernel runs (another
    stream), exposed = the rest; records/compare.py, the one parser of the log, reads it back."""
    ms = 1000.0
    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100 * ms),
               ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 50 * ms, 150 * ms),  # 50 ms under the GEMM
               ("ncclDevKernel_AllGather_RING_LL", 140 * ms, 160 * ms),            # overlaps the reduce-scatter
               ("triton_poi_fused_add_mul_0", 155 * ms, 170 * ms),                  # 5 ms over the all-gather
               ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 200 * ms, 210 * ms)]     # alone
    lines, _ = profile_table(kernels, wall_us=300 * ms, n_steps=1)
    assert "  communication: busy 120.00 ms, overlapped 55.00 ms (45.8%), exposed 65.00 ms" in lines
    assert lines[-1].startswith("  by category: communication 130.00 ms")  # a sum: their 10 ms overlap twice
    run = compare.parse_log_text("\n".join(["=" * 100, "profile_stage0: steps 0..0, trace t.json", *lines,
                                             "step:1/1 train_time:300ms step_avg:300.00ms"]))
    assert run.profile[0]["communication"] == {"busy_ms": 120.0, "overlapped_ms": 55.0, "exposed_ms": 65.0}
    assert run.profile[0]["steps"] == 1 and run.profile[0]["categories"]["communication"] == 130.0


def test_transposes_and_memory_copies_are_copies_not_optimizer():
    """kernels.transpose's kernel also writes the FP8 head's e4m3 operands and e5m2 gradient transposed (not
    optimizer work); GPU memcpy / memset are copies too. Polar Express's Gram kernel stays optimizer."""
    assert kernel_category("_transpose_kernel") == "copies"
    assert kernel_category("Memcpy DtoD (Device -> Device)") == kernel_category("Memset (Device)") == "copies"
    assert kernel_category("_gram_kernel") == "optimizer" and kernel_category("aten::copy_") == "elementwise/other"
    lines, cat = profile_table([("_transpose_kernel", 0, 10), ("_adamw_kernel", 10, 12)], wall_us=20.0, n_steps=1)
    assert cat["copies"] == 10.0 and cat["optimizer"] == 2.0 and " copies 0.01 ms (50.0%)" in lines[-1]


def test_profile_stages_profiles_each_stage_start_then_resets(tmp_path):
    """N steps from each non-empty stage start (cut at the run's end), each after a rewind to that start; one
    trace per stage named after the log; the trainer's reset once at the end."""
    class Log(list):  # the trainer's Logger: called with a line, knows its path
        path = tmp_path / "run.txt"

        def __call__(self, line):
            self.append(line)

    calls, log = [], Log()
    d = types.SimpleNamespace(rank=0, device=types.SimpleNamespace(type="cpu"))
    profile_stages([(0, 4), (4, 4), (4, 9), (9, 10)], 3, lambda s: calls.append(("rewind", s)),
                   lambda s: calls.append(("step", s)), lambda: calls.append(("reset",)), log, d)
    assert calls == [("rewind", 0), ("step", 0), ("step", 1), ("step", 2), ("rewind", 4), ("step", 4), ("step", 5),
                     ("step", 6), ("rewind", 9), ("step", 9), ("reset",)]
    heads = [line for line in log if line.startswith("profile_stage")]
    assert heads[0] == f"profile_stage0: steps 0..2, trace {tmp_path / 'run_profile_stage0_rank0.json'} (CPU: " \
                       f"top-level operators, not GPU kernels)"
    assert [h.split(":")[0] for h in heads] == ["profile_stage0", "profile_stage2", "profile_stage3"]
    assert "steps 9..9" in heads[2] and (tmp_path / "run_profile_stage3_rank0.json").is_file()


# profile() reads CUDA profiles with prof.events(): cpu_top_level serves CPU-only runs, CI's torch (2.13) here.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of profile(); checked on CI's torch")


@cpu_only
def test_cpu_top_level_is_what_prof_events_gives(tmp_path):
    """profiling.cpu_top_level (the CPU path of ``profile``) lists exactly the top-level CPU events of
    ``prof.events()``, in its order: a profile of forwards and backwards (autograd's events, nested operators), a
    record_function range with operators inside and a gloo collective, as in a profiled smoke step."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        w = torch.randn(32, 32, requires_grad=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                with torch.profiler.record_function("my_range"):
                    loss = torch.nn.functional.gelu(torch.randn(8, 32) @ w).sum()
                loss.backward()
                grad = w.grad.clone()
                dist.all_reduce(grad)
    finally:
        dist.destroy_process_group()
    events = prof.events()
    want = [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
    assert cpu_top_level(prof) == want
    names = {name for name, _, _ in want}
    assert "my_range" in names and any("all_reduce" in n for n in names), names
    assert sum(e.cpu_parent is not None for e in events) > len(want), "few nested events: the test lost its point"


class _RawEvent:
    """A stand-in for one of the profiler's raw (kineto) events: the fields given, the rest empty."""

    def __init__(self, name, start_us, end_us, thread=1, end_thread=None, device="CPU", is_async=False, corr=0,
                 linked=0):
        self.fields = dict(name=name, start_ns=1000 * start_us, end_ns=1000 * end_us, start_thread_id=thread,
                           end_thread_id=thread if end_thread is None else end_thread, is_async=is_async,
                           device_type=getattr(torch.autograd.DeviceType, device), correlation_id=corr,
                           linked_correlation_id=linked)

    def __getattr__(self, key):
        if key == "fields":
            raise AttributeError(key)
        if key in self.fields:
            return lambda: self.fields[key]
        empty = {"kwinputs": {}, "metadata_json": "", "overload_name": "", "extra_meta": None}
        lists = ("shapes", "stack", "concrete_inputs", "dtypes", "structured_input_shapes", "structured_input_strides")
        return lambda: [] if key in lists else empty.get(key, 0)


@cpu_only
def test_cpu_top_level_on_the_edge_cases_of_the_nesting():
    """Raw events made up to hit each rule of torch's own reading (torch.autograd.profiler.profile's
    _parse_kineto_results and EventList._build_tree, run here on the same events as the reference), and the
    answer written out: a child listed before its parent with the same start; an event starting where its
    predecessor ends (a sibling), an instant one at its end too; one overlapping its predecessor's end (not its
    child); an async event and one that ends on another thread (never children, always listed); a GPU event (not
    listed); torch's filtered names (aten::is_leaf); ProfilerStep#N (listed as ProfilerStep*); a CPU event on
    thread 7 linked to an operator of thread 1 (it moves to thread 1, inside that operator). Memory events: None
    (prof.events() turns some into events)."""
    from torch.autograd.profiler import profile as autograd_profile
    from torch.autograd.profiler_util import EventList
    raw = [
        _RawEvent("child", 10, 20), _RawEvent("parent", 10, 40), _RawEvent("grandchild", 12, 15),
        _RawEvent("sibling", 40, 50), _RawEvent("straddles", 45, 60), _RawEvent("inside_straddles", 46, 47),
        _RawEvent("instant_at_its_end", 60, 60),
        _RawEvent("async", 11, 12, is_async=True), _RawEvent("two_threads", 13, 14, end_thread=3),
        _RawEvent("gpu_kernel", 0, 100, device="CUDA"), _RawEvent("aten::is_leaf", 70, 71),
        _RawEvent("ProfilerStep#7", 0, 100, thread=2), _RawEvent("step_op", 5, 8, thread=2),
        _RawEvent("launcher", 80, 90, corr=42), _RawEvent("runtime", 82, 83, thread=7, linked=42),
        _RawEvent("alone_on_7", 84, 85, thread=7)]

    def top_level(events):
        result = types.SimpleNamespace(events=lambda: events, trace_start_ns=lambda: 0)
        ref = EventList(autograd_profile._parse_kineto_results(types.SimpleNamespace(use_device=None), result))
        ref._build_tree()
        want = [(e.name, e.time_range.start, e.time_range.end) for e in ref
                if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None]
        return want, cpu_top_level(types.SimpleNamespace(profiler=types.SimpleNamespace(kineto_results=result)))

    want, got = top_level(raw)
    assert got == want
    assert got == [("ProfilerStep*", 0.0, 100.0), ("parent", 10.0, 40.0), ("async", 11.0, 12.0),
                   ("two_threads", 13.0, 14.0), ("sibling", 40.0, 50.0), ("straddles", 45.0, 60.0),
                   ("instant_at_its_end", 60.0, 60.0), ("launcher", 80.0, 90.0), ("alone_on_7", 84.0, 85.0)]
    assert top_level([*raw, _RawEvent("[memory]", 30, 30)])[1] is None
