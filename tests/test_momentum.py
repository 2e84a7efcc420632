"""Tests for kernels/momentum.py against a float64 reference.

Each step is checked on its own: the float64 reference starts from the kernel's buf of the previous step
(errors of earlier steps would otherwise accumulate by up to 1 / (1 - mu) and say nothing about this
step). buf is held to rule 2 in fp32 ulps; X to rule 2 in bf16 ulps at the scale max|X|. Under the
Triton interpreter (CPU) fp32 -> bf16 conversions round toward zero instead of to nearest even, which
still stays within the bf16 bound (two truncations < 2 ulps of |X|, the bound is 2 ulps of |X| plus 2 ulps
of max|X|).
"""
import math

import pytest
import torch

from kernels import momentum
from kernels.momentum import NORM_SAFETY, TUNING_CANDIDATES, nesterov_momentum, nesterov_momentum_ref
from tests.tolerances import assert_all_written, assert_close_report, assert_elementwise, nan_like, shifted_randn

HAS_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="speedrun shapes need a CUDA GPU")

DTYPE_IDS = {torch.bfloat16: "bf16", torch.float32: "fp32"}
# (2, 64, 128): 8192 elements per matrix, a multiple of every pass-1 BLOCK and pass-2 SCALE_BLOCK of the
# interpreter's and the default configuration (no lane masked off); the others end in a partial chunk.
SHAPES = [(5, 123, 123), (1, 100, 257), (64, 33), (2, 1, 300), (2, 64, 128)]
SPEEDRUN_SHAPES = [(3, 3072, 768), (5, 768, 768)]
SHAPE_PARAMS = SHAPES + [pytest.param(s, marks=gpu_only) for s in SPEEDRUN_SHAPES]
MUS = [0.85, 0.9, 0.95]


def shape_id(s):
    return "x".join(map(str, s))


