"""Tests for kernels/mlp.py: the up-projection with ReLU² in its epilogue, forward and backward, and the MLP's
custom op (its gradients, and how torch.compile records it), against a float64 specification written here again:

    pre[m, n]  = sum_k x[m, k] w[n, k]
    act[m, n]  = max(pre[m, n], 0)^2
    dpre[m, n] = (sum_k g[m, k] w2[n, k]) * 2 max(pre[m, n], 0)
    mlp(x)     = act @ w_proj_t;  d x = dpre @ w_fc, d w_fc = dpre^T x, d w_proj_t = act^T dy
    act-only:  the same act, no pre;  dpre[m, n] = (sum_k g[m, k] w2[n, k]) * 2 sqrt(act[m, n])

Tolerances (tests/tolerances.py, rule 1): the kernel's error is at most twice torch's on the same inputs plus one
unit roundoff of the terms' magnitude. For pre that magnitude is max(|x| @ |w|^T) (a dot product's rounding error
scales with its terms). act = pre^2 carries pre's error times 2|pre| (first order), so its scale is
max(2 |pre| (|x| @ |w|^T)); dpre's is max((|g| @ |w2|^T) 2 |relu(pre)|). Beyond the bound: act must equal
torch's relu(pre)^2 of the kernel's own pre bit for bit, and the persistent grid must give the same bits whatever
its size (every tile is computed the same way by whichever program takes it). The act-only mode's ReLU' factor
2 sqrt(act), against the gradient through relu(pre)^2, is judged by a bound derived at its test (rule 1 does not
cover an error torch's composite does not make).

Without a GPU the kernels run in Triton's interpreter in fp32 (IEEE dots) on small shapes; bf16 and fp16 run on
the GPU (the interpreter rounds fp32 -> bf16 toward zero, not to nearest even).
"""
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compilation import cpp_wrapper_options
from kernels.mlp import (CONFIGS, INTERPRETER_PROGRAMS, TUNING_CANDIDATES, linear_relu2, linear_relu2_act,
                         linear_relu2_bwd, linear_relu2_bwd_act, linear_relu2_bwd_act_ref, linear_relu2_bwd_ref,
                         linear_relu2_ref, register_ops, relu2_mlp, relu2_mlp_ref)
from tests.tolerances import (UNIT_ROUNDOFF, assert_all_written, assert_close_report, assert_matches_torch, nan_like,
                              shifted_randn)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (bf16/fp16 tensor-core dots)")

# (M, N, K): one row; odd M with N and K not multiples of any tile; multiples of the fp32 tile (64, 64, 32); M
# spanning several tile rows with a partial last one. N and K are multiples of 8 (TMA's 16-byte rows in bf16).
CPU_SHAPES = [(1, 8, 8), (37, 72, 40), (64, 128, 64), (130, 136, 72)]
# GPU: the above, an odd M with a partial last tile in every dimension of the 128 x 256 x 64 tile, one exact
# multiple of it, and the speedrun's stage-0 micro-step (M = 16384 tokens, 3072 x 768).
GPU_SHAPES = CPU_SHAPES + [(1151, 200, 72), (256, 512, 128), (16384, 3072, 768)]
SHAPES = GPU_SHAPES if HAS_CUDA else CPU_SHAPES
LOWP = [torch.bfloat16, torch.float16]
# The act-only backward's fp32 square root is the GPU's approximate one (tl.sqrt); its relative error, a few fp32
# ulps, is assumed at most this (the rounding of sqrt(act) to bf16 / fp16 tolerates 2^-10 / 2^-13).
SQRT_REL = 2.0 ** -20
DTYPES = [pytest.param(d, marks=gpu_only) for d in LOWP] + [torch.float32]


def spec_fwd(x, w):
    """float64 (pre, act) of the specification above."""
    pre = torch.einsum("mk,nk->mn", x.double(), w.double())
    return pre, pre.clamp(min=0) ** 2


def spec_bwd(g, w2, pre):
    return torch.einsum("mk,nk->mn", g.double(), w2.double()) * 2 * pre.double().clamp(min=0)


def inputs(M, N, K, dtype, seed=0):
    """x shifted (mean -2.3, as a normed activation is not centred), w of scale K^-1/2: pre has both signs."""
    gen = torch.Generator().manual_seed(seed)
    x = shifted_randn(M, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE, dtype)
    g = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    w2 = (torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE, dtype)
    return x, w, g, w2


def terms(a, b):
    return (a.double().abs() @ b.double().abs().T)


def check_forward(x, w, pre, act, tag):
    pre64, act64 = spec_fwd(x, w)
    pre_lp, act_lp = linear_relu2_ref(x, w)
    t = terms(x, w)
    assert_matches_torch(pre, pre64, pre_lp, name=f"pre {tag}", scale=t.max().item())
    assert_matches_torch(act, act64, act_lp, name=f"act {tag}", scale=(2 * pre64.abs() * t).max().item())
    assert torch.equal(act, torch.relu(pre).square()), f"act {tag} is not relu(pre)^2 of the kernel's pre"


def check_backward(g, w2, pre, dpre, tag):
    dpre64 = spec_bwd(g, w2, pre)
    dpre_lp = linear_relu2_bwd_ref(g, w2, pre)
    scale = (terms(g, w2) * 2 * pre.double().clamp(min=0)).max().item()
    assert_matches_torch(dpre, dpre64, dpre_lp, name=f"dpre {tag}", scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=lambda v: str(v))
