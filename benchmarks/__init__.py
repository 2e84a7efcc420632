"""Benchmark cases, one module per kernel family, and their driver: ``python -m benchmarks``.

Each ``benchmarks/<family>.py`` exposes ``bench_cases(device, tune=False)`` returning the case dicts that
the driver's docstring (``benchmarks/__main__.py``) describes. The cases live here, not in the kernel modules,
so that the source a training run copies into its log holds no benchmark code. A new family is a new module
in this package: the driver lists the package (``families()``, which skips private names such as
``__main__``), so no other file changes.
"""
import pkgutil

import torch

# Short dtype names for the benchmark table.
DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "e4m3",
              torch.float8_e5m2: "e5m2"}


def families():
    """Names of the benchmark modules in this package, sorted (every module that is not private)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
