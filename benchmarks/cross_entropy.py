"""Benchmark cases of kernels/cross_entropy.py: the speedrun's LM-head loss, V=50304, bf16 logits.

Cases at N=49152 rows, K=3: forward alone, backward alone, and forward + backward (what a training step pays);
and forward + backward with the extra term (--prefix-loss: targets (2, N), K=4), against K=3 without it (its
speedup column is the term's cost, one more gather per row and target column).
Bytes are the logits read once by each kernel plus the gradient written once (the (N,) vectors are
negligible): fwd N*V*2, bwd 2*N*V*2, fwd+bwd 3*N*V*2 = 14.8 GB. Baselines for fwd+bwd: the unfused computation
(softcap in fp32, then ``F.cross_entropy`` per k, weighted sum) run eagerly and under ``torch.compile``, its
backward through autograd. The eager baseline materialises several (N, V) fp32 tensors (~10 GB each) and may
run out of memory on an 80 GB GPU; the harness then reports it as failed.

FP8 head cases, at N=16384 and N=49152 (the first and last stage's tokens per GPU):
  * ``softcapped_ce_bwd_e5m2`` (K=3 and K=1): the backward that writes the e5m2 gradient g8 (N, V), then its
    transpose g8t (V, N) (kernels.transpose). Bytes N*V*2 read + N*V written by the row kernel, N*V read and
    written by the transpose (12.4 GB at N=49152). Baseline "torch": the unfused path, our bf16 backward, then
    ``(g / scale).to(torch.float8_e5m2)`` and ``.T.contiguous()`` eagerly.
  * ``fp8_head_bwd`` (K=3, C=768): the whole backward of the FP8 LM head, the e5m2 kernel then
    dx = g8 @ w8^T and dW = x8^T @ g8t with ``torch._scaled_mm`` (w8 (C, V) and x8 (N, C) e4m3, bf16 outputs).
    FLOPs 2*2*N*C*V; bytes the minimum of a fused design: logits, x8, w8 read, dx, dW written. Baseline
    "unfused": bf16 backward, eager cast, eager transposed copy, the same two matmuls. The driver's matmul
    ceiling is the bf16 one; FP8 matmuls run about twice as fast on Hopper, so "% of roofline" here may
    approach 200%.

The gradient in the forward (train_gpt.py's --ce-grad-in-forward) beside the two-kernel path it replaces, at
N=16384 and N=49152, K=3 (the baseline "two_kernels" is that path; its speedup column is the A/B):
  * ``softcapped_ce_fwd_grad[in_place]``: losses and bf16 dlogits written over the logits, as the bf16 head does.
    Bytes 2*N*V read + 2*N*V written. Baseline: the forward kernel, then the bf16 backward (6*N*V bytes).
  * ``softcapped_ce_fwd_grad_e5m2+transpose``: losses and g8 from the fused kernel, then g8t by the transpose
    (the FP8 head's CE work over its forward and backward). Bytes 2*N*V + N*V, then 2*N*V. Baseline: the forward
    kernel, then the e5m2 backward with its transpose (7*N*V bytes).
  * ``head_ce_fwd_bwd`` and ``fp8_head_ce_fwd_bwd`` (C=768): a whole head, forward and backward through autograd
    with the trainer's incoming gradient 1/8, each against its two-kernel op. FLOPs 3*2*N*C*V (bf16 ceiling, as
    above), bytes the op's inputs and outputs (x and W read, dx and dW written).
  * with --tune, ``softcapped_ce_fwd_grad_e5m2[...]``: the fused kernel alone in each FWD_GRAD_TUNING_CANDIDATES
    configuration, at the last N.
"""
import torch
import torch.nn.functional as F

from kernels.cross_entropy import (FP8_GRAD_S, FP8_W_S, FP8_X_S, FWD_GRAD_TUNING_CANDIDATES, TUNING_CANDIDATES,
                                   fp8_e4m3, fp8_head_ce, fp8_head_ce_grad_in_fwd, fp8_head_weights,
                                   head_ce_grad_in_fwd, softcapped_cross_entropy, softcapped_cross_entropy_bwd,
                                   softcapped_cross_entropy_bwd_e5m2, softcapped_cross_entropy_fwd,
                                   softcapped_cross_entropy_fwd_grad, softcapped_cross_entropy_fwd_grad_e5m2)
from kernels.transpose import transpose_copy