def test_forward_and_backward_match_spec(M, N, K, dtype):
    if dtype == torch.float32 and M * N * K > 1 << 24:
        pytest.skip("fp32 runs IEEE dots (the tests' path): the speedrun shape is checked in bf16 and fp16")
    x, w, g, w2 = inputs(M, N, K, dtype)
    pre, act = nan_like(x.new_empty(M, N)), nan_like(x.new_empty(M, N))
    linear_relu2(x, w, out=(pre, act))
    assert_all_written(pre, "pre")
    assert_all_written(act, "act")
    check_forward(x, w, pre, act, f"{(M, N, K)} {dtype}")
    dpre = linear_relu2_bwd(g, w2, pre, out=nan_like(pre))
    assert_all_written(dpre, "dpre")
    check_backward(g, w2, pre, dpre, f"{(M, N, K)} {dtype}")


def spec_bwd_act(g, w2, act):
    """float64 dpre of the act-only backward: the ReLU' factor 2 sqrt(act) of the saved act (act >= 0), the square
    root rounded to act's dtype (relu(pre) itself wherever act is normal: test_sqrt_of_a_rounded_square...)."""
    root = act.double().sqrt().to(act.dtype).double()
    return torch.einsum("mk,nk->mn", g.double(), w2.double()) * 2 * root


def check_backward_act(g, w2, act, dpre, tag):
    """Rule 1 against the act-only backward's own specification: act is its input, as pre is the default's."""
    dpre64 = spec_bwd_act(g, w2, act)
    dpre_lp = linear_relu2_bwd_act_ref(g, w2, act)
    scale = (terms(g, w2) * 2 * act.double().sqrt()).max().item()
    assert_matches_torch(dpre, dpre64, dpre_lp, name=f"act-only dpre {tag}", scale=scale)


def check_relu_from_act(pre, act, dpre_act, dpre, tag):
    """The act-only dpre against the default's, per element: bit for bit where act is normal, else within the bound
    derived here.

    Both kernels compute the same fp32 accumulator D (one tile configuration per direction and dtype size, the same
    k-loop; only the epilogue differs) and multiply it in fp32 by a ReLU' factor: the default by 2r, r = relu(pre)
    (a value of the dtype), the act-only kernel by 2s, s = rnd(sqrt32(act)) (fp32's approximate square root, relative
    error at most SQRT_REL, then rounded to the dtype). Where act = rnd(r^2) is normal, s = r exactly
    (test_sqrt_of_a_rounded_square_is_the_value): the same product, the same bits. Below the smallest normal, with u
    the dtype's unit roundoff, u32 fp32's and sigma the dtype's smallest subnormal:

      act = rnd(r^2): |act - r^2| <= sigma / 2 (the grid there is sigma)
      |sqrt(act) - r| = |act - r^2| / (sqrt(act) + r) <= min(sigma / (2 r), sqrt(sigma / 2))      (relative: rel)
      s = sqrt(act)(1 + e3)(1 + e6) (fp32's sqrt, then the rounding to the dtype; s is a normal value of it),
      fl32(D 2s) = D 2s (1 + e4), the output rnd(.) (1 + e5) + a5;
      the default: fl32(D 2r) = D 2r (1 + e1), rnd(.) (1 + e2) + a2;  |e1|, |e4| <= u32, |e3| <= q = SQRT_REL,
      |e2|, |e5|, |e6| <= u, |a2|, |a5| <= sigma / 2 (an output below the smallest normal: absolute rounding)

    so with P = D 2r and the factor s / r in [(1 - rel)(1 - q)(1 - u), (1 + rel)(1 + q)(1 + u)]:

      |dpre_act - dpre| <= |P| max((1 + rel)(1 + q)(1 + u32)(1 + u)^2 - (1 - u32)(1 - u),
                                  (1 + u32)(1 + u) - (1 - rel)(1 - q)(1 - u32)(1 - u)^2) + sigma,
      |P| <= (|dpre| + sigma / 2) / ((1 - u32)(1 - u)),

    and exactly 0 where r = 0 or D = 0. bf16 has fp32's exponent range: act is subnormal only for r < 2^-63. fp16's
    act is subnormal for r < 2^-7, flushed to 0 for r < 2^-12.5: there the factor's error is absolute (up to
    2^-12.5). Rule 1 does not apply: torch's composite computes 2r exactly, so it has no error of this kind."""
    dtype = dpre.dtype
    u, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[torch.float32]
    fi = torch.finfo(dtype)
    sigma, tiny = fi.smallest_normal * fi.eps, fi.smallest_normal
    r = pre.double().clamp(min=0).cpu()
    a, d, da = act.double().cpu(), dpre.double().cpu(), dpre_act.double().cpu()
    rel = torch.minimum(sigma / (2 * r * r), (sigma / 2) ** 0.5 / r).nan_to_num(nan=0.0, posinf=0.0)
    q = SQRT_REL
    factor = torch.maximum((1 + rel) * (1 + q) * (1 + u32) * (1 + u) ** 2 - (1 - u32) * (1 - u),
                           (1 + u32) * (1 + u) - (1 - rel) * (1 - q) * (1 - u32) * (1 - u) ** 2)
    p = (d.abs() + sigma / 2) / ((1 - u32) * (1 - u))
    bound = torch.where((r == 0) | (d == 0) | (a >= tiny), torch.zeros_like(r), p * factor + sigma)
    assert_close_report(da, d, atol=bound, name=f"act-only dpre vs the default's {tag}")


