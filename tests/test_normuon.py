"""Tests for kernels/normuon.py against a float64 specification written here.

Each step is checked on its own, from the kernel's own state (v2, master) of the previous step. The state and
the parameter are held to rule 2 (tests/tolerances.py): v2 in fp32 ulps, the master in fp32 ulps at the scale of
the weights; the bf16 parameter must be the master rounded to bf16 (one rounding: within one bf16 ulp of the
float64 master, two under the interpreter, whose fp32 -> bf16 conversion truncates).
"""
import pytest
import torch

from kernels import normuon
from kernels.normuon import TUNING_CANDIDATES, normuon_update, normuon_update_ref
from tests.tolerances import assert_all_written, assert_elementwise, nan_like, shifted_randn

HAS_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="bf16 parameters and speedrun shapes need a CUDA GPU")

# Tall, square, wide; odd sizes (masked lines and a partial last chunk) and tile-aligned ones (64 x 256: whole
# 32-line blocks, whole 256-element line chunks and whole 4096-element apply chunks).
SHAPES = [(1, 37, 19), (3, 64, 64), (2, 19, 45), (4, 256, 64), (2, 64, 256), (1, 1, 5), (2, 5, 1)]
SPEEDRUN_SHAPES = [(40, 768, 768), (22, 3072, 768)]
HP = dict(lr=0.023 * 1.3, beta2=0.95, wd=1.2 * 0.023 * 1.3)


def shape_id(s):
    return "x".join(map(str, s))


def make_inputs(shape, device, seed=0, o_dtype=torch.float32):
    k, M, N = shape
    g = torch.Generator().manual_seed(seed)
    # o: ~orthogonal scale 1/sqrt(max(M, N)) per entry, rows of unequal size so that the normalisation matters.
    o = torch.randn(shape, generator=g) / max(M, N) ** 0.5
    o = o * torch.linspace(0.3, 3.0, M).view(1, M, 1) * torch.linspace(0.5, 2.0, N).view(1, 1, N)
    o = o * torch.arange(1, k + 1, dtype=torch.float32).view(k, 1, 1)  # matrices of different norms
    v2_shape = (k, M, 1) if M >= N else (k, 1, N)
    v2 = torch.rand(v2_shape, generator=g) * o.square().mean().item() * 2
    master = shifted_randn(*shape, generator=g, mean=0.01, std=0.05)
    lr_mul = torch.where(torch.arange(k) % 2 == 1, 2.0, 1.0).float()
    return o.to(device, o_dtype), v2.to(device), master.to(device), lr_mul.to(device)


def normuon_spec(o, v2, master, lr_mul, lr, beta2, wd):
    """The specification in float64 (independent of the module): returns (new v2, new master)."""
    o, v2, w = (t.detach().to("cpu", torch.float64) for t in (o, v2, master))
    k, M, N = o.shape
    dim = 2 if M >= N else 1       # tall/square: each row's mean over its N columns; wide: each column's
    c = float(torch.tensor(1 - beta2, dtype=torch.float32))
    v2 = v2 + c * (o.square().mean(dim=dim, keepdim=True) - v2)
    u = o / torch.sqrt(torch.clamp(v2, min=1e-10))
    scale = torch.sqrt((o ** 2).sum(dim=(1, 2))) / torch.clamp(torch.sqrt((u ** 2).sum(dim=(1, 2))), min=1e-10)
    u = u * scale.view(k, 1, 1)
    lr_b = lr_mul.to("cpu", torch.float64).view(k, 1, 1) * lr
    decay = torch.where(u * w >= 0, w * wd, torch.zeros_like(w))
    return v2, w - lr_b * (u + decay)


