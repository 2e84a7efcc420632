"""Benchmark cases of the kernel families, one module per family (``bench_cases(device, tune=False)``, see
kernels/bench.py's docstring); ``python -m kernels.bench`` runs them."""
