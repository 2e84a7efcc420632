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

Rule 3 (values computed in fp32 and stored rounded to nearest even in float8_e5m2, saturating, e.g. FP8
gradients): e5m2 keeps 2 mantissa bits. In [2^e, 2^(e+1)), e >= -14, its spacing is ulp(e5m2) = 2^(e-2); below
2^-14 the subnormals are the multiples of 2^-16; the largest finite value is 57344. Round-to-nearest-even sends
magnitudes from 61440 (halfway to 65536) on to 65536, which the saturating conversion our kernels use (a Hopper
GPU's ``cvt.rn.satfinite``; torch's ``.to(torch.float8_e5m2)`` gives +-inf instead) turns into +-57344, as it
does +-inf. A kernel that computes v' in fp32 with |v' - ref| <= err and stores SAT(RNE_e5m2(v')) has

    |out - ref| <= |RNE(v') - v'| + |v' - ref| <= ulp_e5m2(|v'|) / 2 + err <= ulp_e5m2(|ref| + err) / 2 + err

(the spacing never shrinks as the magnitude grows) where nothing saturates, gives +-57344 (ref's sign) where |ref| +
err >= 61440 (and must where |ref| - err >= 61440), never +-inf, and NaN exactly where ref is NaN. The fp32 error is
per element, ``err = E5M2_FP32_ULPS * u_fp32 * terms``, with ``terms`` the magnitude of the terms that make up the
value (the rounding error of an fp32 computation scales with them, not with a result that cancels), passed by the
test. ``E5M2_FP32_ULPS = 2^10`` is derived for the one user, the soft-capped cross-entropy backward
(kernels/cross_entropy.py; its fp32 dlogits, the same value unrounded, are held to the same fp32 error): dx / scale
= g (W p - hit) (A/C) s (1 - s) / scale with p = exp(z - m) / S, terms = |g| (W p + hit) (A/C) s / scale (s rather
than s (1 - s): the fp32 error of s (1 - s) is a few u of s, however small 1 - s is). In units of u = 2^-24, worst
case on a GPU: z = A sigmoid((x + B) / C) carries at most 7 u A absolute error (tests/test_cross_entropy.py derives
it: the argument c1 x + c0's roundings, the GPU's 2^t (ex2.approx, 2 ulp), the add, the reciprocal after its Newton
step, the product by A); exp(z - m) turns that into a relative error of 7 A u = 161 u for z and as much again
through S (m cancels between numerator and S); y = z - m rounded (|y| u), its product by log2(e) (2 |y| u with the
constant's rounding) and the GPU's exp2 (4 u) add at most (3 A + 4) u = 73 u, twice (numerator, S); S's summation
and rescaling add (3 A + 5 n + log2 BLOCK_V) u <= 330 u (n <= 50 tiles); the products, the difference and the folded
constant A / (C * scale) add under 10 u: at most ~810 u, rounded up to 2^10. That is 2^-14 of the terms, at most
2^-10 of e5m2's half ulp (2^-4 to 2^-3 of the value) where nothing cancels, so the bound stays ulp / 2 to within
0.1%: a truncating conversion (error up to one ulp) fails on about half of the elements, a skipped or misplaced
element almost surely, and a scale off by a relative d >> 2^-14 wherever that moves a value across a rounding
midpoint (a share of roughly d / 2^-3 of the elements). The second output of such a kernel, a transposed copy, must
hold the same bytes (``torch.equal`` on the uint8 views).

Rule 4 (sums of the same n fp32 terms in an order that is not fixed: gradients summed over micro-steps and
reduced across ranks, losses summed over micro-batches): every order of fp32 additions (sequential, a tree, a
ring all-reduce: any algorithm that repeatedly adds two partial sums) gives

    |s_hat - s| <= gamma_{n-1} * sum_i |x_i|,    gamma_m = m u / (1 - m u),  u = 2^-24

(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2: each term goes through at most
n - 1 additions, each with a relative error of at most u). ``s`` is the float64 sum of the very terms the
ranks added (its own error, gamma_{n-1} in float64, is 2^-29 of the bound and neglected as in rule 1), and the
scale is per element, the magnitude of its terms: an element whose terms cancel is judged at the scale of
its terms, not of its sum. Two sums of the same terms in different orders are within twice the bound of each
other; a division of both by the same number adds one rounding, u relative, to each. What it catches: a term
dropped or counted twice (off by |x_i|, far above gamma_{n-1} sum |x| unless x_i is itself below the bound),
another row's or rank's sum, a wrong scale. The bound is for one sum of given terms. It does not carry through
an optimizer step: Adam's first update is lr * g / (|g| + eps) ~ lr * sign(g), and an element whose terms
cancel to below the bound takes either sign in another order (measured: after 3 steps of the fp32 smoke model
at world size 8, value-embedding weights 3.1 away from world size 1's, with lr 1.5); so tests/test_world_sizes.py
checks each reduced gradient against this bound and, with the reduction done in world size 1's order, the
parameters bit for bit.

Rule 5 (FP8 GEMMs: ``torch._scaled_mm`` of e4m3 / e5m2 operands, K-term dot products, one output rounding):
the products of two FP8 values are exact, the accumulated value v is off the float64 sum of the dequantised
operands by an accumulation error d, and the output (bf16) rounds v to nearest even: |out - ref| <= 2^-8 |v| + d
<= 2^-8 |ref| + (1 + 2^-8) d. With ``terms`` = |A| @ |B| (the magnitude of the summed products, per element):

* fp32 accumulation (the CPU: torch's CPU ``_scaled_mm`` multiplies upcast operands in fp32): d <= K u terms.
* Hopper's FP8 tensor cores (H100, H200): not fp32 inside an MMA instruction. One wgmma step adds K_STEP = 32
  products to the running sum in a fixed-point window about 13 bits below the largest addend and truncates
  (reverse-engineered: a 13-bit truncating accumulator for e5m2 wgmma on the H100, the public
  tensor-cores-numerical-behavior probes and Khattak & Mikaitis 2025; DeepSeek-V3's report: "about 14 bits"), so
  a step can lose a few units of 2^-13 of its largest addend, and every addend (a product or a running sum) is
  at most ``terms``. We allow FP8_STEP_ERR = 2^-11 (4 such units) of ``terms`` per step, ceil(K / 32) steps, plus
  the fp32 additions around them: d <= (ceil(K / 32) 2^-11 + K u) terms. This is an estimate with a margin, not a
  worst case of a documented design (NVIDIA documents none): on one H200 (issue 31) the FP8 head's dx (K = 208)
  showed at least 2^-12.5 terms before its rounding (where the fp32 bound, 208 u = 2^-16.3, failed on 16 of 1536
  elements, each by less than half a bf16 ulp); float64 simulations of that product (the same operands) under
  hardware models of that kind (windows of 13 to 23 bits, truncation toward zero or toward -inf, 4 to 32
  products per step) stay within the bound, at most 0.86 of it for the crudest (a 13-bit window truncating
  toward -inf every 4 products, which would also fail the fp32 bound on ~200 elements, not 16). cuBLAS without
  fast accumulation moves the running sum to an fp32 register every few steps (the K u term), which only
  shortens the truncated stretches, so one bound serves both settings. A wrong scale, operand
  or layout is off by a share of |ref| (a factor, or O(terms)); the bound at K = 208 is 2^-8 |ref| + 3.4e-3 terms,
  about 1.5% of a typical element there (|ref| ~ 0.3 terms). For long sums (K = 50304: 0.77 terms) the bound is
  weak and a test pins the op's composition by another check (the same ``_scaled_mm`` call restated from the
  specification's operands must give the same bits).

Bitwise ops (transposes, copies, gathers) are compared with ``torch.equal`` and need no tolerance.

Every comparison goes through :func:`assert_close_report` (rule 3: :func:`assert_rounded_e5m2`, rule 4:
:func:`assert_sum_in_any_order`, rule 5: :func:`assert_fp8_gemm`), which prints max abs/rel error, the
worst index, and any NaN/inf mismatch, so a failing test says what went wrong.
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

# Rule 3 (float8_e5m2 outputs of fp32 computations): e5m2's grid and the fp32 allowance (derivation above).
E5M2_MIN_NORMAL = 2.0 ** -14        # below: subnormals, multiples of 2^-16
E5M2_MAX = 57344.0                  # the largest finite value, where the saturating conversion stops
E5M2_OVERFLOW = 61440.0             # |v| >= this rounds to 65536 (halfway between 57344 and 65536, ties to even),
                                    # saturated to E5M2_MAX
E5M2_FP32_ULPS = 2.0 ** 10          # fp32 error before the rounding, in units of u_fp32 x the terms' magnitude

# Rule 5 (FP8 GEMMs): products per tensor-core MMA step and the error allowed per step, of the terms' magnitude.
FP8_K_STEP = 32
FP8_STEP_ERR = 2.0 ** -11


def unit_roundoff(dtype):
    return UNIT_ROUNDOFF[dtype]


def gamma(m, dtype=torch.float32):
    """gamma_m = m u / (1 - m u) of ``dtype`` (rule 4: the error of m roundings in a row)."""
    u = UNIT_ROUNDOFF[dtype]
    return m * u / (1 - m * u)


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
    """Elementwise |actual - expected| <= atol + rtol*|expected|, with a verbose failure message; ``atol`` is a
    number or a tensor broadcastable to ``expected`` (a per-element bound)."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if torch.is_tensor(atol):
        atol = atol.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape mismatch {tuple(a.shape)} vs {tuple(e.shape)}")
    if a.numel() == 0:
        return
    ok = (a - e).abs() <= atol + rtol * e.abs()
    ok |= (a == e)  # equal infinities
    if not bool(ok.all()):
        if torch.is_tensor(atol):
            bound = (atol + rtol * e.abs()).expand_as(e)
            worst = int(((a - e).abs() - bound).nan_to_num(nan=float("inf")).flatten().argmax())
            atol = f"per element; at the worst excess {float(bound.flatten()[worst]):.3e}"
        else:
            atol = f"{atol:.3e}"
        raise AssertionError(f"{name}: {int((~ok).sum())} of {a.numel()} elements out of tolerance "
                             f"(atol {atol}, rtol {rtol:.3e})\n" + _describe(actual, expected))


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


def ulp_e5m2(a):
    """Spacing of e5m2's grid at magnitude ``a`` (float64 tensor, a >= 0): 2^(e-2) in [2^e, 2^(e+1)) for
    e >= -14, 2^-16 below 2^-14."""
    _, exp = torch.frexp(a.clamp_min(E5M2_MIN_NORMAL))  # a = mantissa * 2^exp, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(a), exp - 3)


def assert_rounded_e5m2(actual, expected64, terms, *, name="output", fp32_ulps=E5M2_FP32_ULPS):
    """Rule 3: ``actual`` (float8_e5m2) is the saturated round-to-nearest-even e5m2 value of an fp32 result within
    ``fp32_ulps * u_fp32 * terms`` of ``expected64`` (float64 exact values; ``terms`` the magnitude of their
    summed terms, same shape): see the module docstring."""
    if actual.dtype != torch.float8_e5m2:
        raise AssertionError(f"{name}: expected a float8_e5m2 tensor, got {actual.dtype}")
    if actual.shape != expected64.shape or terms.shape != expected64.shape:
        raise AssertionError(f"{name}: shape mismatch {tuple(actual.shape)} vs {tuple(expected64.shape)} "
                             f"(terms {tuple(terms.shape)})")
    a = actual.detach().to("cpu").float().double()          # e5m2 -> fp32 is exact
    e = expected64.detach().to("cpu", torch.float64)
    err = fp32_ulps * UNIT_ROUNDOFF[torch.float32] * terms.detach().to("cpu", torch.float64).abs()
    mag = e.abs() + err
    bound = 0.5 * ulp_e5m2(torch.nan_to_num(mag, posinf=E5M2_OVERFLOW)) + err
    same_sign = torch.signbit(a) == torch.signbit(e)
    ok_finite = torch.isfinite(a) & ~(e.abs() - err >= E5M2_OVERFLOW) & ((a - e).abs() <= bound)
    ok_sat = (a.abs() == E5M2_MAX) & same_sign & (mag >= E5M2_OVERFLOW)
    ok = ok_finite | ok_sat | (torch.isnan(a) & torch.isnan(e))
    ok &= torch.isnan(a) == torch.isnan(e)
    if not bool(ok.all()):
        over = torch.where(ok, torch.zeros_like(e), torch.nan_to_num((a - e).abs() / bound, nan=math.inf,
                                                                        posinf=math.inf))
        flat = int(over.reshape(-1).argmax())
        idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
        raise AssertionError(
            f"{name}: {int((~ok).sum())} of {a.numel()} elements are not the saturated e5m2 rounding of a value "
            f"within "
            f"{fp32_ulps:g} u_fp32 x terms of the reference; worst at {idx}: got {a.reshape(-1)[flat].item():.6e}, "
            f"reference {e.reshape(-1)[flat].item():.6e}, e5m2 half ulp "
            f"{0.5 * ulp_e5m2(mag.reshape(-1)[flat:flat + 1]).item():.3e}, fp32 allowance "
            f"{err.reshape(-1)[flat].item():.3e}\n" + _describe(a, e))


def assert_sum_in_any_order(actual, terms, *, name="sum"):
    """Rule 4: ``actual`` is a sum of the n fp32 tensors ``terms`` (a list, each shaped like ``actual``) in some
    order: within gamma_{n-1} * sum_i |x_i| of their float64 sum, elementwise (exactly equal where every term
    is zero, e.g. padding rows)."""
    t = torch.stack([x.detach().to("cpu", torch.float64) for x in terms])
    exact, bound = t.sum(0), gamma(len(terms) - 1) * t.abs().sum(0)
    a = actual.detach().to("cpu", torch.float64)
    if a.shape != exact.shape:
        raise AssertionError(f"{name}: shape mismatch {tuple(a.shape)} vs the terms' {tuple(exact.shape)}")
    excess = (a - exact).abs() - bound
    bad = ~(excess <= 0)  # NaN fails too
    if bool(bad.any()):
        flat = int(torch.where(bad, torch.nan_to_num(excess, nan=math.inf), -math.inf).reshape(-1).argmax())
        idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.numel()} elements differ from the float64 sum of their {len(terms)} "
            f"terms by more than gamma_{len(terms) - 1} x sum|terms|; worst at {idx}: got "
            f"{a.reshape(-1)[flat].item():.6e}, exact {exact.reshape(-1)[flat].item():.6e}, bound "
            f"{bound.reshape(-1)[flat].item():.3e}\n" + _describe(a, exact))


def assert_two_sums_in_any_order(a, b, n, abs_sum, *, name="sum"):
    """Rule 4 for two fp32 sums of the same n terms in different orders (scalars or tensors): |a - b| <=
    2 gamma_{n-1} * abs_sum, abs_sum = sum_i |x_i| (for positive terms, e.g. losses: at most max(a, b) /
    (1 - gamma_{n-1}))."""
    bound = 2 * gamma(n - 1) * torch.as_tensor(abs_sum, dtype=torch.float64)
    assert_close_report(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                        atol=bound.max().item(), name=f"{name} (two orders of {n} fp32 terms)")

def fp8_gemm_accumulation_error(K, accumulation):
    """Rule 5's d / terms for a K-term FP8 dot product: ``"fp32"`` (the CPU) or ``"tensor_core"`` (a CUDA GPU)."""
    u = UNIT_ROUNDOFF[torch.float32]
    if accumulation == "fp32":
        return K * u
    if accumulation == "tensor_core":
        return math.ceil(K / FP8_K_STEP) * FP8_STEP_ERR + K * u
    raise ValueError(f"accumulation must be 'fp32' or 'tensor_core', not {accumulation!r}")


def assert_fp8_gemm(actual, expected64, terms, K, accumulation, *, name="output"):
    """Rule 5: ``actual`` (bf16 or fp16 output of an FP8 GEMM over K terms) within 2^-8 |ref| (one rounding of the
    output, u of its dtype) plus (1 + u) times the accumulation error of ``accumulation`` (see the module
    docstring) times ``terms`` = |A| @ |B|, elementwise."""
    u_out = UNIT_ROUNDOFF[actual.dtype]
    a = actual.detach().to("cpu", torch.float64)
    e = expected64.detach().to("cpu", torch.float64)
    t = terms.detach().to("cpu", torch.float64).abs()
    if a.shape != e.shape or t.shape != e.shape:
        raise AssertionError(f"{name}: shape mismatch {tuple(a.shape)} vs {tuple(e.shape)} (terms {tuple(t.shape)})")
    d = fp8_gemm_accumulation_error(K, accumulation) * t
    bound = u_out * e.abs() + (1 + u_out) * d
    ok = (a - e).abs() <= bound
    if not bool(ok.all()):
        over = torch.where(ok, torch.zeros_like(e), torch.nan_to_num((a - e).abs() / bound, nan=math.inf))
        flat = int(over.reshape(-1).argmax())
        idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
        raise AssertionError(
            f"{name}: {int((~ok).sum())} of {a.numel()} elements off by more than one output rounding plus the "
            f"{accumulation} accumulation error over K = {K} terms; worst at {idx}: got "
            f"{a.reshape(-1)[flat].item():.6e}, reference {e.reshape(-1)[flat].item():.6e}, bound "
            f"{bound.reshape(-1)[flat].item():.3e} (terms "
            f"{t.reshape(-1)[flat].item():.3e})\n" + _describe(a, e))


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