SOFTCAP = (23.0, 5.0, 7.5)          # (A, B, C) as train_gpt.py uses them
MTP_WEIGHTS = [1.0, 0.5, 0.25]      # K = 3 multi-token weights (values do not change the cost)
HEAD_WIDTH = 768                    # C, the model width
GRAD_SCALE = 1 / 8                  # the gradient train_gpt.py gives the mean loss (1 / SLOTS)


def unfused_losses(logits, targets, weights, A, B, C):
    """The baseline: softcap in fp32, F.cross_entropy per k on the rows that have a k-th target, weighted sum."""
    z = A * torch.sigmoid((logits.float() + B) / C)
    N = logits.shape[0]
    losses = torch.zeros(N, dtype=torch.float32, device=logits.device)
    for k in range(weights.shape[0]):
        losses = losses + F.pad(weights[k] * F.cross_entropy(z[:N - k], targets[k:], reduction="none"), (0, k))
    return losses


def _check(device):
    """Ours against the unfused fp32 baseline on 512 rows of the real vocabulary (losses and bf16 gradient)."""
    gen = torch.Generator().manual_seed(1)
    N, V = 512, 50304
    x = (torch.randn(N, V, generator=gen) * 4 - 2.3).to(device=device, dtype=torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=gen).to(device)
    w = torch.tensor(MTP_WEIGHTS, device=device)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = softcapped_cross_entropy(xa, t, w, *SOFTCAP), unfused_losses(xb, t, w, *SOFTCAP)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)   # fp32 sums over 50304 columns
    ours.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad)


