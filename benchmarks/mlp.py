"""Benchmark cases for kernels.mlp: the MLP's up-projection with ReLU² at the speedrun's micro-step sizes.

Baselines: ``torch.compile`` of the composite (cuBLAS's matmul, then one fused pointwise kernel for ReLU² or
its derivative: the trainer's path under --no-fused-mlp) and eager torch (the matmul, then two or three
elementwise kernels). Record #74's fused kernel, for comparison: notes/measurements.md.
FLOPs: 2 M N K. Bytes (each input read once, each output written once): forward x, w, pre, act; backward
g, w2, pre, dpre. The act-only mode (train_gpt.py --mlp-act-only, ``*_act`` ops) beside it: forward x, w, act (no
pre); backward g, w2, act, dpre. ``relu2_mlp[...]``: the whole MLP forward and backward (the autograd function of
each mode against torch's composite), 12 M N K FLOPs; its bytes count only the inputs, the output and the three
gradients, so its GB/s column means nothing; compare its times.
"""
import torch

from benchmarks import DTYPE_NAME
from kernels.mlp import (TUNING_CANDIDATES, linear_relu2, linear_relu2_act, linear_relu2_bwd, linear_relu2_bwd_act,
                         linear_relu2_bwd_act_ref, linear_relu2_bwd_ref, linear_relu2_ref, relu2_mlp, relu2_mlp_ref)


def _close(name, got, want, scale):
    """Within 2^-6 of the terms' magnitude (a bf16 matmul over K <= 768 of O(1) terms stays far inside it; a
    wrong tile or a dropped half is off by O(scale))."""
    err = (got.float() - want.float()).abs().max().item()
    if not err <= scale * 2 ** -6:
        raise AssertionError(f"{name}: max abs err {err:.3e} against torch, bound {scale * 2 ** -6:.3e}")


def _case(direction, M, N, K, dtype, device, config=None, suffix="", act_only=False):
    """direction "fwd" or "bwd"; act_only: the act-only mode's launcher of that direction."""
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(M, K, generator=gen) - 0.5).to(device, dtype)
    b = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device, dtype)
    pre = (a @ b.T) if direction == "bwd" else None
    elsize = torch.empty((), dtype=dtype).element_size()
    nbytes = elsize * (M * K + N * K + (1 if act_only and direction == "fwd" else 2) * M * N)
    if act_only:
        ours, ref, check = _act_only_fns(direction, a, b, pre, config)
    elif direction == "fwd":
        def ours():
            return linear_relu2(a, b, config=config)

        def ref():
            return linear_relu2_ref(a, b)

        def check():
            (p, q), (rp, rq) = ours(), ref()
            scale = (a.float().abs() @ b.float().abs().T).max().item()
            _close("pre", p, rp, scale)
            _close("act", q, rq, 2 * scale * rp.float().abs().max().item())
    else:
        def ours():
            return linear_relu2_bwd(a, b, pre, config=config)

        def ref():
            return linear_relu2_bwd_ref(a, b, pre)

        def check():
            scale = (a.float().abs() @ b.float().abs().T).max().item() * 2 * pre.float().clamp(min=0).max().item()
            _close("dpre", ours(), ref(), scale)
    compiled = torch.compile(ref, dynamic=False)
    op = ("linear_relu2" if direction == "fwd" else "linear_relu2_bwd") + ("_act" if act_only else "") + suffix
    return dict(op=op, shape=f"{M}x{N}x{K}", dtype=DTYPE_NAME[dtype], fn=ours, bytes=nbytes, flops=2 * M * N * K,
                baselines={"torch.compile": compiled, "torch": ref}, check=check)


def _act_only_fns(direction, a, b, pre, config):
    """(ours, ref, check) of the act-only launcher of ``direction``; the backward reads act = relu(pre)^2."""
    if direction == "fwd":
        def ours():
            return linear_relu2_act(a, b, config=config)

        def ref():
            return linear_relu2_ref(a, b)[1]

        def check():
            rp, rq = linear_relu2_ref(a, b)
            scale = (a.float().abs() @ b.float().abs().T).max().item()
            _close("act", ours(), rq, 2 * scale * rp.float().abs().max().item())
        return ours, ref, check
    act = torch.relu(pre).square()

    def ours():
        return linear_relu2_bwd_act(a, b, act, config=config)

    def ref():
        return linear_relu2_bwd_act_ref(a, b, act)

    def check():
        scale = (a.float().abs() @ b.float().abs().T).max().item() * 2 * act.float().sqrt().max().item()
        _close("dpre", ours(), ref(), scale)
    return ours, ref, check


def _mlp_case(M, C, H, dtype, device, act_only):
    """relu2_mlp's forward and backward (the three gradients) in one mode, against torch's composite."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(M, C, generator=gen) - 0.5).to(device, dtype).requires_grad_()
    w_fc = (torch.randn(H, C, generator=gen) * C ** -0.5).to(device, dtype).requires_grad_()
    w_proj_t = (torch.randn(H, C, generator=gen) * H ** -0.5).to(device, dtype).requires_grad_()
    dy = torch.randn(M, C, generator=gen).to(device, dtype)

    def ours():
        out = relu2_mlp(x, w_fc, w_proj_t, act_only)
        return torch.autograd.grad(out, (x, w_fc, w_proj_t), dy)

    def ref():
        return torch.autograd.grad(relu2_mlp_ref(x, w_fc, w_proj_t), (x, w_fc, w_proj_t), dy)

    def check():
        xf, wf, pf, dyf = (t.detach().float() for t in (x, w_fc, w_proj_t, dy))
        pre = xf @ wf.T
        act, dpre = torch.relu(pre).square(), (dyf @ pf.T).abs() * 2 * torch.relu(pre)  # |dpre| of the terms
        terms = (dpre @ wf.abs(), dpre.T @ xf.abs(), act.T @ dyf.abs())  # |terms| of dx, dw_fc, dw_proj_t
        for name, g, r, t in zip(("dx", "dw_fc", "dw_proj_t"), ours(), ref(), terms):
            _close(name, g, r, t.max().item())

    elsize = torch.empty((), dtype=dtype).element_size()
    return dict(op=f"relu2_mlp[{'act_only' if act_only else 'default'}]", shape=f"{M}x{H}x{C}",
                dtype=DTYPE_NAME[dtype], fn=ours, bytes=elsize * (2 * M * C + 2 * H * C) * 2, flops=12 * M * H * C,
                baselines={"torch.compile": torch.compile(ref, dynamic=False), "torch": ref}, check=check)


def bench_cases(device, tune=False):
    """The three stages' micro-step (M = 16384, 32768, 49152 tokens per GPU; W_fc and W_proj^T are 3072 x 768),
    both directions, each in the default and the act-only mode (--mlp-act-only), and the whole MLP forward and
    backward in both modes; with tune, every TUNING_CANDIDATES entry of each direction at M = 16384."""
    N, K = 3072, 768
    cases = [_case(d, M, N, K, torch.bfloat16, device, act_only=a) for M in (16384, 32768, 49152)
             for d in ("fwd", "bwd") for a in (False, True)]
    cases += [_mlp_case(M, K, N, torch.bfloat16, device, a) for M in (16384, 49152) for a in (False, True)]
    if tune:
        for d in ("fwd", "bwd"):
            cases += [_case(d, 16384, N, K, torch.bfloat16, device, config=c, suffix="[{}x{}x{}w{}s{}]".format(*c))
                      for c in TUNING_CANDIDATES[d]]
    return cases
