"""Benchmark cases for kernels.momentum: the per-GPU Muon batches."""
import torch
import triton

from kernels.momentum import _DEFAULT_CONFIG, TUNING_CANDIDATES, nesterov_momentum, nesterov_momentum_ref


def _case(shape, device, config=None, suffix=""):
    gen = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    buf = torch.randn(*shape, generator=gen).to(device=device)
    buf_torch, buf_compiled = buf.clone(), buf.clone()
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    mu = 0.95
    compiled = torch.compile(nesterov_momentum_ref, dynamic=False)
    numel = grad.numel()
    batch, rows, cols = shape
    chunks = triton.cdiv(rows * cols, (config or _DEFAULT_CONFIG)[0])
    # 12 bytes per element (g 2, buf read 4 + write 4, X 2), plus the partials written once and read once.
    nbytes = 12 * numel + 8 * batch * chunks

    def check():
        b64 = buf.double()
        expected = nesterov_momentum_ref(grad, b64, mu, out_dtype=torch.float64)
        start = buf.clone()
        got = nesterov_momentum(grad, buf, mu, out=out, config=config)
        buf.copy_(start)
        err = (got.double() - expected).abs().max().item()
        bound = 4 * 2.0 ** -8 * expected.abs().max().item()   # 2 ulps relative plus 2 ulps of the scale
        if not err <= bound:
            raise AssertionError(f"nesterov_momentum{suffix} {shape}: max error {err:.3e} > {bound:.3e}")

    return dict(op="nesterov_momentum" + suffix, shape="x".join(map(str, shape)), dtype="bf16",
                fn=lambda: nesterov_momentum(grad, buf, mu, out=out, config=config), bytes=nbytes, flops=0,
                baselines={"torch": lambda: nesterov_momentum_ref(grad, buf_torch, mu),
                           "torch.compile": lambda: compiled(grad, buf_compiled, mu)},
                check=check)


def bench_cases(device, tune=False):
    """The per-GPU Muon batches: MLP (3, 3072, 768) and attention (5, 768, 768), bf16 gradients."""
    cases = [_case((3, 3072, 768), device), _case((5, 768, 768), device)]
    if tune:
        for cfg in TUNING_CANDIDATES:
            block, warps, scale_block, scale_warps = cfg
            cases.append(_case((3, 3072, 768), device, config=cfg,
                               suffix=f"[{block}w{warps}/{scale_block}w{scale_warps}]"))
    return cases