def _e5m2_inputs(device, N, V, seed):
    """bf16 logits (N, V) shaped like the head's, targets, the MTP weights, the mean's gradient, the FP8 gradient
    scale and the forward's stats: the e5m2 checks' inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, V, generator=gen) * 4 - 2.3).to(device=device, dtype=torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=gen).to(device)
    w = torch.tensor(MTP_WEIGHTS, device=device)
    grad = torch.full((N,), 1.0 / N, device=device)
    _, stats = softcapped_cross_entropy_fwd(x, t, w, *SOFTCAP)
    return x, t, w, grad, FP8_GRAD_S / N, stats


def _check_e5m2(device):
    """On 512 rows of the real vocabulary: g8t is g8 transposed byte for byte, and g8 is torch's e5m2 rounding
    of the fp32 backward / scale except, rarely, one step apart (the kernel folds 1/scale into a constant, so
    values within fp32 error of a rounding midpoint may round the other way)."""
    x, t, w, grad, scale, stats = _e5m2_inputs(device, 512, 50304, seed=2)
    g8, g8t = softcapped_cross_entropy_bwd_e5m2(grad, x, stats, t, w, *SOFTCAP, scale)
    assert torch.equal(g8t.view(torch.uint8), g8.view(torch.uint8).T), "g8t is not g8.T"
    ref = (softcapped_cross_entropy_bwd(grad, x.float(), stats, t, w, *SOFTCAP) / scale).to(torch.float8_e5m2)
    ours, want = g8.view(torch.uint8).int(), ref.view(torch.uint8).int()
    differ = ours != want
    assert differ.float().mean().item() < 1e-3, f"{int(differ.sum())} of {differ.numel()} bytes differ"
    if differ.any():
        assert (ours - want)[differ].abs().max().item() == 1, "a byte more than one e5m2 step away"


def _check_fp8_head(device):
    """On 512 rows: dx and dW of the FP8 head backward against float64 products of the same e4m3/e5m2 operands
    (dx through g8, dW through g8t: a wrong layout is off by O(1)); bf16 outputs, fp32 accumulation."""
    gen = torch.Generator().manual_seed(3)
    N, V, C = 512, 50304, HEAD_WIDTH
    x = (torch.randn(N, V, generator=gen) * 4 - 2.3).to(device=device, dtype=torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=gen).to(device)
    w = torch.tensor(MTP_WEIGHTS, device=device)
    grad = torch.full((N,), 1.0 / N, device=device)
    x8 = torch.randn(N, C, generator=gen).mul(4).to(device=device, dtype=torch.float8_e4m3fn)
    w8 = torch.randn(C, V, generator=gen).mul(4).to(device=device, dtype=torch.float8_e4m3fn)
    _, stats = softcapped_cross_entropy_fwd(x, t, w, *SOFTCAP)
    g8, g8t = torch.empty(N, V, dtype=torch.float8_e5m2, device=device), torch.empty(V, N, dtype=torch.float8_e5m2,
                                                                                      device=device)
    head = _fp8_head_fn(grad, x, stats, t, w, x8, w8, g8, g8t, FP8_GRAD_S / N)
    dx, dW = head()
    gs = FP8_GRAD_S / N
    g64 = g8.float().double() * gs
    for name, got, want in (("dx", dx, g64 @ (w8.float().double() * FP8_W_S).T),
                            ("dW", dW, (x8.float().double() * FP8_X_S).T @ g64)):
        err = (got.double() - want).abs().max().item()
        tol = 2.0 ** -7 * want.abs().max().item()     # bf16 output rounding; fp32 accumulation is far below
        assert err <= tol, f"FP8 head {name}: max abs err {err:.3e} > {tol:.3e}"


def _fp8_head_fn(grad, x, stats, targets, weights, x8, w8, g8, g8t, grad_s):
    """The FP8 head backward (kernels.cross_entropy.fp8_head_ce_bwd's work, into preallocated g8, g8t and x8t):
    e5m2 kernel into (g8, g8t), x8^T by kernels.transpose, then dx = g8 @ w8^T, dW = x8^T @ g8t."""
    one = torch.ones((), dtype=torch.float32, device=x.device)
    s_g, s_w, s_x = one * grad_s, one * FP8_W_S, one * FP8_X_S
    x8t = torch.empty((x8.shape[1], x8.shape[0]), dtype=x8.dtype, device=x8.device)

    def run():
        softcapped_cross_entropy_bwd_e5m2(grad, x, stats, targets, weights, *SOFTCAP, grad_s, out=g8, out_t=g8t)
        dx = torch._scaled_mm(g8, w8.T, scale_a=s_g, scale_b=s_w, out_dtype=torch.bfloat16)
        dW = torch._scaled_mm(transpose_copy(x8, x8t), g8t.T, scale_a=s_x, scale_b=s_g, out_dtype=torch.bfloat16)
        return dx, dW
    return run


def _fp8_head_unfused_fn(grad, x, stats, targets, weights, x8, w8, dlogits, grad_s):
    """The FP8 head backward without the e5m2 kernel: bf16 dlogits, eager divide-and-cast, eager transposed copy
    for the second operand, the same two matmuls."""
    one = torch.ones((), dtype=torch.float32, device=x.device)
    s_g, s_w, s_x = one * grad_s, one * FP8_W_S, one * FP8_X_S

    def run():
        softcapped_cross_entropy_bwd(grad, x, stats, targets, weights, *SOFTCAP, out=dlogits)
        g8 = (dlogits / grad_s).to(torch.float8_e5m2)
        dx = torch._scaled_mm(g8, w8.T, scale_a=s_g, scale_b=s_w, out_dtype=torch.bfloat16)
        dW = torch._scaled_mm(x8.T.contiguous(), g8.T.contiguous().T, scale_a=s_x, scale_b=s_g,
                              out_dtype=torch.bfloat16)
        return dx, dW
    return run


def fp8_head_cases(x, targets, dlogits, device, row_counts, tune=False):
    """The e5m2 backward and the whole FP8 head backward for each N of ``row_counts`` (<= x's rows): x (N, V)
    bf16 logits and dlogits (N, V) bf16 scratch for the baselines, both shared with the other cases (row
    prefixes). The checks run with the first N; ``tune`` adds the e5m2 configurations at the last N, K=3."""
    V = x.shape[1]
    gen = torch.Generator().manual_seed(4)
    cases = []
    for N in row_counts:
        xn, tn, dn = x[:N], targets[:N], dlogits[:N]
        grad = torch.full((N,), 1.0 / N, device=device)
        grad_s = FP8_GRAD_S / N
        _, stats = softcapped_cross_entropy_fwd(xn, tn, torch.tensor(MTP_WEIGHTS, device=device), *SOFTCAP)
        g8 = torch.empty(N, V, dtype=torch.float8_e5m2, device=device)
        g8t = torch.empty(V, N, dtype=torch.float8_e5m2, device=device)
        e5m2_bytes = N * V * x.element_size() + 3 * N * V  # read logits, write g8; transpose: read g8, write g8t
        for weights in (MTP_WEIGHTS, [1.0]):
            w = torch.tensor(weights, device=device)
            shape = f"{N}x{V} K={len(weights)}"

            def ours(cfg=None, grad=grad, xn=xn, stats=stats, tn=tn, w=w, grad_s=grad_s, g8=g8, g8t=g8t):
                softcapped_cross_entropy_bwd_e5m2(grad, xn, stats, tn, w, *SOFTCAP, grad_s, out=g8, out_t=g8t,
                                                  config=cfg)

            def eager(grad=grad, xn=xn, stats=stats, tn=tn, w=w, grad_s=grad_s, dn=dn):
                softcapped_cross_entropy_bwd(grad, xn, stats, tn, w, *SOFTCAP, out=dn)
                (dn / grad_s).to(torch.float8_e5m2).T.contiguous()

            first = N == row_counts[0] and len(weights) == 3
            cases.append(dict(op="softcapped_ce_bwd_e5m2", shape=shape, dtype="bf16", fn=ours, bytes=e5m2_bytes,
                              flops=0, baselines={"torch": eager},
                              check=(lambda: _check_e5m2(device)) if first else None))
            if tune and N == row_counts[-1] and len(weights) == 3:
                for cfg in TUNING_CANDIDATES:
                    cases.append(dict(op="softcapped_ce_bwd_e5m2[" + ",".join(f"{k}={v}" for k, v in cfg.items())
                                      + "]", shape=shape, dtype="bf16", fn=lambda cfg=cfg, ours=ours: ours(cfg),
                                      bytes=e5m2_bytes, flops=0, baselines={}))
        w3 = torch.tensor(MTP_WEIGHTS, device=device)
        C = HEAD_WIDTH
        x8 = torch.randn(N, C, generator=gen).mul(4).to(device=device, dtype=torch.float8_e4m3fn)
        w8 = torch.randn(C, V, generator=gen).mul(4).to(device=device, dtype=torch.float8_e4m3fn)
        head_bytes = N * V * x.element_size() + N * C + C * V + 2 * (N * C + C * V)
        cases.append(dict(op="fp8_head_bwd", shape=f"{N}x{V} C={C} K=3", dtype="bf16/fp8",
                          fn=_fp8_head_fn(grad, xn, stats, tn, w3, x8, w8, g8, g8t, grad_s),
                          bytes=head_bytes, flops=2 * 2 * N * C * V,
                          baselines={"unfused": _fp8_head_unfused_fn(grad, xn, stats, tn, w3, x8, w8, dn, grad_s)},
                          check=(lambda: _check_fp8_head(device)) if N == row_counts[0] else None))
    return cases


def _check_fwd_grad(device):
    """On 512 rows of the real vocabulary, default configurations: the fused kernel's losses and gradients against
    the two-kernel path's (losses to fp32 sums in another order; bf16 dlogits to a bf16 rounding; g8 bytes equal but
    rarely one e5m2 step apart, values within fp32 error of a rounding midpoint)."""
    x, t, w, grad, scale, stats = _e5m2_inputs(device, 512, 50304, seed=5)
    losses, _ = softcapped_cross_entropy_fwd(x, t, w, *SOFTCAP)
    row_grad = grad[0].item()
    got_losses, dx = softcapped_cross_entropy_fwd_grad(x, t, w, *SOFTCAP, row_grad)
    torch.testing.assert_close(got_losses, losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, softcapped_cross_entropy_bwd(grad, x, stats, t, w, *SOFTCAP))
    in_place = x.clone()
    softcapped_cross_entropy_fwd_grad(in_place, t, w, *SOFTCAP, row_grad, out=in_place)
    assert torch.equal(in_place, dx), "in place differs from out of place"
    _, g8 = softcapped_cross_entropy_fwd_grad_e5m2(x, t, w, *SOFTCAP, row_grad, scale)
    want, _ = softcapped_cross_entropy_bwd_e5m2(grad, x, stats, t, w, *SOFTCAP, scale)
    ours, want = g8.view(torch.uint8).int(), want.view(torch.uint8).int()
    differ = ours != want
    assert differ.float().mean().item() < 1e-3, f"{int(differ.sum())} of {differ.numel()} bytes differ"
    if differ.any():
        assert (ours - want)[differ].abs().max().item() == 1, "a byte more than one e5m2 step away"


def fwd_grad_cases(x, targets, scratch, device, row_counts, tune=False):
    """The gradient in the forward and the two-kernel path for each N of ``row_counts`` (<= x's rows): x (N, V)
    bf16 logits and scratch (N, V) bf16 (the in-place case's buffer and the baselines' dlogits), both shared with
    the other cases (row prefixes; an in-place run leaves gradients in scratch, finite values, which cost the same).
    The check runs with the first N; ``tune`` adds the fused kernel's configurations at the last N."""
    V = x.shape[1]
    w = torch.tensor(MTP_WEIGHTS, device=device)
    cases = []
    for N in row_counts:
        xn, tn, sn = x[:N], targets[:N], scratch[:N]
        grad = torch.full((N,), GRAD_SCALE / N, device=device)
        losses, stats = torch.empty(N, device=device), torch.empty(2, N, device=device)
        g8 = torch.empty(N, V, dtype=torch.float8_e5m2, device=device)
        g8t = torch.empty(V, N, dtype=torch.float8_e5m2, device=device)
        scale, shape, nv = FP8_GRAD_S / N, f"{N}x{V} K={len(MTP_WEIGHTS)}", N * V

        def in_place(xn=xn, tn=tn, sn=sn, N=N, losses=losses):
            softcapped_cross_entropy_fwd_grad(sn, tn, w, *SOFTCAP, GRAD_SCALE / N, losses=losses, out=sn)

        def two_kernels(xn=xn, tn=tn, sn=sn, grad=grad, losses=losses, stats=stats):
            softcapped_cross_entropy_fwd(xn, tn, w, *SOFTCAP, losses=losses, stats=stats)
            softcapped_cross_entropy_bwd(grad, xn, stats, tn, w, *SOFTCAP, out=sn)

        def fused_e5m2(cfg=None, xn=xn, tn=tn, N=N, scale=scale, losses=losses, g8=g8):
            softcapped_cross_entropy_fwd_grad_e5m2(xn, tn, w, *SOFTCAP, GRAD_SCALE / N, scale, losses=losses, out=g8,
                                                   config=cfg)

        def e5m2(fused_e5m2=fused_e5m2, g8=g8, g8t=g8t):
            fused_e5m2()
            transpose_copy(g8, g8t)

        def e5m2_two_kernels(xn=xn, tn=tn, grad=grad, scale=scale, losses=losses, stats=stats, g8=g8, g8t=g8t):
            softcapped_cross_entropy_fwd(xn, tn, w, *SOFTCAP, losses=losses, stats=stats)
            softcapped_cross_entropy_bwd_e5m2(grad, xn, stats, tn, w, *SOFTCAP, scale, out=g8, out_t=g8t)

        first = N == row_counts[0]
        cases.append(dict(op="softcapped_ce_fwd_grad[in_place]", shape=shape, dtype="bf16", fn=in_place,
                          bytes=4 * nv, flops=0, baselines={"two_kernels": two_kernels},
                          check=(lambda: _check_fwd_grad(device)) if first else None))
        cases.append(dict(op="softcapped_ce_fwd_grad_e5m2+transpose", shape=shape, dtype="bf16/e5m2", fn=e5m2,
                          bytes=5 * nv, flops=0, baselines={"two_kernels": e5m2_two_kernels}))
        if tune and N == row_counts[-1]:
            for cfg in FWD_GRAD_TUNING_CANDIDATES:
                cases.append(dict(op="softcapped_ce_fwd_grad_e5m2[" + ",".join(f"{k}={v}" for k, v in cfg.items())
                                  + "]", shape=shape, dtype="bf16/e5m2", fn=lambda cfg=cfg, f=fused_e5m2: f(cfg),
                                  bytes=3 * nv, flops=0, baselines={}))
    return cases


def head_cases(device, N, V, C=HEAD_WIDTH):
    """A whole head, forward and backward (autograd, the trainer's incoming gradient GRAD_SCALE), gradient in the
    forward against the two-kernel op: bf16 (head_ce_grad_in_fwd) and, on capability >= 8.9, FP8."""
    gen = torch.Generator(device=device).manual_seed(6)
    xh = torch.randn(N, C, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()
    wh = (torch.randn(C, V, generator=gen, device=device, dtype=torch.bfloat16) * 0.04).requires_grad_()
    t = torch.randint(0, V, (N,), generator=gen, device=device)
    w = torch.tensor(MTP_WEIGHTS, device=device)
    g = torch.tensor(GRAD_SCALE, device=device)
    grad_s = FP8_GRAD_S / (N * 8)

    def run(loss_fn):
        def fn():
            torch.autograd.grad(loss_fn(), (xh, wh), g)
        return fn

    heads = [("head_ce_fwd_bwd", "bf16",
              lambda: head_ce_grad_in_fwd(xh, wh, t, w, GRAD_SCALE, *SOFTCAP)[0],
              lambda: softcapped_cross_entropy(xh @ wh, t, w, *SOFTCAP).mean())]
    if device != "cpu" and torch.cuda.get_device_capability() >= (8, 9):
        # untimed: the trainer makes the head's e4m3 copies once per step, x's in the final norm's kernel
        w8s = (fp8_e4m3(xh.detach(), FP8_X_S), *fp8_head_weights(wh, FP8_W_S))
        heads.append(("fp8_head_ce_fwd_bwd", "bf16/fp8",
                      lambda: fp8_head_ce_grad_in_fwd(xh, wh, *w8s, t, w, FP8_X_S, FP8_W_S, grad_s, GRAD_SCALE,
                                                      *SOFTCAP)[0],
                      lambda: fp8_head_ce(xh, wh, *w8s, t, w, FP8_X_S, FP8_W_S, grad_s, *SOFTCAP)[0].mean()))
    nbytes = 2 * (2 * N * C + 2 * C * V)    # x and W read, dx and dW written (the op's inputs and outputs)
    return [dict(op=op, shape=f"{N}x{V} C={C} K=3", dtype=dtype, fn=run(new), bytes=nbytes, flops=3 * 2 * N * C * V,
                 baselines={"two_kernels": run(old)}) for op, dtype, new, old in heads]


def bench_cases(device, tune=False):
    N, V = 49152, 50304
    # drawn on the device: drawing 2.5G values on the CPU takes tens of seconds (the values do not change the cost)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(N, V, generator=gen, device=device, dtype=torch.bfloat16).mul_(4).sub_(2.3)
    targets = torch.randint(0, V, (N,), generator=gen, device=device)
    weights = torch.tensor(MTP_WEIGHTS, device=device)
    grad = torch.full((N,), 1.0 / N, device=device)
    losses = torch.empty(N, device=device)
    stats = torch.empty(2, N, device=device)
    dx = torch.empty_like(x)
    logits_bytes = N * V * x.element_size()
    shape = f"{N}x{V} K={weights.numel()}"

    def fwd(cfg=None):
        softcapped_cross_entropy_fwd(x, targets, weights, *SOFTCAP, losses=losses, stats=stats, config=cfg)

    def bwd(cfg=None):
        softcapped_cross_entropy_bwd(grad, x, stats, targets, weights, *SOFTCAP, out=dx, config=cfg)

    def fwd_bwd(cfg=None):
        fwd(cfg)
        bwd(cfg)

    x_base = x.detach().clone().requires_grad_()
    compiled = torch.compile(unfused_losses)

    def baseline(fn):
        def run():
            x_base.grad = None
            fn(x_base, targets, weights, *SOFTCAP).backward(grad)
        return run

    targets2 = torch.stack([targets, torch.randint(-1, V, (N,), generator=gen, device=device)])
    weights4 = torch.tensor(MTP_WEIGHTS + [0.25], device=device)

    def fwd_bwd_extra():
        softcapped_cross_entropy_fwd(x, targets2, weights4, *SOFTCAP, losses=losses, stats=stats)
        softcapped_cross_entropy_bwd(grad, x, stats, targets2, weights4, *SOFTCAP, out=dx)

    fwd()  # stats for the standalone backward case
    cases = [
        dict(op="softcapped_ce_fwd", shape=shape, dtype="bf16", fn=fwd, bytes=logits_bytes, flops=0,
             baselines={}),
        dict(op="softcapped_ce_bwd", shape=shape, dtype="bf16", fn=bwd, bytes=2 * logits_bytes, flops=0,
             baselines={}),
        dict(op="softcapped_ce_fwd_bwd", shape=shape, dtype="bf16", fn=fwd_bwd, bytes=3 * logits_bytes, flops=0,
             baselines={"torch.compile": baseline(compiled), "torch": baseline(unfused_losses)},
             check=lambda: _check(device)),
        dict(op="softcapped_ce_fwd_bwd[extra]", shape=f"{N}x{V} K=3+1", dtype="bf16", fn=fwd_bwd_extra,
             bytes=3 * logits_bytes, flops=0, baselines={"K=3": fwd_bwd}),
    ]
    if tune:
        for cfg in TUNING_CANDIDATES:
            cases.append(dict(op="softcapped_ce_fwd_bwd[" + ",".join(f"{k}={v}" for k, v in cfg.items()) + "]",
                              shape=shape, dtype="bf16", fn=lambda cfg=cfg: fwd_bwd(cfg),
                              bytes=3 * logits_bytes, flops=0, baselines={}))
    return (cases + fp8_head_cases(x, targets, dx, device, row_counts=(16384, N), tune=tune)
            + fwd_grad_cases(x, targets, dx, device, row_counts=(16384, N), tune=tune)
            + [c for n in (16384, N) for c in head_cases(device, n, V)])