def test_sqrt_of_a_rounded_square_is_the_value():
    """What the act-only backward rests on: for every non-negative finite r of bf16 and of fp16 whose square rounds
    to a normal finite act = rnd(r^2), every fp32 value s within SQRT_REL of sqrt(act), relative, rounds to r
    (round to nearest, the kernel's conversions: the square in fp32 is exact for these 8- and 11-bit significands,
    then rounded to the dtype; the kernel's fp32 square root is the hardware's approximate one, whose error is far
    below SQRT_REL). Where act is subnormal it fails for some r (the reason check_relu_from_act keeps a bound
    there)."""
    for dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16)
        r = bits.view(dtype)
        r = r[torch.isfinite(r)]
        act = (r.float() * r.float()).to(dtype)
        normal = torch.isfinite(act) & (act >= torch.finfo(dtype).smallest_normal)
        root = act.double().sqrt()
        backs = [(root * (1 + e)).float().to(dtype) for e in (-SQRT_REL, 0.0, SQRT_REL)]
        # r from 2^-63 to 2^64 (bf16: 127 binades of 128 values), from 2^-7 to 2^8 (fp16: 15 of 1024)
        assert normal.sum() >= (16256 if dtype == torch.bfloat16 else 15360), (dtype, int(normal.sum()))
        for back in backs:
            bad = (back != r) & normal
            assert not bad.any(), f"{dtype}: rnd(sqrt(rnd(r^2))) != r at r = {r[bad][:4].tolist()}"
        assert ((backs[1] != r) & ~normal & torch.isfinite(act)).any(), f"{dtype}: no subnormal act misses r"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("M,N,K", SHAPES, ids=lambda v: str(v))
def test_act_only_forward_and_backward_match_spec(M, N, K, dtype):
    """The act-only mode (train_gpt.py --mlp-act-only): the forward's act is the default's bit for bit (hence the
    spec's within rule 1) and the only (M, N) tensor it writes; the backward from act matches its own specification
    (rule 1) and the default backward's dpre from pre within the bound derived in check_relu_from_act."""
    if dtype == torch.float32 and M * N * K > 1 << 24:
        pytest.skip("fp32 runs IEEE dots (the tests' path): the speedrun shape is checked in bf16 and fp16")
    x, w, g, w2 = inputs(M, N, K, dtype)
    pre, act_default = linear_relu2(x, w)
    act = linear_relu2_act(x, w, out=nan_like(act_default))
    assert_all_written(act, "act")
    assert torch.equal(act, act_default), "act-only act differs from the default forward's act"
    check_forward(x, w, pre, act, f"act-only {(M, N, K)} {dtype}")
    dpre = linear_relu2_bwd_act(g, w2, act, out=nan_like(pre))
    assert_all_written(dpre, "dpre")
    check_backward_act(g, w2, act, dpre, f"{(M, N, K)} {dtype}")
    check_relu_from_act(pre, act, dpre, linear_relu2_bwd(g, w2, pre), f"{(M, N, K)} {dtype}")


@pytest.mark.parametrize("dtype", LOWP, ids=lambda d: str(d).split(".")[-1])
def test_relu_from_act_bound_holds_for_the_epilogues_arithmetic(dtype):
    """check_relu_from_act on the CPU in bf16 and fp16, where the interpreted kernels cannot go (they run fp32, in
    which sqrt(fl(r^2)) = r exactly): the two epilogues' arithmetic in torch (one fp32 accumulator D, the fp32
    factors 2r and 2 rnd(sqrt(act)), one rounding to nearest even of each product), over ReLU inputs from 2^-16 to
    2^6 (fp16's subnormal act below 2^-7 and its flush to 0 below 2^-12.5 included), gives the default's bits where
    act is normal (all of bf16's here) and meets the bound elsewhere; a dropped factor 2, a missing sqrt (2 act,
    what reading act as pre gives), another element's factor or a square root left unrounded in fp32 does not."""
    gen = torch.Generator().manual_seed(8)
    n = 1 << 14
    pre = (torch.randn(n, generator=gen).sign() * 2.0 ** (torch.rand(n, generator=gen) * 22 - 16)).to(dtype)
    D = torch.randn(n, generator=gen)  # the fp32 accumulator
    r = pre.float().clamp(min=0)
    act = r.square().to(dtype)
    dpre = (D * (2 * r)).to(dtype)
    root = act.float().sqrt().to(dtype).float()
    differs = (D * (2 * root)).to(dtype) != dpre
    # bf16: act is normal over this range, so the bits are the default's; fp16: not below r = 2^-7
    assert differs.any() == (dtype == torch.float16), f"{int(differs.sum())} elements differ"
    check_relu_from_act(pre, act, (D * (2 * root)).to(dtype), dpre, f"simulated {dtype}")
    for bug, factor in (("factor 2 dropped", root), ("sqrt omitted", 2 * act.float()),
                        ("another element's factor", 2 * root.roll(1)),
                        ("sqrt left in fp32", 2 * act.float().sqrt())):
        with pytest.raises(AssertionError, match="out of tolerance"):
            check_relu_from_act(pre, act, (D * factor).to(dtype), dpre, bug)


