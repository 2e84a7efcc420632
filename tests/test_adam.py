"""Tests for kernels/adam.py: fused AdamW with fp32 master weights.

The kernel and ``fused_adamw_ref`` follow the same operation order with every operation correctly rounded to
fp32, so they are compared bitwise (``torch.equal``). ``torch.optim.AdamW`` rounds a few operations
differently; it is compared with a drift bound derived in ``test_matches_torch_adamw_over_a_schedule``.
"""
import io
import math

import pytest
import torch

from kernels import adam
from kernels.adam import FusedAdamW, fused_adamw_multi_step, fused_adamw_ref, fused_adamw_step
from tests.tolerances import UNIT_ROUNDOFF, assert_all_written, assert_close_report, nan_like, shifted_randn

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="bf16 speedrun-size shapes run on the GPU only")
LOW_DTYPES = [torch.bfloat16, torch.float16]
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
# (8192,) is a whole number of chunks for every BLOCK (a power of two <= 8192): only the unmasked full-chunk
# path; the odd sizes end in a masked partial chunk.
ODD_SHAPES = [(278011,), (5, 123, 123), (1151, 3), (1,), (8192,)]


def _tensors(shapes, dtype, device, seed, master=True, state=True):
    """Params (shifted, realistic), grads, moments with nonzero history, masters equal to the params in fp32."""
    gen = torch.Generator().manual_seed(seed)
    params, grads, ms, vs, ws = [], [], [], [], []
    for shape in shapes:
        w = shifted_randn(*shape, generator=gen, mean=0.1, std=0.5)
        params.append(w.to(device=device, dtype=dtype))
        grads.append(shifted_randn(*shape, dtype=dtype, device=device, generator=gen, mean=-0.01, std=0.05))
        m = 0.01 * torch.randn(*shape, generator=gen) if state else torch.zeros(shape)
        v = 1e-4 * torch.rand(*shape, generator=gen) if state else torch.zeros(shape)
        ms.append(m.to(device))
        vs.append(v.to(device))
        ws.append(params[-1].float() if master and dtype != torch.float32 else None)
    return params, grads, ms, vs, ws


def _check_against_ref(params, grads, ms, vs, ws, before, **hp):
    """Each tensor: master/param, m, v bitwise equal to fused_adamw_ref on the saved inputs; param = round(master)."""
    for i, (p, m, v, w) in enumerate(zip(params, ms, vs, ws)):
        w0, g0, m0, v0 = before[i]
        rw, rm, rv = fused_adamw_ref(w0, g0, m0, v0, **hp)
        out = w if w is not None else p.float()
        for name, got, want in (("master", out, rw), ("exp_avg", m, rm), ("exp_avg_sq", v, rv)):
            if not torch.equal(got.cpu(), want.cpu()):
                assert_close_report(got, want, atol=0.0, name=f"tensor {i} {name} (bitwise)")
        if w is not None or p.dtype != torch.float32:
            assert torch.equal(p, rw.to(p.dtype)), f"tensor {i}: param != master rounded to nearest"


def _snapshot(params, grads, ms, vs, ws):
    return [((w if w is not None else p).float().clone(), g.clone(), m.clone(), v.clone())
            for p, g, m, v, w in zip(params, grads, ms, vs, ws)]


# ------------------------------------------------------------------------------------------------------------
# Functional step against the reference (bitwise)


