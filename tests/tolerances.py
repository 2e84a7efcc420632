"""Tolerance policy for every kernel test, in one place.

Reference: every test computes its reference in float64 (on the CPU or on upcast inputs), from the very
same low-precision inputs the kernel saw.

Rule 1 (preferred, for anything with a reduction: matmuls, norms, sums): the kernel may be at most
``FACTOR`` times as far from the float64 reference as plain PyTorch's own low-precision result on the same
inputs, plus a small floor:

    max|kernel - ref| <= FACTOR * max|torch_lowp - ref| + FLOOR[dtype] * max|ref|

Where torch's low-precision result is inf or NaN (an overflow), its error is infinite and the bound would
accept any output: there the kernel must give the same inf/NaN instead, and the bound is computed and
applied over the elements where torch is finite.

``FACTOR = 2`` lets a kernel use a different (equally valid) summation order or tile shape than cuBLAS
without letting a real bug through: a wrong index, a missed tile or a dropped term is off by O(|ref|), far
above twice the rounding error of a correct result. The floor covers the case where torch happens to be
exact (e.g. an all-integer input) and is one unit roundoff of the output dtype relative to the scale.
The scale is ``max|ref|`` by default. For a sum of products with cancellation the natural scale is the
magnitude of the terms, ``max(|A| @ |B|)``: the rounding error of a dot product is bounded by
``gamma_K * sum_i |a_i b_i|``, not by ``|sum_i a_i b_i|``, so two correct kernels with different summation
orders (cuBLAS and ours) can differ by a few ulps of that magnitude however small the result is. Tests of
matmul-like kernels pass ``scale=max(|A| @ |B|)``; the floor stays one unit roundoff of it.

Where rule 1 does not apply: its factor assumes the kernel and torch commit the same kinds of rounding
error, each bounding the other within 2x. When one rounding of an intermediate dominates and is amplified
(exp of an fp32 value of magnitude ~20: half an ulp of z ~ 20 is already a relative error of 16 u of exp(z)),
two equally valid fp32 implementations differ by more than that: for the cross-entropy row sums
sum_v exp(z - max z) over 9 rows, computing z with torch's sigmoid gives a worst-row error of 28 u, rounding
the exact z to fp32 gives 11 u. Such quantities are judged with rule 2 and a bound derived from the
conditioning (first-order error analysis of the kernel's operations), written next to the test.

Rule 2 (fallback, for elementwise ops where torch has no comparable low-precision path): the kernel's
result must be within ``atol + rtol*|ref|`` with ``rtol = ULP_MULT * u`` where ``u`` is the unit
roundoff of the output dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32) and ``ULP_MULT = 2`` (one rounding of the
output plus one rounding of an fp32 intermediate), ``atol = rtol * scale`` where ``scale`` is the
typical magnitude of the tensor (``max|ref|``) so that values that cancel to ~0 are judged against the
magnitudes that produced them.

Bitwise ops (transposes, copies, gathers) are compared with ``torch.equal`` and need no tolerance.

Every comparison goes through :func:`assert_close_report`, which prints max abs/rel error, the worst
index, and any NaN/inf mismatch, so a failing test says what went wrong.
"""
import math

import torch

FACTOR = 2.0
ULP_MULT = 2.0

UNIT_ROUNDOFF = {
    torch.bfloat16: 2.0 ** -8,
    torch.float16: 2.0 ** -11,
    torch.float32: 2.0 ** -24,
    torch.float64: 2.0 ** -53,
}

# Relative floor for rule 1: one unit roundoff of the output dtype, relative to max|ref|.
FLOOR = dict(UNIT_ROUNDOFF)


def unit_roundoff(dtype):
    return UNIT_ROUNDOFF[dtype]


def _describe(actual, expected):
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    diff = (a - e).abs()
    finite = torch.isfinite(diff)
    lines = [f"shape {tuple(a.shape)}"]
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    if (nan_a != nan_e).any():
        idx = torch.nonzero(nan_a != nan_e)[0].tolist()
        lines.append(f"NaN mismatch: {int((nan_a != nan_e).sum())} elements, first at {idx} "
                     f"(actual {a[tuple(idx)].item()}, expected {e[tuple(idx)].item()})")
    if (inf_a != inf_e).any():
        lines.append(f"inf mismatch: {int((inf_a != inf_e).sum())} elements")
    if finite.any():
        d = torch.where(finite, diff, torch.zeros_like(diff))
        flat = int(d.argmax())
        idx = list(torch.unravel_index(torch.tensor(flat), d.shape)) if d.dim() else []
        idx = [int(i) for i in idx]
        rel = d / e.abs().clamp_min(1e-300)
        lines.append(f"max abs err {d.max().item():.4e} at {idx} (actual {a.reshape(-1)[flat].item():.6e}, "
                     f"expected {e.reshape(-1)[flat].item():.6e}); max rel err {rel.max().item():.4e}; "
                     f"max|expected| {e.abs().max().item():.4e}")
    return "\n".join(lines)