def check_step(o, v2, master, lr_mul, param_dtype=torch.float32, **hp):
    hp = {**HP, **hp}
    v2_exp, w_exp = normuon_spec(o, v2, master, lr_mul, **hp)
    param = nan_like(master, param_dtype)
    out = normuon_update(o, v2, master, lr_mul, param, **hp)
    assert out is param
    assert_all_written(param, "param")
    assert_elementwise(v2, v2_exp, name="v2")
    # The master moves by lr * |u| per step; its error is one rounding of w plus the fp32 error of the update
    # (a few ulps of |u| * lr, far below one ulp of w at these magnitudes): 2 fp32 ulps of the weight scale.
    assert_elementwise(master, w_exp, name="master")
    if param_dtype == torch.float32:
        assert torch.equal(param, master)
    else:
        assert_elementwise(param, w_exp, name="param", ulps=2.0 if not HAS_CUDA else 1.0)
        if HAS_CUDA:
            assert torch.equal(param, master.to(param_dtype))
    return v2_exp, w_exp


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_steps_match_float64_spec(shape, device):
    o, v2, master, lr_mul = make_inputs(shape, device)
    for step in range(3):
        check_step(o, v2, master, lr_mul)
        o = make_inputs(shape, device, seed=step + 1)[0]


@pytest.mark.parametrize("shape", [(1, 37, 19), (2, 19, 45)], ids=shape_id)
def test_bf16_o_input(shape, device):
    o, v2, master, lr_mul = make_inputs(shape, device, o_dtype=torch.bfloat16)
    check_step(o, v2, master, lr_mul)


@gpu_only
@pytest.mark.parametrize("shape", SHAPES + SPEEDRUN_SHAPES, ids=shape_id)
def test_bf16_param_gpu(shape):
    o, v2, master, lr_mul = make_inputs(shape, "cuda", o_dtype=torch.bfloat16)
    check_step(o, v2, master, lr_mul, param_dtype=torch.bfloat16)


@gpu_only
@pytest.mark.parametrize("shape", SPEEDRUN_SHAPES, ids=shape_id)
def test_speedrun_shapes_fp32_gpu(shape):
    o, v2, master, lr_mul = make_inputs(shape, "cuda")
    check_step(o, v2, master, lr_mul)


def test_matches_module_reference(device):
    """The module's reference (today's eager code path in train_gpt.py) agrees with the float64 spec."""
    o, v2, master, lr_mul = make_inputs((3, 40, 24), "cpu")
    v2_exp, w_exp = normuon_spec(o, v2, master, lr_mul, **HP)
    p = normuon_update_ref(o, v2, master, lr_mul, param_dtype=torch.float32, **HP)
    assert_elementwise(v2, v2_exp, name="v2")
    assert_elementwise(master, w_exp, name="master")
    assert torch.equal(p, master)


def test_cautious_mask_edge(device):
    """u * w == 0 counts as agreeing (decay applies, a no-op for w = 0); u * w < 0 gets no decay at all."""
    k, M, N = 1, 8, 4
    o = torch.ones((k, M, N), device=device)
    o[0, :, 1] = -1.0
    o[0, :, 2] = 0.0                 # u = 0 here: u * w == 0 with w != 0 -> decayed by w * wd only
    v2 = torch.ones((k, M, 1), device=device)
    master = torch.full((k, M, N), 0.5, device=device)
    master[0, :, 3] = 0.0            # w = 0: u * w == 0 -> stays u-only, decay of 0
    lr_mul = torch.ones(k, device=device)
    lr, wd = 0.1, 0.25
    v2_exp, w_exp = normuon_spec(o, v2, master, lr_mul, lr, 0.95, wd)
    start = master.clone()
    normuon_update(o, v2, master, lr_mul, torch.empty_like(master), lr=lr, beta2=0.95, wd=wd)
    assert_elementwise(master, w_exp, name="master")
    # column 1: u < 0, w > 0 -> no decay; column 2: u == 0 -> pure decay w * (1 - lr * wd)
    assert torch.allclose(master[0, :, 2].double(), start[0, :, 2].double() * (1 - lr * wd), rtol=1e-6)
    u1 = (start[0, :, 1] - master[0, :, 1]) / lr   # = u, with no decay term
    assert torch.all(u1 < 0)


