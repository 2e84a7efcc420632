"""Benchmark cases for kernels.polar_express: Gram products and one optimizer step's Polar Express."""
import functools
import math

import torch

from benchmarks import DTYPE_NAME
from kernels.polar_express import (POLAR_EXPRESS_COEFFS, TUNING_CANDIDATES, ba_plus_caa, ba_plus_caa_ref,
                                   polar_express, polar_express_ref, xtx, xtx_ref, xxt, xxt_ref)


def _config_name(cfg):
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}"


def _check_rule1(what, ours, lowp, ref64, symmetric, scale=None):
    """The tests' rule 1 (tests/tolerances.py): error <= 2 x torch's error + one unit roundoff of the scale
    (max|ref| by default; matmul-like results pass the magnitude of their summed terms)."""
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[ours.dtype]
    err = (ours.double() - ref64).abs().max().item()
    err_torch = (lowp.double() - ref64).abs().max().item()
    if scale is None:
        scale = ref64.abs().max().item()
    bound = 2 * err_torch + u * scale
    if not err <= bound:
        raise AssertionError(f"{what}: max abs err {err:.4e} > bound {bound:.4e} (torch err {err_torch:.4e})")
    if symmetric and not torch.equal(ours, ours.mT):
        raise AssertionError(f"{what}: output is not exactly symmetric")


def _gram_case(op, shape, device, config=None, dtype=torch.bfloat16):
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch, m, n = shape
    a = (torch.randn(shape, generator=gen) / math.sqrt(n if op == "xxt" else m)).to(device, dtype)
    if op == "ba_plus_caa":
        a = xxt_ref(a)  # a symmetric input, like the A of Polar Express
    alpha, beta = POLAR_EXPRESS_COEFFS[0][2], POLAR_EXPRESS_COEFFS[0][1]
    if op == "xxt":
        size, k = m, n
        ours = functools.partial(xxt, a, config=config)
        torch_fn = functools.partial(torch.bmm, a, a.mT)
        ref = functools.partial(xxt_ref, a.double())
        terms = functools.partial(xxt_ref, a.double().abs())
    elif op == "xtx":
        size, k = n, m
        ours = functools.partial(xtx, a, config=config)
        torch_fn = functools.partial(torch.bmm, a.mT, a)
        ref = functools.partial(xtx_ref, a.double())
        terms = functools.partial(xtx_ref, a.double().abs())
    else:
        size, k = m, m
        ours = functools.partial(ba_plus_caa, a, alpha, beta, config=config)
        torch_fn = functools.partial(torch.baddbmm, a, a, a.mT, beta=beta, alpha=alpha)
        ref = functools.partial(ba_plus_caa_ref, a.double(), alpha, beta)
        terms = functools.partial(ba_plus_caa_ref, a.double().abs(), abs(alpha), abs(beta))
    out = torch.empty((batch, size, size), dtype=a.dtype, device=device)
    out_torch = torch.empty_like(out)
    suffix = "" if config is None else f"[{_config_name(config)}]"
    return dict(op=op + suffix, shape="x".join(map(str, shape)), dtype=DTYPE_NAME[dtype],
                fn=lambda: ours(out=out),
                bytes=a.numel() * a.element_size() + out.numel() * out.element_size(),
                flops=2 * batch * size * size * k,  # full matmul FLOPs: the halving shows as speedup
                baselines={"torch": lambda: torch_fn(out=out_torch)},
                check=lambda: _check_rule1(f"{op}{suffix} {shape}", ours(), torch_fn(), ref(), symmetric=True,
                                           scale=terms().max().item()))


def _polar_flops(batch, m, n, steps=5):
    small, large = min(m, n), max(m, n)
    per_step = 2 * small * small * large + 2 * small ** 3 + 2 * small * small * large
    return batch * steps * per_step


def _polar_case(device, plans=True):
    """One optimizer step's matrices per GPU: (3, 3072, 768) MLP (tall) + (5, 768, 768) attention (wide).

    ``plans=False`` launches every kernel through Triton's JIT dispatch (no recorded launch plans): the
    difference between the two rows is what the plans save per optimizer step."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(3, 3072, 768), (5, 768, 768)]
    gs = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
    compiled = torch.compile(polar_express_ref, dynamic=False)  # one graph per shape, no dynamic recompile

    def check():
        for g in gs:
            _check_rule1(f"polar_express {tuple(g.shape)}", polar_express(g, plans=plans), polar_express_ref(g),
                         polar_express_ref(g.double()), symmetric=False)

    return dict(op="polar_express" + ("" if plans else "[no plans]"), shape="3x3072x768+5x768x768", dtype="bf16",
                fn=lambda: [polar_express(g, plans=plans) for g in gs],
                bytes=sum(2 * g.numel() * g.element_size() for g in gs),
                flops=sum(_polar_flops(*s) for s in shapes),
                baselines={"torch": lambda: [polar_express_ref(g) for g in gs],
                           "torch.compile": lambda: [compiled(g) for g in gs]},
                check=check)


def bench_cases(device, tune=False):
    """Gram products at the speedrun's shapes, and Polar Express over one optimizer step's matrices.

    FLOPs are counted for the full product (2*B*M*M*K for a Gram matrix), not the half the kernels compute.
    Polar Express is timed with its launch plans (the default) and without them ("polar_express[no plans]").
    With ``tune=True``, every TUNING_CANDIDATES config of the Gram kernels too, named like xxt[128x128x64w8s3].
    """
    gram_shapes = [("xxt", (4, 768, 3072)), ("xtx", (4, 3072, 768)), ("ba_plus_caa", (4, 768, 768)),
                   ("ba_plus_caa", (24, 768, 768)), ("xxt", (24, 768, 768)), ("xtx", (24, 768, 768))]
    cases = [_gram_case(op, shape, device) for op, shape in gram_shapes]
    cases.append(_polar_case(device))
    cases.append(_polar_case(device, plans=False))
    if tune:
        for op, shape in gram_shapes:
            cases.extend(_gram_case(op, shape, device, config=cfg) for cfg in TUNING_CANDIDATES)
    return cases