def max_abs_err(actual, expected):
    """max |actual - expected| in float64; inf if any NaN/inf appears where expected is finite."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    if a.numel() == 0:
        return 0.0
    bad = ~torch.isfinite(a) & torch.isfinite(e)
    if bad.any():
        return math.inf
    return (a - e).abs().max().item()


def assert_close_report(actual, expected, *, atol, rtol=0.0, name="output"):
    """Elementwise |actual - expected| <= atol + rtol*|expected|, with a verbose failure message."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape mismatch {tuple(a.shape)} vs {tuple(e.shape)}")
    if a.numel() == 0:
        return
    ok = (a - e).abs() <= atol + rtol * e.abs()
    ok |= (a == e)  # equal infinities
    if not bool(ok.all()):
        raise AssertionError(f"{name}: {int((~ok).sum())} of {a.numel()} elements out of tolerance "
                             f"(atol {atol:.3e}, rtol {rtol:.3e})\n" + _describe(actual, expected))


def assert_matches_torch(actual, expected64, torch_lowp, *, name="output", factor=FACTOR, scale=None):
    """Rule 1: kernel error <= factor * torch's error + floor (see module docstring).

    ``scale`` (default ``max|expected64|``) sets the floor, ``UNIT_ROUNDOFF[dtype] * scale``; matmul-like
    kernels pass the magnitude of the summed terms, ``max(|A| @ |B|)``. Where ``torch_lowp`` is inf or NaN
    the kernel must hold the same value; the bound is then judged on the elements where torch is finite.
    """
    dtype = actual.dtype
    if actual.shape != torch_lowp.shape:
        raise AssertionError(f"{name}: shape mismatch {tuple(actual.shape)} vs torch {tuple(torch_lowp.shape)}")
    # Where torch's own result overflowed (inf) or is NaN, its error is infinite and would make the bound
    # infinite, accepting anything. Instead the kernel must give the same non-finite value there, and only
    # the elements where torch is finite set and meet the bound.
    a = actual.detach().to("cpu", torch.float64)
    t = torch_lowp.detach().to("cpu", torch.float64)
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        same = torch.where(torch.isnan(t), torch.isnan(a), a == t)
        if not bool(same[~finite].all()):
            idx = torch.nonzero(~finite & ~same)[0].tolist()
            raise AssertionError(f"{name}: torch's result is {t[tuple(idx)].item()} at {idx} "
                                 f"({int((~finite).sum())} non-finite elements), the kernel's is "
                                 f"{a[tuple(idx)].item()}: the inf/NaN patterns differ")
        # Indices in a failure report below then count the finite elements only (flattened).
        a, t, expected64 = a[finite], t[finite], expected64.detach().to("cpu", torch.float64)[finite]
    err_torch = max_abs_err(t, expected64)
    if scale is None:
        scale = expected64.detach().abs().max().item() if expected64.numel() else 0.0
    bound = factor * err_torch + FLOOR[dtype] * scale
    err = max_abs_err(a, expected64)
    if not err <= bound:
        raise AssertionError(f"{name}: max abs err {err:.4e} exceeds bound {bound:.4e} "
                             f"(= {factor} x torch err {err_torch:.4e} + floor {FLOOR[dtype]:.1e} x scale "
                             f"{scale:.4e}); dtype {dtype}\n" + _describe(a, expected64))


def assert_elementwise(actual, expected64, *, name="output", ulps=ULP_MULT, scale=None):
    """Rule 2: within ``ulps`` unit roundoffs of the output dtype, relative and at the tensor's scale."""
    u = UNIT_ROUNDOFF[actual.dtype]
    if scale is None:
        scale = expected64.detach().abs().max().item() if expected64.numel() else 0.0
    rtol = ulps * u
    assert_close_report(actual, expected64, atol=rtol * scale, rtol=rtol, name=name)


def assert_all_written(out, name="output"):
    """Outputs are prefilled with NaN before the kernel runs; any NaN left means an element was skipped."""
    nan = torch.isnan(out.detach().float())
    if nan.any():
        idx = torch.nonzero(nan)[0].tolist()
        raise AssertionError(f"{name}: {int(nan.sum())} of {out.numel()} elements still NaN "
                             f"(never written?), first at {idx}")


def nan_like(t, dtype=None):
    """A tensor shaped like ``t`` filled with NaN (the poison prefill)."""
    return torch.full_like(t, float("nan"), dtype=dtype or t.dtype)


def shifted_randn(*shape, dtype=torch.float32, device="cpu", generator=None, mean=-2.3, std=0.5):
    """Realistic test input: not centred on zero, so sign and offset bugs show up."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float32, device="cpu") * std + mean
    return x.to(device=device, dtype=dtype)
