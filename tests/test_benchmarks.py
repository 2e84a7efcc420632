"""The benchmark package: the driver (``python -m benchmarks``) finds every family and parses its flags on any
machine, refuses to time without a GPU, and (GPU) every case's own check passes."""
import importlib

import pytest

from benchmarks import families
from benchmarks.__main__ import main
from tests.conftest import HAS_CUDA

KERNEL_FAMILIES = {"adam", "cross_entropy", "embedding", "momentum", "normuon", "polar_express", "transpose"}


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