@pytest.mark.parametrize("dtype", [torch.float32] + LOW_DTYPES, ids=str)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_step_matches_ref(device, dtype, shape):
    params, grads, ms, vs, ws = _tensors([shape], dtype, device, seed=1)
    before = _snapshot(params, grads, ms, vs, ws)
    if ws[0] is not None:
        params[0] = nan_like(params[0])  # with a master, the param is write-only: every element must be written
    fused_adamw_step(params, grads, ms, vs, ws, step=7, **HP)
    assert_all_written(params[0], "param")
    _check_against_ref(params, grads, ms, vs, ws, before, step=7, **HP)


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5, 0.7])
def test_lerp_branches(device, beta1):
    """torch's lerp switches formula at weight 1 - beta1 = 0.5; both branches must match the reference."""
    params, grads, ms, vs, ws = _tensors([(2000,)], torch.float32, device, seed=13)
    before = _snapshot(params, grads, ms, vs, ws)
    hp = dict(HP, beta1=beta1)
    fused_adamw_step(params, grads, ms, vs, ws, step=2, **hp)
    _check_against_ref(params, grads, ms, vs, ws, before, step=2, **hp)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_low_precision_without_master(device, dtype):
    """No master: the low-precision param is read, updated in fp32 and rounded back."""
    params, grads, ms, vs, _ = _tensors([(3000,), (17,)], dtype, device, seed=2)
    before = _snapshot(params, grads, ms, vs, [None, None])
    with pytest.raises(ValueError, match="only float32 params may go without"):
        fused_adamw_step(params, grads, ms, vs, [None, None], step=3, **HP)
    # the optimizer's master_weights=False path
    opt = FusedAdamW([p.requires_grad_() for p in params], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]),
                     eps=HP["eps"], weight_decay=HP["weight_decay"], master_weights=False)
    for p, g, m, v in zip(params, grads, ms, vs):
        p.grad = g
        opt.state[p].update(step=2, exp_avg=m, exp_avg_sq=v)
    opt.step()
    for p, (w0, g0, m0, v0), m, v in zip(params, before, ms, vs):
        rw, rm, rv = fused_adamw_ref(w0, g0, m0, v0, step=3, **HP)
        assert "master_param" not in opt.state[p]
        assert torch.equal(p, rw.to(dtype)) and torch.equal(m, rm) and torch.equal(v, rv)


def test_fp32_grads_of_bf16_params_and_unaligned_views(device):
    """The trainer's flat shards: fp32 grads for bf16 params; views not 16-byte aligned take the unhinted path."""
    n = 5000
    buf = torch.zeros(3 * n + 8, dtype=torch.bfloat16, device=device)
    p = buf[1:1 + n]  # 2 bytes past an aligned address
    p.copy_(torch.linspace(-1, 1, n, device=device))
    g = shifted_randn(n, device=device, mean=0.0, std=1e-2)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    w = torch.zeros(n + 1, device=device)[1:]
    w.copy_(p.float())
    before = _snapshot([p], [g], [m], [v], [w])
    fused_adamw_step([p], [g], [m], [v], [w], step=1, **HP)
    _check_against_ref([p], [g], [m], [v], [w], before, step=1, **HP)
    assert torch.equal(buf[:1], torch.zeros_like(buf[:1])) and torch.equal(buf[1 + n:], torch.zeros_like(buf[1 + n:]))


def test_many_tiny_tensors_one_launch(device, monkeypatch):
    """300 tensors of 1..17 elements (2-D and 3-D among them) go through one kernel launch."""
    shapes = [((i % 17) + 1,) if i % 3 else (1, (i % 17) + 1, 1) for i in range(300)]
    params, grads, ms, vs, ws = _tensors(shapes, torch.float16, device, seed=3)
    before = _snapshot(params, grads, ms, vs, ws)
    launches = []
    real_launch = adam._launch
    monkeypatch.setattr(adam, "_launch", lambda *a, **k: (launches.append(len(a[0])), real_launch(*a, **k)))
    fused_adamw_step(params, grads, ms, vs, ws, step=5, **HP)
    assert launches == [300]
    _check_against_ref(params, grads, ms, vs, ws, before, step=5, **HP)


