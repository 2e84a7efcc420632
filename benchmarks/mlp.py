"""Benchmark cases for kernels.mlp: the MLP's up-projection with ReLU² at the speedrun's micro-step sizes.

Baselines: ``torch.compile`` of the composite (cuBLAS's matmul, then one fused pointwise kernel for ReLU² or
its derivative: the trainer's path under --no-fused-mlp) and eager torch (the matmul, then two or three
elementwise kernels). Record #74's fused kernel, for comparison: notes/measurements.md.
FLOPs: 2 M N K. Bytes (each input read once, each output written once): forward x, w, pre, act; backward
g, w2, pre, dpre.
"""
import torch

from benchmarks import DTYPE_NAME
from kernels.mlp import TUNING_CANDIDATES, linear_relu2, linear_relu2_bwd, linear_relu2_bwd_ref, linear_relu2_ref


def _close(name, got, want, scale):
    """Within 2^-6 of the terms' magnitude (a bf16 matmul over K <= 768 of O(1) terms stays far inside it; a
    wrong tile or a dropped half is off by O(scale))."""
    err = (got.float() - want.float()).abs().max().item()
    if not err <= scale * 2 ** -6:
        raise AssertionError(f"{name}: max abs err {err:.3e} against torch, bound {scale * 2 ** -6:.3e}")


def _case(direction, M, N, K, dtype, device, config=None, suffix=""):
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(M, K, generator=gen) - 0.5).to(device, dtype)
    b = (torch.randn(N, K, generator=gen) * K ** -0.5).to(device, dtype)
    pre = (a @ b.T) if direction == "bwd" else None
    elsize = torch.empty((), dtype=dtype).element_size()
    nbytes = elsize * (M * K + N * K + 2 * M * N)
    if direction == "fwd":
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
    op = ("linear_relu2" if direction == "fwd" else "linear_relu2_bwd") + suffix
    return dict(op=op, shape=f"{M}x{N}x{K}", dtype=DTYPE_NAME[dtype], fn=ours, bytes=nbytes, flops=2 * M * N * K,
                baselines={"torch.compile": compiled, "torch": ref}, check=check)


def bench_cases(device, tune=False):
    """The three stages' micro-step (M = 16384, 32768, 49152 tokens per GPU; W_fc and W_proj^T are 3072 x 768),
    both directions; with tune, every TUNING_CANDIDATES entry of each direction at M = 16384."""
    N, K = 3072, 768
    cases = [_case(d, M, N, K, torch.bfloat16, device) for M in (16384, 32768, 49152) for d in ("fwd", "bwd")]
    if tune:
        for d in ("fwd", "bwd"):
            cases += [_case(d, 16384, N, K, torch.bfloat16, device, config=c, suffix="[{}x{}x{}w{}s{}]".format(*c))
                      for c in TUNING_CANDIDATES[d]]
    return cases