def test_zero_matrix_stays_zero(device):
    """Shard padding: an all-zero o and master stay zero (no 0/0), the other matrices are unaffected."""
    o, v2, master, lr_mul = make_inputs((3, 24, 16), device)
    o[1] = 0
    master[1] = 0
    v2[1] = 0
    check_step(o, v2, master, lr_mul)
    assert torch.equal(master[1], torch.zeros_like(master[1]))


@pytest.mark.parametrize("config", TUNING_CANDIDATES + [(1, 4, 1, 64, 1)], ids=lambda c: "-".join(map(str, c)))
def test_every_config(config, device, monkeypatch):
    """Every tuning candidate, plus one line per pass-1 program so that a matrix has more partials (1030) than
    pass 2 reduces per loop iteration (1024), and lines span several BLOCK_A chunks (10 = 4 + 4 + 2). Under the
    interpreter, where 1030 pass-1 programs took 12 s, pass 2 reduces 8 partials per iteration instead
    (_PARTIAL_BLOCK_MAX, a power of two like 1024; the loop is the same) and a matrix has 18 lines: 8 + 8 + 2."""
    shape = (1, 1030, 10) if config[0] == 1 else (2, 300, 100)
    if HAS_CUDA and config[0] > 1:
        shape = (3, 3072, 768)
    if not HAS_CUDA and config[0] == 1:
        monkeypatch.setattr(normuon, "_PARTIAL_BLOCK_MAX", 8)
        shape = (1, 18, 10)
    o, v2, master, lr_mul = make_inputs(shape, device)
    v2_exp, w_exp = normuon_spec(o, v2, master, lr_mul, **HP)
    param = nan_like(master)
    normuon_update(o, v2, master, lr_mul, param, config=config, **HP)
    assert_all_written(param, "param")
    assert_elementwise(v2, v2_exp, name="v2")
    assert_elementwise(master, w_exp, name="master")


def test_deterministic(device):
    o, v2, master, lr_mul = make_inputs((3, 64, 48), device)
    a = (v2.clone(), master.clone())
    b = (v2.clone(), master.clone())
    for v, w in (a, b):
        normuon_update(o, v, w, lr_mul, torch.empty_like(w), **HP)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty(device):
    o = torch.zeros(0, 4, 3, device=device)
    p = normuon_update(o, torch.zeros(0, 4, 1, device=device), torch.zeros(0, 4, 3, device=device),
                       torch.zeros(0, device=device), torch.zeros(0, 4, 3, device=device), **HP)
    assert p.shape == (0, 4, 3)


def test_errors(device):
    o, v2, master, lr_mul = make_inputs((2, 8, 4), device)
    p = torch.empty_like(master)
    with pytest.raises(ValueError, match=r"o must be 3-D"):
        normuon_update(o[0], v2, master, lr_mul, p, **HP)
    with pytest.raises(ValueError, match=r"v2 must have shape \(2, 8, 1\)"):
        normuon_update(o, torch.zeros(2, 1, 4, device=device), master, lr_mul, p, **HP)
    with pytest.raises(TypeError, match="o must be torch.bfloat16 or torch.float32"):
        normuon_update(o.half(), v2, master, lr_mul, p, **HP)
    with pytest.raises(TypeError, match="master must be torch.float32"):
        normuon_update(o, v2, master.bfloat16(), lr_mul, p, **HP)
    with pytest.raises(ValueError, match="lr_mul must have shape"):
        normuon_update(o, v2, master, lr_mul[:1], p, **HP)
    with pytest.raises(ValueError, match="param_out must be contiguous"):
        normuon_update(o, v2, master, lr_mul, torch.empty(2, 4, 8, device=device).transpose(1, 2), **HP)
    with pytest.raises(ValueError, match="master and param_out overlap"):
        normuon_update(o, v2, master, lr_mul, master, **HP)
    with pytest.raises(TypeError, match="lr must be a Python float"):
        normuon_update(o, v2, master, lr_mul, p, **{**HP, "lr": torch.tensor(0.1)})


def test_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    o, v2, master, lr_mul = make_inputs((1, 4, 3), "cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        normuon_update(o, v2, master, lr_mul, torch.empty_like(master), **HP)