@pytest.mark.parametrize("n_tensors", [1, 2, 3, 4, 5])
def test_tables_aligned_whatever_the_tensor_count(device, n_tensors, monkeypatch):
    """Every pointer the kernel receives is 16-byte aligned for any number of tensors. Triton compiles one kernel
    per alignment pattern of its pointer arguments (16-byte divisibility), so tables at offsets of n * 8 bytes
    made an odd count another kernel: the trainer's first Adam step after the untie (3 -> 4 bf16 tensors)
    compiled inside its timed run. The results still match the reference."""
    shapes = [(37 + 5 * i,) for i in range(n_tensors)]
    params, grads, ms, vs, ws = _tensors(shapes, torch.bfloat16, device, seed=11)
    before = _snapshot(params, grads, ms, vs, ws)
    seen = []
    real_plan = adam._plan
    monkeypatch.setattr(adam, "_plan", lambda *a: seen.append(real_plan(*a)) or seen[-1])
    fused_adamw_multi_step(params, grads, ms, vs, ws, [dict(HP, step=3, lr=1e-3 * (i + 1)) for i in range(n_tensors)])
    (tables, _, aligned), = seen
    assert aligned
    for name, t in tables.items():
        assert t.data_ptr() % 16 == 0, f"table {name!r} at {t.data_ptr() % 16} bytes past a 16-byte boundary"
    assert [len(tables[n]) for n in ("p", "g", "m", "v", "w", "numel")] == [n_tensors] * 6
    assert tables["p"].tolist() == [p.data_ptr() for p in params]
    assert tables["numel"].tolist() == [p.numel() for p in params]
    for i in range(n_tensors):
        _check_against_ref(params[i:i + 1], grads[i:i + 1], ms[i:i + 1], vs[i:i + 1], ws[i:i + 1], before[i:i + 1],
                           **dict(HP, step=3, lr=1e-3 * (i + 1)))


def test_multi_step_per_tensor_hyperparameters(device, monkeypatch):
    """train_gpt.py's call: fp32 params without masters and bf16 params with masters, each tensor with its own lr,
    betas, decay and step count: one launch per dtype group, every tensor bitwise equal to the reference with
    its own hyperparameters (a shared or shifted table row would change the bits)."""
    shapes = [(37,), (5, 12), (300,), (2, 33, 7), (1151,)]
    p32, g32, m32, v32, w32 = _tensors(shapes[:2], torch.float32, device, seed=21)
    p16, g16, m16, v16, w16 = _tensors(shapes[2:], torch.bfloat16, device, seed=22)
    params, grads, ms, vs, ws = p32 + p16, g32 + g16, m32 + m16, v32 + v16, w32 + w16
    grads = [g.float() for g in grads]  # the trainer's fp32 accumulators
    hps = [dict(lr=1e-3 * (i + 1), beta1=(0.9, 0.5, 0.75, 0.9, 0.5)[i], beta2=(0.99, 0.95, 0.95, 0.999, 0.9)[i],
                eps=1e-10, weight_decay=0.01 * i, step=3 + i) for i in range(len(shapes))]
    before = _snapshot(params, grads, ms, vs, ws)
    launches = []
    real_launch = adam._launch
    monkeypatch.setattr(adam, "_launch", lambda *a, **k: (launches.append(len(a[0])), real_launch(*a, **k)))
    fused_adamw_multi_step(params, grads, ms, vs, ws, hps)
    assert sorted(launches) == [2, 3]
    for i in range(len(shapes)):
        _check_against_ref(params[i:i + 1], grads[i:i + 1], ms[i:i + 1], vs[i:i + 1], ws[i:i + 1], before[i:i + 1],
                           **hps[i])
    with pytest.raises(ValueError, match="hparams has 4 entries, params has 5"):
        fused_adamw_multi_step(params, grads, ms, vs, ws, hps[:4])


def test_step_one_closed_form(device):
    """At step 1 from zero moments, the bias-corrected update is -lr * g / (|g| + eps) = -lr*sign(g) (|g| >> eps)."""
    params, grads, ms, vs, ws = _tensors([(4099,)], torch.float32, device, seed=4, state=False)
    w0, g0 = params[0].clone(), grads[0].clone()
    lr, wd = 1e-2, 0.1
    fused_adamw_step(params, grads, ms, vs, ws, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd, step=1)
    expect = w0.double() * (1 - lr * wd) - lr * g0.double() / (g0.double().abs() + 1e-8)
    # one step moves |w| by at most lr plus the decay; 8 fp32 roundings of that size bound the error
    assert_close_report(params[0], expect, atol=8 * UNIT_ROUNDOFF[torch.float32] * (w0.abs().max().item() + lr),
                        name="step 1")
    # from zero moments m = 0 + fp32(1 - beta1) * g, one rounding
    assert torch.equal(ms[0], g0 * adam._f32(1 - 0.9))


