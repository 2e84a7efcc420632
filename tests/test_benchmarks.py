"""The benchmark package: every family is found by the driver, and (GPU) every case's own check passes."""
import importlib

import pytest

from benchmarks import families
from tests.conftest import HAS_CUDA

KERNEL_FAMILIES = {"adam", "embedding", "momentum", "normuon", "polar_express", "transpose"}


def test_driver_finds_every_family():
    assert KERNEL_FAMILIES <= set(families())
    for name in families():
        assert callable(importlib.import_module(f"benchmarks.{name}").bench_cases)


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
