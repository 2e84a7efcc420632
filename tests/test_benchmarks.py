"""The benchmark package: the driver (``python -m benchmarks``) finds every family and parses its flags on any
machine, refuses to time without a GPU, and (GPU) every case's own check passes. The FP8 head's cases of the
cross-entropy family (the e5m2 backward, its tuning candidates) also run at a small shape on any machine (CPU:
Triton's interpreter)."""
import importlib

import pytest
import torch

from benchmarks import families
from benchmarks.__main__ import main
from tests.conftest import HAS_CUDA

KERNEL_FAMILIES = {"accumulate", "adam", "cross_entropy", "embedding", "mlp", "momentum", "normuon", "polar_express", "transpose"}


def test_driver_finds_every_family():
    assert KERNEL_FAMILIES <= set(families())
    for name in families():
        assert callable(importlib.import_module(f"benchmarks.{name}").bench_cases)


def test_driver_help_lists_the_families(capsys):
    """``python -m benchmarks --help`` works without a GPU; ``__main__`` itself is not a family."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--only", "--csv", "--tune", "--warmup-ms", "--rep-ms"):
        assert flag in out
    for name in KERNEL_FAMILIES:
        assert name in out
    assert "__main__" not in families()


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a GPU")
def test_driver_refuses_to_time_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--only", "transpose", "--csv", ""])


def test_kernel_modules_hold_no_benchmark_code():
    for name in KERNEL_FAMILIES:
        mod = importlib.import_module(f"kernels.{name}")
        assert not [k for k in vars(mod) if k.startswith(("bench", "_bench"))], name


@pytest.mark.skipif(not HAS_CUDA, reason="benchmark cases allocate speedrun-size tensors on the GPU")
@pytest.mark.parametrize("name", sorted(KERNEL_FAMILIES))
def test_bench_case_checks(name):
    for case in importlib.import_module(f"benchmarks.{name}").bench_cases("cuda", tune=True):
        if case.get("check") is not None:
            case["check"]()


# Rows of the cross-entropy cases below: two row counts (the cases' first and last N differ) of V = 208 columns.
# The FP8 matmuls need V and N divisible by 16 on the GPU; the CPU's interpreter runs a program per row, so there
# the row counts are 8 and 16.
CE_ROWS = (16, 32) if HAS_CUDA else (8, 16)


def test_cross_entropy_fp8_cases_run_at_a_small_shape(device):
    """benchmarks/cross_entropy.py's FP8 head cases with --tune at CE_ROWS rows of V = 208 columns (208 is no
    multiple of any CE tile, so tails run): every case (the row kernel + transpose, each tuning candidate, the
    whole FP8 head backward) and every baseline runs."""
    from benchmarks import cross_entropy as bench
    gen = torch.Generator().manual_seed(0)
    N, V = CE_ROWS[-1], 208
    x = (torch.randn(N, V, generator=gen) * 4 - 2.3).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    cases = bench.fp8_head_cases(x, targets, torch.empty_like(x), device, row_counts=CE_ROWS, tune=True)
    ops = [c["op"] for c in cases]
    assert ops.count("softcapped_ce_bwd_e5m2") == 4   # 2 N x 2 K
    assert sum(op.startswith("softcapped_ce_bwd_e5m2[") for op in ops) == len(bench.TUNING_CANDIDATES)
    for case in cases:
        case["fn"]()
        for baseline in case["baselines"].values():
            baseline()


def test_cross_entropy_fwd_grad_cases_run_at_a_small_shape(device):
    """benchmarks/cross_entropy.py's gradient-in-the-forward cases with --tune at CE_ROWS rows of V = 208 columns
    and its head cases at C = 32: every case (in place over the scratch, the fused e5m2 kernel with the transpose,
    each tuning candidate, the bf16 head, the FP8 head where the GPU has FP8) and its two-kernel baseline runs;
    the in-place case writes the gradient over its buffer."""
    from benchmarks import cross_entropy as bench
    gen = torch.Generator().manual_seed(0)
    N, V = CE_ROWS[-1], 208
    x = (torch.randn(N, V, generator=gen) * 4 - 2.3).to(device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    scratch = x.clone()
    cases = bench.fwd_grad_cases(x, targets, scratch, device, row_counts=CE_ROWS, tune=True)
    ops = [c["op"] for c in cases]
    assert ops.count("softcapped_ce_fwd_grad[in_place]") == ops.count("softcapped_ce_fwd_grad_e5m2+transpose") == 2
    assert sum(op.startswith("softcapped_ce_fwd_grad_e5m2[") for op in ops) == len(bench.FWD_GRAD_TUNING_CANDIDATES)
    [c for c in cases if c["op"] == "softcapped_ce_fwd_grad[in_place]"][-1]["fn"]()    # all N rows, before the rest
    assert not torch.equal(scratch, x), "the in-place case did not write its buffer"
    heads = bench.head_cases(device, 16, V, C=32)
    assert [c["op"] for c in heads][0] == "head_ce_fwd_bwd" and all(c["flops"] == 6 * 16 * 32 * V for c in heads)
    for case in cases + heads:
        case["fn"]()
        for baseline in case["baselines"].values():
            baseline()


def test_transpose_fp8_case_runs_at_a_small_shape(device):
    """benchmarks/transpose.py's e4m3 case (the FP8 head's operands) at 40 x 72: the kernel, its check (bytes
    against the reference) and the eager torch baseline run on any machine (CPU: Triton's interpreter)."""
    from benchmarks import transpose as bench
    case = bench._case("transpose_copy", 40, 72, torch.float8_e4m3fn, device)
    assert (case["dtype"], case["bytes"]) == ("e4m3", 2 * 40 * 72)
    case["check"]()
    case["fn"]()
    case["baselines"]["torch"]()


def test_mlp_cases_run_at_a_small_shape(device):
    """benchmarks/mlp.py's forward and backward cases, default and act-only, and the whole MLP's, at 40 x 72 x 40
    (no multiple of the tile), fp32 on the CPU (Triton's interpreter), bf16 on a GPU: the kernel, its check against
    torch and the eager baseline run."""
    from benchmarks import mlp as bench
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    for direction in ("fwd", "bwd"):
        for act_only in (False, True):
            case = bench._case(direction, 40, 72, 40, dtype, device, act_only=act_only)
            assert case["flops"] == 2 * 40 * 72 * 40
            assert case["bytes"] == (4 if dtype == torch.float32 else 2) * (
                40 * 40 + 72 * 40 + (1 if act_only and direction == "fwd" else 2) * 40 * 72), (direction, act_only)
            case["check"]()
            case["fn"]()
            case["baselines"]["torch"]()
    for act_only in (False, True):  # the whole MLP, forward and backward, in each mode
        case = bench._mlp_case(40, 40, 72, dtype, device, act_only)
        assert case["op"] == f"relu2_mlp[{'act_only' if act_only else 'default'}]"
        case["check"]()
        case["fn"]()
        case["baselines"]["torch"]()