def test_zero_grad_and_zero_lr(device):
    # zero gradients from zero moments: m = v = 0, the update 0/(0 + eps) is 0: only the decay remains
    params, grads, ms, vs, ws = _tensors([(1000,)], torch.bfloat16, device, seed=5, state=False)
    grads[0].zero_()
    w0 = ws[0].clone()
    fused_adamw_step(params, grads, ms, vs, ws, step=1, **HP)
    assert torch.equal(ws[0], w0 * adam.adamw_coefficients(step=1, **HP)[0])
    assert not ms[0].any() and not vs[0].any()
    # lr = 0: nothing moves, not even by weight decay; the moments still update (as in torch)
    params, grads, ms, vs, ws = _tensors([(1000,)], torch.bfloat16, device, seed=6)
    p0, w0, m0 = params[0].clone(), ws[0].clone(), ms[0].clone()
    fused_adamw_step(params, grads, ms, vs, ws, step=9, **dict(HP, lr=0.0))
    assert torch.equal(params[0], p0) and torch.equal(ws[0], w0)
    assert not torch.equal(ms[0], m0)


# ------------------------------------------------------------------------------------------------------------
# Cautious weight decay (the trainer's rule for every Adam parameter)


def _spec_cautious(w, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step):
    """The public record's Adam step with cautious decay, written in float64 from its formula (not from our
    kernel's operation order): update = lr * sqrt(bc2) / bc1 * m' / (sqrt(v') + eps * sqrt(bc2)), the decay
    lr * wd * w applied where update * w > 0 (the step already shrinks |w|), w' = w - update - decay."""
    w, g, m, v = (t.double() for t in (w, g, m, v))
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    update = lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps)
    mask = (update * w > 0).double()
    return w - update - mask * lr * weight_decay * w, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 123, 123), (8192,)], ids=lambda s: "x".join(map(str, s)))
def test_cautious_decay_matches_ref_and_spec(device, dtype, shape):
    """cautious_wd=True: the kernel is bitwise equal to fused_adamw_ref(cautious_wd=True) (masked and full chunks,
    with and without masters), and both follow the record's formula (float64, _spec_cautious) within a few fp32
    roundings of |w| + lr (the bound of test_step_one_closed_form). The mask matters: a sizeable share of the
    elements is decayed and another is not, and the plain AdamW step differs."""
    hp = dict(HP, weight_decay=0.5)  # a decay large enough to see next to the rounding bound
    params, grads, ms, vs, ws = _tensors([shape], dtype, device, seed=31)
    before = _snapshot(params, grads, ms, vs, ws)
    fused_adamw_step(params, grads, ms, vs, ws, step=4, cautious_wd=True, **hp)
    _check_against_ref(params, grads, ms, vs, ws, before, step=4, cautious_wd=True, **hp)
    w0, g0, m0, v0 = before[0]
    expect, mask = _spec_cautious(w0, g0, m0, v0, step=4, **hp)
    got = ws[0] if ws[0] is not None else params[0].float()
    bound = 8 * UNIT_ROUNDOFF[torch.float32] * (w0.abs().max().item() + hp["lr"])
    assert_close_report(got, expect, atol=bound, name="cautious step vs the record's formula")
    assert 0.2 < mask.mean().item() < 0.8, mask.mean().item()
    plain, _, _ = fused_adamw_ref(w0, g0, m0, v0, step=4, **hp)
    assert (plain.double() - expect).abs().max() > 100 * bound, "the decay mask changed nothing"


def test_cautious_decay_spares_rows_without_gradient(device):
    """A row with zero gradient and zero moments has a zero step: cautious decay leaves it alone (plain AdamW
    decays it by lr*wd per step), in fp32 and in a bf16 param with master."""
    for dtype in (torch.float32, torch.bfloat16):
        params, grads, ms, vs, ws = _tensors([(1000,)], dtype, device, seed=32, state=False)
        grads[0][:500] = 0
        w0 = (ws[0] if ws[0] is not None else params[0]).float().clone()
        fused_adamw_step(params, grads, ms, vs, ws, step=1, cautious_wd=True, **HP)
        w1 = (ws[0] if ws[0] is not None else params[0]).float()
        assert torch.equal(w1[:500], w0[:500]), "a row without gradient was decayed"
        assert not torch.equal(w1[500:], w0[500:])