def make_inputs(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    grad = shifted_randn(*shape, generator=g)
    buf = shifted_randn(*shape, generator=g, mean=-1.0, std=0.3)
    if len(shape) == 3:
        # Matrix k scaled by (k + 1)^2: a kernel that normalized by another matrix's norm would be off by
        # a factor, not by the 0.1% by which the norms of same-distribution matrices differ.
        scale = torch.arange(1, shape[0] + 1, dtype=torch.float32).square().view(-1, 1, 1)
        grad, buf = grad * scale, buf * scale
    return grad.to(device=device, dtype=dtype), buf.to(device)


def momentum_spec(grad, buf, mu):
    """The specification, written here independently of the module: float64, returns (new buf, X).

    mu is used as the kernel sees it, rounded to fp32. The buffer is updated first and the Nesterov
    look-ahead uses the NEW buffer: u = (1 - mu) g + mu buf_new. X is the bf16-rounded u (round to nearest
    even) divided by 1.02 x its Frobenius norm per matrix plus 1e-6, not rounded.
    """
    mu = float(torch.tensor(float(mu), dtype=torch.float32))
    g = grad.to("cpu", torch.float64)
    buf_new = mu * buf.to("cpu", torch.float64) + (1.0 - mu) * g
    u = (1.0 - mu) * g + mu * buf_new
    b = u.to(torch.bfloat16).to(torch.float64)
    norm = b.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    return buf_new, b / (norm * 1.02 + 1e-6)


def check_step(grad, buf, mu, out=None):
    """One kernel step against the float64 specification started from the same buf; returns X."""
    buf_expected, expected = momentum_spec(grad, buf, mu)
    x = nesterov_momentum(grad, buf, mu, out=out)
    assert x.dtype == torch.bfloat16 and x.shape == grad.shape and x.is_contiguous()
    assert_all_written(x, "X")
    assert_elementwise(buf, buf_expected, name="buf")
    assert_elementwise(x, expected, name="X")
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("shape", SHAPE_PARAMS, ids=shape_id)
def test_steps_match_float64_reference(dtype, shape, device):
    grad, buf = make_inputs(shape, dtype, device)
    for step, mu in enumerate(MUS):
        out = nan_like(grad, torch.bfloat16)  # NaN prefill: every element must be written
        x = check_step(grad, buf, mu, out=out)
        assert x is out
        grad = shifted_randn(*shape, dtype=dtype, device=device, generator=torch.Generator().manual_seed(step + 1))


@pytest.mark.parametrize("shape", SHAPE_PARAMS, ids=shape_id)
def test_x_has_frobenius_norm_one_over_safety(shape, device):
    grad, buf = make_inputs(shape, torch.bfloat16, device)
    x = nesterov_momentum(grad, buf, 0.9).double()
    norms = x.reshape(-1, x.shape[-2] * x.shape[-1]).norm(dim=1)
    # Each element of X carries a rounding of at most 2^-8 relative (2^-7 under the interpreter's truncation).
    target = torch.full_like(norms, 1 / NORM_SAFETY)
    assert torch.allclose(norms, target, rtol=2 ** -7, atol=0), (norms, target)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_non_contiguous_grad(layout, device):
    grad, buf = make_inputs((3, 123, 77), torch.bfloat16, device)
    if layout == "transposed":
        grad = grad.transpose(-1, -2).contiguous().transpose(-1, -2)
    else:
        big = shifted_randn(3, 2 * 123, 77 + 5, dtype=torch.bfloat16, device=device,
                            generator=torch.Generator().manual_seed(7))
        grad = big[:, ::2, 3:80]
    assert not grad.is_contiguous() and grad.shape == buf.shape
    check_step(grad, buf, 0.95)


def test_2d_equals_batch_of_one(device):
    grad, buf = make_inputs((100, 257), torch.bfloat16, device)
    buf3 = buf.clone().unsqueeze(0)
    x2 = nesterov_momentum(grad, buf, 0.9)
    x3 = nesterov_momentum(grad.unsqueeze(0), buf3, 0.9)
    assert torch.equal(x2, x3[0]) and torch.equal(buf, buf3[0])


def test_zero_gradient_gives_zero(device):
    grad = torch.zeros(3, 64, 48, dtype=torch.bfloat16, device=device)
    buf = torch.zeros(3, 64, 48, device=device)
    x = nesterov_momentum(grad, buf, 0.95, out=nan_like(grad))
    assert not torch.isnan(x).any()
    assert torch.equal(x, torch.zeros_like(x)) and torch.equal(buf, torch.zeros_like(buf))


def test_zero_matrix_in_a_batch_stays_zero(device):
    """A zero matrix next to nonzero ones: its own norm is 0, the others are unaffected."""
    grad, buf = make_inputs((3, 50, 70), torch.bfloat16, device)
    grad[1] = 0
    buf[1] = 0
    x = check_step(grad, buf, 0.9)
    assert torch.equal(x[1], torch.zeros_like(x[1]))


def test_deterministic(device):
    grad, buf = make_inputs((5, 123, 123), torch.bfloat16, device)
    buf_a, buf_b = buf.clone(), buf.clone()
    x_a = nesterov_momentum(grad, buf_a, 0.95)
    x_b = nesterov_momentum(grad, buf_b, 0.95)
    assert torch.equal(x_a, x_b) and torch.equal(buf_a, buf_b)


@pytest.mark.parametrize("mu", [0.0, 1.0, 0.5])
def test_edge_momenta(mu, device):
    """mu = 0: X is the normalized gradient, buf = g. mu = 1: buf unchanged, u = buf. Integer-valued floats
    must not be specialized into constants (1 is the value Triton specializes for ints)."""
    grad, buf = make_inputs((2, 40, 60), torch.float32, device)
    start = buf.clone()
    check_step(grad, buf, mu)
    if mu == 0.0:
        assert torch.equal(buf, grad)
    if mu == 1.0:
        assert torch.equal(buf, start)


@pytest.mark.parametrize("config", TUNING_CANDIDATES + [(16, 1, 64, 1)],
                         ids=lambda c: f"{c[0]}w{c[1]}-{c[2]}w{c[3]}")
def test_every_config(config, device, monkeypatch):
    """All tuning candidates, plus tiny chunks so that a matrix has more partials (1035) than pass 2 reduces
    in one loop iteration (1024). Under the interpreter, where the 2070 tiny-chunk programs took 10 s, pass 2
    reduces 8 partials per iteration instead (_PARTIAL_BLOCK_MAX, a power of two like 1024; the loop is the
    same) and a matrix has 19 chunks of 16: 8 + 8 + 3 partials."""
    shape = (2, 3072, 768) if HAS_CUDA and config[0] >= 1024 else (2, 115, 144)
    tail = 400
    if not HAS_CUDA and config[0] == 16:
        monkeypatch.setattr(momentum, "_PARTIAL_BLOCK_MAX", 8)
        shape, tail = (2, 19, 16), 40
    grad, buf = make_inputs(shape, torch.bfloat16, device)
    # The last `tail` elements of each matrix (2.5 chunks of 16 here) carry most of its norm: a chunk or partial
    # sum left out at the end (e.g. past the first 1024, or 8, partials) changes X by far more than the tolerance.
    grad.view(shape[0], -1)[:, -tail:] *= 30
    _, expected = momentum_spec(grad, buf, 0.9)
    x = nesterov_momentum(grad, buf, 0.9, out=nan_like(grad), config=config)
    assert_all_written(x, "X")
    assert_elementwise(x, expected, name="X")


def test_empty(device):
    grad = torch.zeros(0, 4, 5, dtype=torch.bfloat16, device=device)
    x = nesterov_momentum(grad, torch.zeros(0, 4, 5, device=device), 0.9)
    assert x.shape == (0, 4, 5)


# ----------------------------------------------------------------------------------------------------
# Errors

def test_errors(device):
    g = torch.zeros(2, 8, 16, dtype=torch.bfloat16, device=device)
    b = torch.zeros(2, 8, 16, device=device)
    with pytest.raises(ValueError, match="must be 2-D .* or 3-D"):
        nesterov_momentum(torch.zeros(8, dtype=torch.bfloat16, device=device), torch.zeros(8, device=device), 0.9)
    with pytest.raises(ValueError, match="must be 2-D .* or 3-D"):
        nesterov_momentum(g[None], b[None], 0.9)
    with pytest.raises(TypeError, match="grad must be bf16 or fp32"):
        nesterov_momentum(g.half(), b, 0.9)
    with pytest.raises(ValueError, match=r"buf shape \(2, 16, 8\) differs from grad shape \(2, 8, 16\)"):
        nesterov_momentum(g, torch.zeros(2, 16, 8, device=device), 0.9)
    with pytest.raises(TypeError, match="buf .* must be fp32"):
        nesterov_momentum(g, b.bfloat16(), 0.9)
    with pytest.raises(ValueError, match="buf .* must be contiguous"):
        nesterov_momentum(g, torch.zeros(2, 16, 8, device=device).transpose(1, 2), 0.9)
    for bad in ("0.9", True, torch.tensor(0.9, device=device)):
        with pytest.raises(TypeError, match="momentum must be a Python float"):
            nesterov_momentum(g, b, bad)
    with pytest.raises(ValueError, match="out shape"):
        nesterov_momentum(g, b, 0.9, out=torch.empty(2, 8, 15, dtype=torch.bfloat16, device=device))
    with pytest.raises(TypeError, match="out must be bf16"):
        nesterov_momentum(g, b, 0.9, out=torch.empty(2, 8, 16, device=device))
    with pytest.raises(ValueError, match="out must be contiguous"):
        nesterov_momentum(g, b, 0.9, out=torch.empty(2, 16, 8, dtype=torch.bfloat16, device=device).transpose(1, 2))
    with pytest.raises(ValueError, match="out overlaps grad or buf"):
        nesterov_momentum(g, b, 0.9, out=g)
    shared = torch.zeros(2 * 8 * 16, device=device)
    with pytest.raises(ValueError, match="grad and buf overlap"):
        nesterov_momentum(shared.view(2, 8, 16), shared.view(2, 8, 16), 0.9)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a second device")
def test_device_errors():
    g = torch.zeros(2, 8, 16, dtype=torch.bfloat16, device="cuda")
    b = torch.zeros(2, 8, 16, device="cuda")
    with pytest.raises(ValueError, match="grad is on"):
        nesterov_momentum(g, b.cpu(), 0.9)
    with pytest.raises(ValueError, match="out is on"):
        nesterov_momentum(g, b, 0.9, out=torch.empty(2, 8, 16, dtype=torch.bfloat16))


def test_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        nesterov_momentum(torch.zeros(4, 5), torch.zeros(4, 5), 0.9)


@pytest.mark.parametrize("mu", [0.9, torch.tensor(0.85)], ids=["float", "tensor"])
def test_reference_matches_specification(mu):
    """The module's reference (used by the benchmark) agrees with the specification above, in both of its
    precisions."""
    grad, buf = make_inputs((3, 40, 50), torch.bfloat16, "cpu")
    buf_spec, x_spec = momentum_spec(grad, buf, mu)
    b32, b64 = buf.clone(), buf.double()
    x32 = nesterov_momentum_ref(grad, b32, mu)
    x64 = nesterov_momentum_ref(grad, b64, mu, out_dtype=torch.float64)
    assert_close_report(b64, buf_spec, atol=0, rtol=1e-12, name="buf64")  # float64 rounding only
    assert_close_report(x64, x_spec, atol=1e-15, rtol=1e-12, name="X64")
    assert_elementwise(b32, buf_spec, name="buf")
    assert_elementwise(x32, x_spec, name="X")
    assert math.isclose(x64.reshape(3, -1).norm(dim=1).max().item(), 1 / NORM_SAFETY, rel_tol=1e-3)