def test_act_only_forward_allocates_and_saves_no_pre():
    """pre is never allocated by the act-only launcher (one (M, N) tensor, act, against the default's two; none with
    out=), and relu2_mlp(act_only=True) saves act as its only (M, H) tensor for the backward (the default: pre and
    act). A kernel that still stored pre would write it over act (the act-only forward's only output): the
    bitwise act checks above catch that."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == self.shape and func.overloadpacket in (
                    torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
                    torch.ops.aten.new_empty, torch.ops.aten.zeros, torch.ops.aten.clone):
                self.count += 1
            return out

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = 37, 72, 40
    x, w, g, w2 = inputs(M, N, K, dtype, seed=7)
    counts, given = [], torch.empty(M, N, dtype=dtype, device=DEVICE)
    for call in (lambda: linear_relu2(x, w), lambda: linear_relu2_act(x, w), lambda: linear_relu2_act(x, w, out=given)):
        with Allocations((M, N)) as rec:
            call()
        counts.append(rec.count)
    assert counts == [2, 1, 0], f"(M, N) tensors allocated by linear_relu2, linear_relu2_act, with out=: {counts}"
    w_proj_t = w2.clone()
    for act_only, saved_mn in ((False, 2), (True, 1)):
        out = relu2_mlp(x.requires_grad_(), w, w_proj_t, act_only)
        saved = [t for t in out.grad_fn.saved_tensors if tuple(t.shape) == (M, N)]
        assert len(saved) == saved_mn, f"act_only={act_only}: {len(saved)} (M, H) tensors saved for the backward"
        if act_only:
            assert torch.equal(saved[0], linear_relu2(x.detach(), w)[1]), "the act-only mode saves act, not pre"


@pytest.mark.parametrize("layout", ["row_slice", "transposed", "column_step", "unaligned_rows", "bank_row"])
def test_strided_operands(layout):
    """Operands as views: a slice of wider rows (16-byte aligned: read in place); a transposed view, every other
    column of an aligned buffer and rows at an odd offset (not TMA layouts: copied); a matrix of a parameter bank
    (the trainer's W_fc)."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = 130, 136, 72
    x, w, g, w2 = inputs(M, N, K, dtype, seed=1)

    def view(t):
        if layout == "row_slice":
            buf = torch.zeros(t.shape[0], t.shape[1] + 8, dtype=dtype, device=DEVICE)
            buf[:, :t.shape[1]] = t
            return buf[:, :t.shape[1]]
        if layout == "transposed":
            return t.T.contiguous().T
        if layout == "column_step":
            buf = torch.zeros(t.shape[0], 2 * t.shape[1], dtype=dtype, device=DEVICE)
            buf[:, ::2] = t
            return buf[:, ::2]
        if layout == "unaligned_rows":
            buf = torch.zeros(t.shape[0], t.shape[1] + 1, dtype=dtype, device=DEVICE)
            buf[:, 1:] = t
            return buf[:, 1:]
        bank = torch.stack([torch.zeros_like(t), t, torch.zeros_like(t)])
        return bank.unbind(0)[1]

    pre, act = linear_relu2(view(x), view(w))
    ref_pre, ref_act = linear_relu2(x, w)
    assert torch.equal(pre, ref_pre) and torch.equal(act, ref_act), f"{layout}: other bits than contiguous inputs"
    dpre = linear_relu2_bwd(view(g), view(w2), view(pre))
    assert torch.equal(dpre, linear_relu2_bwd(g, w2, pre)), f"{layout}: dpre differs from contiguous inputs"


@pytest.mark.parametrize("num_programs", [1, 2, 5, 10_000])
def test_persistent_grid_size_gives_same_bits(num_programs):
    """1 program takes every tile, 10_000 more programs than tiles (clamped to one tile each)."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = (1151, 600, 72) if HAS_CUDA else (130, 136, 72)
    x, w, g, w2 = inputs(M, N, K, dtype, seed=2)
    pre, act = linear_relu2(x, w)
    p, a = linear_relu2(x, w, num_programs=num_programs, out=(nan_like(pre), nan_like(act)))
    assert torch.equal(p, pre) and torch.equal(a, act)
    dpre = linear_relu2_bwd(g, w2, pre)
    assert torch.equal(linear_relu2_bwd(g, w2, pre, num_programs=num_programs, out=nan_like(dpre)), dpre)
    assert torch.equal(linear_relu2_act(x, w, num_programs=num_programs, out=nan_like(act)), act)
    dpre_act = linear_relu2_bwd_act(g, w2, act)
    assert torch.equal(linear_relu2_bwd_act(g, w2, act, num_programs=num_programs, out=nan_like(dpre)), dpre_act)


def test_traced_grid_is_the_program_count_whatever_the_rows(monkeypatch):
    """Traced by torch.compile (train_gpt.py --dynamic-tokens: M a dynamic size), the persistent grid is the
    program count, not min(programs, tiles): the kernel's NUM_PROGRAMS is a compile-time constant, which a tile
    count from a symbolic M would tie to M (a recompile per M). dynamo's eager backend over the launcher's grid
    at M = 64 (2 tiles of 64 rows, fewer than the 4 programs) and 512: 4 programs at both, one graph (the kernels
    themselves cannot be traced on the CPU); eagerly, at most one program per tile. The extra programs find no
    tile: a grid of more programs than tiles gives the clamped grid's bits (the test lifts the clamp). Operands that
    are fake tensors (AOT autograd tracing the op's implementation outside dynamo) get the program count too."""
    import triton
    from torch._subclasses.fake_tensor import FakeTensorMode
    import kernels.mlp as mlp
    from compilation import unique_graphs

    def grid(x):
        return x * mlp._programs(x, triton.cdiv(x.shape[0], 64) * 2, 4)

    torch._dynamo.reset()
    graphs = unique_graphs()
    try:
        f = torch.compile(grid, backend="eager", fullgraph=True, dynamic=False)
        for M in (64, 512):
            x = torch.ones(M, 8)
            torch._dynamo.mark_dynamic(x, 0)
            assert torch.equal(f(x), 4 * x), f"M={M}: the traced grid is not the 4 programs"
        frames = unique_graphs() - graphs
    finally:
        torch._dynamo.reset()
    assert frames == 1, f"{frames} graphs for two M"
    with FakeTensorMode():  # AOT autograd's trace of the op's implementation, where dynamo is not tracing
        assert [mlp._programs(torch.empty(64, 8), t, 4) for t in (2, 16)] == [4, 4], "fake operands: not the 4"
    assert [mlp._programs(torch.empty(64, 8), t, 4) for t in (2, 16)] == [2, 4], "eagerly: one program per tile"
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w, g, w2 = inputs(130, 136, 72, dtype, seed=3)  # 3 x 3 tiles of 64 x 64 (fp32), 2 x 1 of 128 x 256 (bf16)
    pre, act = linear_relu2(x, w)
    dpre = linear_relu2_bwd(g, w2, pre)
    monkeypatch.setattr(mlp, "_programs", lambda a, tiles, num_programs: tiles + 3)
    p, a = linear_relu2(x, w, out=(nan_like(pre), nan_like(act)))
    assert torch.equal(p, pre) and torch.equal(a, act)
    assert torch.equal(linear_relu2_bwd(g, w2, pre, out=nan_like(dpre)), dpre)


def test_empty_and_zero_inner_dims():
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w = torch.ones(0, 16, dtype=dtype, device=DEVICE), torch.ones(8, 16, dtype=dtype, device=DEVICE)
    pre, act = linear_relu2(x, w)
    assert pre.shape == (0, 8) and act.shape == (0, 8)
    x0, w0 = torch.ones(5, 0, dtype=dtype, device=DEVICE), torch.ones(8, 0, dtype=dtype, device=DEVICE)
    pre, act = linear_relu2(x0, w0, out=(nan_like(torch.empty(5, 8, dtype=dtype, device=DEVICE)),
                                         nan_like(torch.empty(5, 8, dtype=dtype, device=DEVICE))))
    assert (pre == 0).all() and (act == 0).all()
    assert (linear_relu2_bwd(x0, w0, torch.ones(5, 8, dtype=dtype, device=DEVICE)) == 0).all()
    assert linear_relu2_act(x, w).shape == (0, 8)
    assert (linear_relu2_act(x0, w0, out=nan_like(torch.empty(5, 8, dtype=dtype, device=DEVICE))) == 0).all()
    assert (linear_relu2_bwd_act(x0, w0, torch.ones(5, 8, dtype=dtype, device=DEVICE)) == 0).all()


@pytest.mark.parametrize("call,message", [
    (lambda t: linear_relu2(t(4, 16)[0], t(8, 16)), "2-D"),
    (lambda t: linear_relu2(t(4, 16), t(8, 24)), "inner dims differ"),
    (lambda t: linear_relu2(t(4, 16), t(8, 16).double()), "float64"),
    (lambda t: linear_relu2(t(4, 16).int(), t(8, 16).int()), "dtype"),
    (lambda t: linear_relu2(t(4, 16), t(7, 16)), "multiple of 16 bytes"),
    (lambda t: linear_relu2(t(4, 15), t(8, 15)), "multiple of 16 bytes"),
    (lambda t: linear_relu2(t(4, 16), t(8, 16), out=(t(4, 8), t(8, 4))), "out act"),
    (lambda t: linear_relu2_bwd(t(4, 16), t(8, 16), t(4, 9)), r"pre must be \(4, 8\)"),
    (lambda t: linear_relu2_bwd(t(4, 16), t(8, 16), t(4, 8), out=t(8, 4).T), "out dpre"),
    (lambda t: linear_relu2_act(t(4, 16), t(8, 16), out=t(8, 4)), "out act"),
    (lambda t: linear_relu2_act(t(4, 16), t(8, 24)), "linear_relu2_act: inner dims differ"),
    (lambda t: linear_relu2_bwd_act(t(4, 16), t(8, 16), t(4, 9)), r"linear_relu2_bwd_act: act must be \(4, 8\)"),
    (lambda t: linear_relu2_bwd_act(t(4, 16), t(8, 16), t(4, 8).double()), "act is torch.float64"),
    (lambda t: linear_relu2_bwd_act(t(4, 16), t(8, 16), t(4, 8), out=t(8, 4).T), "out dpre"),
])
def test_bad_input_is_refused_with_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(lambda *s: torch.zeros(*s, device=DEVICE))


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="linear_relu2: tensors must be on a CUDA device"):
        linear_relu2(torch.zeros(4, 16), torch.zeros(8, 16))


@pytest.mark.parametrize("act_only", [False, True], ids=["default", "act_only"])
@pytest.mark.parametrize("direction,config", [(d, c) for d in ("fwd", "bwd") for c in sorted(
    set(TUNING_CANDIDATES[d]) | {v for (k, _), v in CONFIGS.items() if k == d})], ids=str)
def test_every_config_matches_spec(direction, config, act_only):
    """Every tile the launcher or the benchmark's tuning pass may use in that direction and mode (on the CPU in
    fp32: the interpreter runs any tile), on a shape with partial tiles in M, N and K."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, N, K = 300, 264, 200
    x, w, g, w2 = inputs(M, N, K, dtype, seed=4)
    out = (nan_like(x.new_empty(M, N)), nan_like(x.new_empty(M, N)))
    tag = f"config {config}{' act-only' if act_only else ''}"
    if direction == "fwd" and act_only:
        pre, act = linear_relu2(x, w, config=config)  # the same tile: the same accumulator
        assert torch.equal(linear_relu2_act(x, w, config=config, out=out[1]), act), tag
        check_forward(x, w, pre, out[1], tag)
    elif direction == "fwd":
        pre, act = linear_relu2(x, w, config=config, out=out)
        check_forward(x, w, pre, act, tag)
    elif act_only:
        pre, act = linear_relu2(x, w)
        dpre = linear_relu2_bwd_act(g, w2, act, config=config, out=out[0])
        check_backward_act(g, w2, act, dpre, tag)
        check_relu_from_act(pre, act, dpre, linear_relu2_bwd(g, w2, pre, config=config), tag)
    else:
        pre, _ = linear_relu2(x, w)
        check_backward(g, w2, pre, linear_relu2_bwd(g, w2, pre, config=config, out=out[0]), tag)


def mlp_grads(fn, x, w_fc, w_proj_t, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_fc, w_proj_t)]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dy)]


def spec_mlp(x, w_fc, w_proj_t):
    pre = torch.einsum("mk,nk->mn", x, w_fc)
    return torch.einsum("mn,nc->mc", pre.clamp(min=0) ** 2, w_proj_t)


@pytest.mark.parametrize("act_only", [False, True], ids=["default", "act_only"])
@pytest.mark.parametrize("compiled", [pytest.param(True, marks=gpu_only), False])
def test_relu2_mlp_forward_and_gradients(compiled, act_only):
    """relu2_mlp's output and its three gradients against the float64 spec (autograd of spec_mlp) and torch's
    composite in the same dtype (rule 1); compiled: inside torch.compile(fullgraph=True), as in the trainer.
    act_only: the ReLU' factor from sqrt(act) adds at most about u/2 relative to each dpre element
    (check_relu_from_act), less than the roundings of torch's composite (d act to the dtype, u, then its product
    by 2 relu(pre), u), so the gradients stay within rule 1's factor of torch's error."""
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    M, C, H = (1151, 256, 1024) if HAS_CUDA else (37, 24, 72)
    gen = torch.Generator().manual_seed(3)
    x = shifted_randn(M, C, generator=gen).to(DEVICE, dtype)
    w_fc = (torch.randn(H, C, generator=gen) * C ** -0.5).to(DEVICE, dtype)
    w_proj_t = (torch.randn(H, C, generator=gen) * H ** -0.5).to(DEVICE, dtype)
    dy = torch.randn(M, C, generator=gen).to(DEVICE, dtype)
    def mlp(x, w_fc, w_proj_t):
        return relu2_mlp(x, w_fc, w_proj_t, act_only)

    register_ops()  # before compiling relu2_mlp (the trainer's build_fns does the same)
    fn = torch.compile(mlp, fullgraph=True, dynamic=False) if compiled else mlp
    got = mlp_grads(fn, x, w_fc, w_proj_t, dy)
    ref64 = mlp_grads(spec_mlp, x.double(), w_fc.double(), w_proj_t.double(), dy.double())
    ref_lp = mlp_grads(relu2_mlp_ref, x, w_fc, w_proj_t, dy)
    for name, a, e, l in zip(["out", "dx", "dw_fc", "dw_proj_t"], got, ref64, ref_lp):
        assert a.dtype == dtype and a.shape == l.shape
        assert_matches_torch(a, e, l, name=f"relu2_mlp {name} compiled={compiled} act_only={act_only}")


@pytest.mark.parametrize("act_only", [False, True], ids=["default", "act_only"])
def test_relu2_mlp_is_a_cacheable_op_of_dynamos_graph(act_only):
    """In the compiled region relu2_mlp is one custom op, an OpOverload (speedrun::relu2_mlp, or with act_only
    speedrun::relu2_mlp_act_only), not an autograd.Function, which dynamo records as the autograd_function_apply
    higher-order op, for which AOT autograd's cache passes over the whole graph (the training step's AOT autograd
    then reruns at every start). The backend inspects dynamo's graph: the op is there, no autograd_function_apply,
    and AOT autograd's own cacheability check (private: run where it imports) passes; then it runs the graph as it
    is (the op's eager launches). The op's last argument is the hash of kernels/mlp.py, a constant of the graph, so
    that an edit of the launchers' Python, which the kernels' source in the key does not show, changes the key."""
    graphs = []

    def inspect_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    x, w_fc, _, w_proj_t = inputs(37, 72, 24, dtype, seed=5)
    leaves = [t.requires_grad_() for t in (x, w_fc, w_proj_t)]
    torch._dynamo.reset()
    try:
        register_ops()
        fn = torch.compile(lambda *a: relu2_mlp(*a, act_only=act_only), backend=inspect_graph, fullgraph=True,
                           dynamic=False)
        out = fn(*leaves)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, relu2_mlp(*leaves, act_only=act_only)), "dynamo's graph, run as it is, is not eager"
    (gm,) = graphs
    op = torch.ops.speedrun.relu2_mlp_act_only.default if act_only else torch.ops.speedrun.relu2_mlp.default
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    applies = [t for t in targets if isinstance(t, torch._ops.HigherOrderOperator) and "autograd_function" in t.name()]
    assert not applies and op in targets, f"dynamo's graph calls {targets}"
    # the op's last argument, a constant of the graph (so of AOT autograd's key): 56 bits of kernels/mlp.py's sha256
    source = (Path(__file__).resolve().parents[1] / "kernels" / "mlp.py").read_bytes()
    (call,) = [n for n in gm.graph.nodes if n.target == op]
    assert call.args[-1] == int(hashlib.sha256(source).hexdigest()[:14], 16), f"the op's arguments {call.args}"
    try:
        from torch._functorch._aot_autograd.autograd_cache import check_cacheable
    except ImportError:
        return
    with torch._inductor.config.patch(fx_graph_cache=True):  # the check asks for the FX graph cache (on by default)
        check_cacheable(gm)


def test_aot_autograd_cache_key_sees_both_kernels():
    """AOT autograd's cache key holds the source of the Triton kernels torch finds in a triton_op that dynamo's graph
    calls (torch reads the op's implementation and the functions it calls for wrap_triton(kernel)); the graph calls
    speedrun::relu2_mlp (or speedrun::relu2_mlp_act_only) only, so both kernels must be found in each: editing
    either (or a helper they call) then misses the cache (the launchers' Python reaches the key as SOURCE_KEY:
    test_relu2_mlp_is_a_cacheable_op_of_dynamos_graph). Run where the kernels are compiled ones
    (TRITON_INTERPRET=0: torch finds no interpreted kernel) and torch has the lookup (private)."""
    code = """
import torch
try:
    from torch._library.triton import get_triton_kernels_for_op
except ImportError:
    print("no lookup")
    raise SystemExit
import kernels.mlp
kernels.mlp.register_ops()
for op in ("speedrun::relu2_mlp", "speedrun::relu2_mlp_act_only"):
    print(sorted(k.__name__ for k in get_triton_kernels_for_op(op)))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    if run.stdout.strip() == "no lookup":
        pytest.skip("this torch has no torch._library.triton.get_triton_kernels_for_op")
    assert run.stdout.split("\n")[:-1] == ["['_linear_relu2_bwd_kernel', '_linear_relu2_fwd_kernel']"] * 2, run.stdout


def test_ops_are_registered_at_first_use_not_at_import():
    """Registering a triton_op imports torch's compiler (dynamo, inductor, sympy), so importing kernels.mlp
    registers nothing and imports none of them (``train_gpt.py --help`` stays fast: test_train_gpt's
    test_help_imports_no_compiler); relu2_mlp's first eager call registers the ops, and relu2_mlp traced by
    torch.compile before register_ops() stops with an error naming register_ops() (dynamo cannot trace the
    registration). In a fresh process, so that no other test has registered them or imported the compiler."""
    code = """
import sys, torch
import kernels.mlp as mlp
print("import", "torch._dynamo" in sys.modules or "torch._inductor" in sys.modules, bool(mlp._OPS))
f = torch.compile(lambda a, b, c: mlp.relu2_mlp(a, b, c), backend="eager", fullgraph=True)
dev = "cuda" if torch.cuda.is_available() else "cpu"
x, w, w2 = (torch.randn(n, 16, device=dev) for n in (8, 32, 32))
try:
    f(x, w, w2)
    print("compiled without register_ops")
except Exception as e:
    print("compile", "dynamo cannot trace the ops' registration" in str(e), bool(mlp._OPS))
torch._dynamo.reset()
out = mlp.relu2_mlp(x, w, w2)
print("eager", bool(mlp._OPS), out.shape == (8, 16) and bool(out.isfinite().all()))  # its numbers: tests above
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:-1] == ["import False False", "compile True False", "eager True True"], run.stdout


def test_aot_autograd_traces_the_op_into_both_kernel_launches():
    """AOT autograd traces the op's implementation and its backward into its joint graph: two user-defined Triton
    kernel launches (the forward's and the backward's), no speedrun op (which inductor would call back into Python
    for), each on the persistent grid of the program count (here the CPU's INTERPRETER_PROGRAMS, over more tiles).
    On the CPU in a process with compiled kernels (TRITON_INTERPRET=0: torch cannot trace interpreted ones), traced
    over fake tensors and never launched; the device check is lifted for that. torch cannot analyse the kernels
    without a GPU driver there (a logged warning) and then takes every argument for mutated: copies that the GPU's
    graphs do not have."""
    code = """
import torch
import kernels.mlp as mlp
from functorch.compile import aot_function, make_boxed_func
mlp.register_ops()
mlp.check_kernel_device = lambda name, device: None
joint = []
class Traced(Exception):
    pass
def partition(graph, inputs, **kwargs):
    joint.append(graph)
    raise Traced
args = [torch.randn(s, requires_grad=True) for s in ((256, 128), (512, 128), (512, 128))]
try:
    aot_function(mlp.relu2_mlp, fw_compiler=make_boxed_func, partition_fn=partition)(*args)
except Traced:
    pass
for node in joint[0].graph.nodes:
    if node.op == "call_function" and ("speedrun" in str(node.target) or "triton" in str(node.target)):
        print(node.target, node.kwargs.get("grid"))
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    grid = [(INTERPRETER_PROGRAMS, 1, 1)]
    assert run.stdout.split("\n")[:-1] == [f"triton_kernel_wrapper_functional {grid}"] * 2, run.stdout


@gpu_only
@pytest.mark.parametrize("act_only", [False, True], ids=["default", "act_only"])
def test_relu2_mlp_kernels_trace_into_the_compiled_graph(act_only):
    """Under torch.compile both kernel launches (forward and backward) are nodes of the graphs inductor is given
    (user-defined Triton kernels: AOT autograd traces the op of dynamo's graph, speedrun::relu2_mlp or
    speedrun::relu2_mlp_act_only, and its backward), not calls into Python: an opaque op would cost the trainer's
    C++ launcher a trip through Python per layer and micro-step."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    import triton
    import kernels.mlp as mlp

    def record(gm, example_inputs):
        graphs.append(gm)

        def run(*args):
            # This backend runs AOT autograd's graphs as they are: torch launches the kernels itself, through
            # Triton's allocator for their descriptors' scratch (inductor brings its own), which is per thread and
            # must be set where the graph runs: the backward runs in autograd's device thread (on one H100 it had
            # none: "no allocator was set").
            triton.set_allocator(mlp._scratch)
            return gm(*args)
        return make_boxed_func(run)

    torch._dynamo.reset()
    x, w_fc, _, w_proj_t = inputs(256, 512, 128, torch.bfloat16, seed=4)
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    register_ops()
    fn = torch.compile(lambda *a: relu2_mlp(*a, act_only=act_only), fullgraph=True, dynamic=False, backend=backend)
    fn(x.requires_grad_(), w_fc, w_proj_t).float().sum().backward()
    torch._dynamo.reset()
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    launches = [t for t in targets if "triton_kernel_wrapper" in t]
    opaque = [t for t in targets if "speedrun" in t or "linear_relu2" in t]
    assert len(graphs) == 2 and len(launches) == 2 and not opaque, \
        f"{len(graphs)} graphs, kernel launches {launches}, opaque ops {opaque} in {targets}"


@gpu_only
@pytest.mark.parametrize("act_only", [False, True], ids=["default", "act_only"])
@pytest.mark.parametrize("M, dtype", [(256, torch.bfloat16), (1151, torch.float16)])
def test_relu2_mlp_under_the_cpp_wrapper_is_the_eager_launch(M, dtype, act_only):
    """Compiled as the trainer compiles its training step (inductor's C++ launcher), relu2_mlp's output and three
    gradients are bit for bit those of the eager launches: the backward graph runs the backward kernel (torch
    2.11 once gave it the forward's cubin), and each launch gets global scratch for all its programs (its
    TMA descriptors: torch 2.11's C++ wrapper allocates one program's worth unless told otherwise).
    Compiled with inductor's caches off: the scratch size is written into the C++ code at generation time, which
    the cache key does not see, so a cached graph would test whichever process generated it (on one H200 a
    mutated copy run beside the suite failed the suite's copy of this test through the shared cache).
    act_only (--mlp-act-only): the same two kernel names with ACT_ONLY set; its forward uses three descriptors (the
    unused AUX's is dropped by the compiler: 384 bytes per program for sm_90 with Triton 3.9)."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    x, w_fc, dy, w_proj_t = inputs(M, 512, 256, dtype, seed=6)

    def mlp(x, w_fc, w_proj_t):
        return relu2_mlp(x, w_fc, w_proj_t, act_only)

    register_ops()
    fn = torch.compile(mlp, fullgraph=True, dynamic=False, options=cpp_wrapper_options())  # --cpp-wrapper's
    with torch._inductor.config.patch(force_disable_caches=True):
        got, code = run_and_get_code(lambda: mlp_grads(fn, x, w_fc, w_proj_t, dy))
    eager = mlp_grads(mlp, x, w_fc, w_proj_t, dy)
    for name, a, e in zip(["out", "dx", "dw_fc", "dw_proj_t"], got, eager):
        assert torch.equal(a, e), f"{name}: the C++ wrapper's launch differs from eager (max {(a - e).abs().max()})"
    code = "\n".join(code)
    assert "cpp_wrapper_src" in code and "_linear_relu2_bwd_kernel" in code, "no C++ wrapper, or no backward launch"
    programs = torch.cuda.get_device_properties(DEVICE).multi_processor_count  # traced: the SM count (_programs)
    sizes = re.findall(r"int64_t global_scratch\w*_size\[\] = \{([^}]*)\}", code)
    assert len(sizes) >= 2, f"no global scratch allocated for the two launches: {sizes}"
    for size in sizes:
        descriptors = 3 if act_only else 4
        assert "grid_0" in size or (int(size) % programs == 0 and int(size) >= descriptors * 128 * programs), \
            f"global scratch of {size} bytes for {programs} programs of {descriptors} TMA descriptors"


def test_cpp_wrapper_scratch_is_sized_for_every_program(monkeypatch):
    """Where inductor's C++ wrapper allocates a kernel's global scratch once (not times its grid), the parameters
    it records for the two MLP kernels carry NUM_PROGRAMS times Triton's per-program size; other kernels' are
    untouched, and a record without NUM_PROGRAMS is an error, not a short buffer."""
    import kernels.mlp as mlp
    from torch._inductor.codecache import CudaKernelParamCache
    from torch._inductor.codegen.cuda.device_op_overrides import CUDADeviceOpOverrides
    recorded = {}
    monkeypatch.setattr(CudaKernelParamCache, "set",
                        classmethod(lambda cls, key, params: recorded.update({key: params})))
    monkeypatch.setattr(CudaKernelParamCache, "_mlp_scratch_per_program", False, raising=False)

    def one_program_scratch(self, idx, workspace, prefix=None):  # torch 2.11's: the size, not times the grid
        return [f"int64_t scratch_{idx}_size[] = {{{workspace.size}}};"], f"scratch_{idx}"

    monkeypatch.setattr(CUDADeviceOpOverrides, "cpp_scratch", one_program_scratch)
    assert mlp.scratch_per_program_in_cpp_wrapper()
    assert not mlp.scratch_per_program_in_cpp_wrapper(), "installed twice"
    meta = {"constants": {"NUM_PROGRAMS": 132}}
    CudaKernelParamCache.set("_linear_relu2_fwd_kernel_0", {"global_scratch": 512, "triton_meta": meta})
    CudaKernelParamCache.set("_linear_relu2_bwd_kernel_3", {"global_scratch": 512, "triton_meta": meta})
    CudaKernelParamCache.set("triton_poi_fused_add_0", {"global_scratch": 512, "triton_meta": meta})
    CudaKernelParamCache.set("_linear_relu2_fwd_kernel_1", {"global_scratch": None, "triton_meta": {}})
    assert {k: v["global_scratch"] for k, v in recorded.items()} == {
        "_linear_relu2_fwd_kernel_0": 512 * 132, "_linear_relu2_bwd_kernel_3": 512 * 132,
        "triton_poi_fused_add_0": 512, "_linear_relu2_fwd_kernel_1": None}
    with pytest.raises(RuntimeError, match="no NUM_PROGRAMS for _linear_relu2_bwd_kernel_0"):
        CudaKernelParamCache.set("_linear_relu2_bwd_kernel_0", {"global_scratch": 512, "triton_meta": {}})