def test_multi_step_cautious_per_tensor(device):
    """The trainer's call with cautious_wd: per-tensor hyperparameters, fp32 without and bf16 with masters."""
    shapes = [(37,), (5, 12), (300,), (1151,)]
    p32, g32, m32, v32, w32 = _tensors(shapes[:2], torch.float32, device, seed=33)
    p16, g16, m16, v16, w16 = _tensors(shapes[2:], torch.bfloat16, device, seed=34)
    params, grads, ms, vs, ws = p32 + p16, [g.float() for g in g32 + g16], m32 + m16, v32 + v16, w32 + w16
    hps = [dict(lr=1e-3 * (i + 1), beta1=0.9, beta2=0.95, eps=1e-10, weight_decay=0.3 * (i + 1), step=2 + i)
           for i in range(len(shapes))]
    before = _snapshot(params, grads, ms, vs, ws)
    fused_adamw_multi_step(params, grads, ms, vs, ws, hps, cautious_wd=True)
    for i in range(len(shapes)):
        _check_against_ref(params[i:i + 1], grads[i:i + 1], ms[i:i + 1], vs[i:i + 1], ws[i:i + 1], before[i:i + 1],
                           cautious_wd=True, **hps[i])


# ------------------------------------------------------------------------------------------------------------
# The optimizer against torch.optim.AdamW


def _torch_like(opt_groups, masters):
    return torch.optim.AdamW([dict(g, params=[w]) for g, w in zip(opt_groups, masters)], foreach=False)


@pytest.mark.parametrize("dtype", [torch.float32] + LOW_DTYPES, ids=str)
def test_matches_torch_adamw_over_a_schedule(device, dtype):
    """100 steps (30 under the interpreter, where a step's launch costs ~30 ms), three param groups (different lr /
    betas / wd, lr changed by a cosine schedule from its base value down to 0 over the steps), new grad tensors
    every step (so the cached pointer tables are rebuilt), against torch.optim.AdamW(foreach=False) run in fp32
    on a copy of the master weights.

    Bound: our op order is torch's, but torch rounds a few operations differently (CPU: its lerp uses an FMA
    and its fp32 sqrt is not always correctly rounded; CUDA: FMAs in lerp / addcmul / addcdiv and division by
    a scalar through its reciprocal). Each step the final ``w + update`` may then round to a neighbour: at
    most 1 ulp(|w|) <= 2u|w|. The update itself (|update| <= lr * 1/sqrt(1 - beta2), about 0.03 here) carries
    a few ulps of its own, and the moments differ by a few ulps that decay geometrically; together these are
    below another 2u * max|w| because lr/sqrt(1 - beta2) << |w|. So k = 4: |w_ours - w_torch| <= 4*t*u*max|w|.
    """
    shapes = [(64, 33), (1000,), (3, 5, 7)]
    params, _, _, _, _ = _tensors(shapes, dtype, device, seed=7)
    params = [p.requires_grad_() for p in params]
    groups = [dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8),
              dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.0, eps=1e-6),
              dict(lr=2e-3, betas=(0.3, 0.9), weight_decay=0.01, eps=1e-8)]  # lerp weight 0.7: torch's 2nd branch
    opt = FusedAdamW([dict(g, params=[p]) for g, p in zip(groups, params)])
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    ref = _torch_like(groups, masters)
    gen = torch.Generator().manual_seed(8)
    u = UNIT_ROUNDOFF[torch.float32]
    scale = max(p.detach().float().abs().max().item() for p in params)
    steps = 100 if device == "cuda" else 30
    for t in range(1, steps + 1):
        for p, w in zip(params, masters):
            g = (0.05 * torch.randn(p.shape, generator=gen) - 0.01).to(device=device, dtype=dtype)
            p.grad, w.grad = g, g.float()
        for og, rg in zip(opt.param_groups, ref.param_groups):  # a cosine-like schedule on lr
            og["lr"] = rg["lr"] = og.setdefault("base_lr", og["lr"]) * (0.5 + 0.5 * math.cos(math.pi * t / steps))
        opt.step()
        ref.step()
        for i, (p, w) in enumerate(zip(params, masters)):
            state = opt.state[p]
            ours = state["master_param"] if dtype != torch.float32 else p.detach()
            assert state["step"] == t
            assert_close_report(ours, w.detach(), atol=4 * t * u * scale, name=f"step {t} tensor {i} master")
            # m differs from torch's by <= 2 roundings (2u|m|) per step, decaying by beta1 each step: at most
            # 2u max|m| / (1 - beta1) <= 20u max|m| (beta1 <= 0.9 here); the factor 2 more is margin.
            m_ref = ref.state[w]["exp_avg"]
            assert_close_report(state["exp_avg"], m_ref, atol=40 * u * m_ref.abs().max().item(),
                                name=f"step {t} tensor {i} exp_avg")
            if dtype != torch.float32:
                assert torch.equal(p.detach(), ours.to(dtype)), f"step {t}: param != master rounded to nearest"


def test_optimizer_groups_match_ref_bitwise(device):
    """Two groups with different hyperparameters (the per-tensor table path), and a param without grad."""
    params, grads, ms, vs, ws = _tensors([(300,), (40, 3), (7,)], torch.bfloat16, device, seed=9, state=False)
    skipped = params[2].clone().requires_grad_()
    params = [p.requires_grad_() for p in params[:2]]
    opt = FusedAdamW([dict(params=[params[0]], lr=1e-2, weight_decay=0.1),
                      dict(params=[params[1], skipped], lr=5e-3, betas=(0.8, 0.9), eps=1e-6)])
    hps = [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
           dict(lr=5e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.0)]
    states = [(p.detach().float(), torch.zeros(p.shape, device=device), torch.zeros(p.shape, device=device))
              for p in params]
    skipped0 = skipped.detach().clone()
    for t in range(1, 4):
        for i, p in enumerate(params):
            p.grad = shifted_randn(*p.shape, dtype=p.dtype, device=device, mean=0.0, std=1e-2)
            states[i] = fused_adamw_ref(*states[i][:1], p.grad, *states[i][1:], step=t, **hps[i])
        opt.step()
        for i, p in enumerate(params):
            st = opt.state[p]
            assert torch.equal(st["master_param"], states[i][0]) and torch.equal(st["exp_avg"], states[i][1])
            assert torch.equal(st["exp_avg_sq"], states[i][2]) and torch.equal(p.detach(), states[i][0].to(p.dtype))
    assert skipped not in opt.state and torch.equal(skipped.detach(), skipped0)


def test_non_contiguous_grad(device):
    p = shifted_randn(7, 5, device=device, mean=0.1).requires_grad_()
    g = shifted_randn(5, 7, device=device, mean=0.0, std=1e-2).t()
    assert not g.is_contiguous()
    zeros = torch.zeros(7, 5, device=device)
    rw, rm, rv = fused_adamw_ref(p.detach().clone(), g, zeros, zeros, step=1,
                                 **dict(HP, weight_decay=0.0))
    p.grad = g
    opt = FusedAdamW([p], lr=HP["lr"])
    opt.step()
    assert torch.equal(p.detach(), rw) and torch.equal(opt.state[p]["exp_avg"], rm)


def _run(opt, params, grads):
    for g_step in grads:
        for p, g in zip(params, g_step):
            p.grad = g
        opt.step()


def test_state_dict_round_trip(device):
    """Save mid-run, load into a fresh optimizer: the continuation is bitwise the uninterrupted one."""
    gen = torch.Generator().manual_seed(10)
    params, _, _, _, _ = _tensors([(513,), (3, 17)], torch.bfloat16, device, seed=10)
    params = [p.requires_grad_() for p in params]
    grads = [[(1e-2 * torch.randn(p.shape, generator=gen)).to(device, torch.bfloat16) for p in params]
             for _ in range(6)]
    opt = FusedAdamW([dict(params=[params[0]]), dict(params=[params[1]], lr=3e-3)], weight_decay=0.1)
    _run(opt, params, grads[:3])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved_params = [p.detach().clone() for p in params]
    _run(opt, params, grads[3:])

    params_b = [p.clone().requires_grad_() for p in saved_params]
    opt_b = FusedAdamW([dict(params=[params_b[0]]), dict(params=[params_b[1]], lr=3e-3)], weight_decay=0.1)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf))
    for key in ("master_param", "exp_avg", "exp_avg_sq"):
        assert opt_b.state[params_b[0]][key].dtype == torch.float32
    _run(opt_b, params_b, grads[3:])
    for p, pb in zip(params, params_b):
        assert torch.equal(p, pb)
        for key in ("master_param", "exp_avg", "exp_avg_sq", "step"):
            a, b = opt.state[p][key], opt_b.state[pb][key]
            assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), key


# ------------------------------------------------------------------------------------------------------------
# Errors


def test_errors_optimizer():
    p = torch.zeros(4, requires_grad=True)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        FusedAdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0: 1.0"):
        FusedAdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: -0.1"):
        FusedAdamW([p], betas=(0.9, -0.1))
    with pytest.raises(ValueError, match="Invalid epsilon value: -1e-08"):
        FusedAdamW([p], eps=-1e-8)
    with pytest.raises(ValueError, match="Invalid weight_decay value: -0.1"):
        FusedAdamW([p], weight_decay=-0.1)
    with pytest.raises(TypeError, match="complex"):
        FusedAdamW([torch.zeros(4, dtype=torch.complex64, requires_grad=True)])
    opt = FusedAdamW([p])
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()
    p.grad = torch.zeros(4)
    opt.param_groups[0]["lr"] = -1.0  # a broken schedule is caught at the step
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()


def test_errors_functional():
    def lists(n=3, dtype=torch.bfloat16):
        p = torch.zeros(n, dtype=dtype)
        return [p], [torch.zeros(n, dtype=dtype)], [torch.zeros(n)], [torch.zeros(n)], [p.float()]

    p, g, m, v, w = lists()
    with pytest.raises(ValueError, match="grads has 2 entries, params has 1"):
        fused_adamw_step(p, g * 2, m, v, w, step=1, **HP)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has shape \(4,\)"):
        fused_adamw_step(p, g, [torch.zeros(4)], v, w, step=1, **HP)
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta"):
        fused_adamw_step(p, [g[0].to("meta")], m, v, w, step=1, **HP)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\] must be float32"):
        fused_adamw_step(p, g, m, [v[0].double()], w, step=1, **HP)
    with pytest.raises(ValueError, match="contiguous"):
        fused_adamw_step([torch.zeros(3, 2).t()], [torch.zeros(2, 3)], [torch.zeros(2, 3)], [torch.zeros(2, 3)],
                         [None], step=1, **HP)
    with pytest.raises(ValueError, match="must not alias"):
        fused_adamw_step(p, g, m, m, w, step=1, **HP)
    with pytest.raises(TypeError, match="complex"):
        fused_adamw_step([torch.zeros(3, dtype=torch.complex64)], g, m, v, [None], step=1, **HP)
    with pytest.raises(RuntimeError, match="sparse"):
        fused_adamw_step(p, [g[0].to_sparse()], m, v, w, step=1, **HP)
    with pytest.raises(ValueError, match="step must be a positive integer"):
        fused_adamw_step(p, g, m, v, w, step=0, **HP)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.0"):
        fused_adamw_step(p, g, m, v, w, step=1, **dict(HP, beta2=1.0))


# ------------------------------------------------------------------------------------------------------------
# GPU: speedrun sizes


@needs_cuda
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=str)
def test_speedrun_shapes(device, dtype):
    shapes = [(768 * 50304 // 2,), (3072, 768), (768,), (1,)]
    params, grads, ms, vs, ws = _tensors(shapes, dtype, device, seed=12)
    before = _snapshot(params, grads, ms, vs, ws)
    params = [nan_like(p) for p in params]
    fused_adamw_step(params, grads, ms, vs, ws, step=1000, **HP)
    for p in params:
        assert_all_written(p, "param")
    _check_against_ref(params, grads, ms, vs, ws, before, step=1000, **HP)
