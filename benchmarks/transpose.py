"""Benchmark cases for kernels.transpose: the tied embedding / LM head shapes, both directions."""
import torch

from benchmarks import DTYPE_NAME
from kernels.transpose import (_RAW_DTYPE, TUNING_CANDIDATES, transpose_add, transpose_add_ref, transpose_copy,
                               transpose_copy_ref)


def _torch_copy(src, dst):
    return dst.copy_(src.T)


def _torch_add(src, dst):
    return dst.add_(src.T)


def _case(op, M, N, dtype, device, config=None, suffix=""):
    gen = torch.Generator(device="cpu").manual_seed(0)
    src = torch.randn(M, N, generator=gen).to(device=device, dtype=dtype)
    dst = torch.randn(N, M, generator=gen).to(device=device, dtype=dtype)
    dst_torch, dst_compiled = dst.clone(), dst.clone()
    size = src.element_size() * src.numel()
    if op == "transpose_copy":
        ours, torch_fn, nbytes = transpose_copy, _torch_copy, 2 * size
    else:
        ours, torch_fn, nbytes = transpose_add, _torch_add, 3 * size
    compiled = torch.compile(torch_fn, dynamic=False)

    def check():
        start = dst.clone()
        expected = start.clone()
        if op == "transpose_copy":
            transpose_copy_ref(src, expected)
        else:
            transpose_add_ref(src, expected)
        ours(src, dst, config=config)
        same = torch.equal(dst.view(_RAW_DTYPE[dst.element_size()]), expected.view(_RAW_DTYPE[dst.element_size()]))
        dst.copy_(start)
        if not same:
            raise AssertionError(f"{op}{suffix} {M}x{N} {dtype}: result differs from torch")

    return dict(op=op + suffix, shape=f"{M}x{N}", dtype=DTYPE_NAME[dtype],
                fn=lambda: ours(src, dst, config=config), bytes=nbytes, flops=0,
                baselines={"torch": lambda: torch_fn(src, dst_torch),
                           "torch.compile": lambda: compiled(src, dst_compiled)},
                check=check)


def bench_cases(device, tune=False):
    """Speedrun shapes: the (768, 50304) LM head and the (50304, 768) embedding, both directions; the FP8 head's
    e4m3 operands (kernels/cross_entropy.py): w8 (768, 50304) in the forward, x8 (49152, 768) at stage 2's
    micro-batch in the backward, copied (the torch baseline is their former ``.T.contiguous()``)."""
    V, C = 50304, 768
    cases = []
    for op in ("transpose_copy", "transpose_add"):
        cases.append(_case(op, C, V, torch.bfloat16, device))
        cases.append(_case(op, V, C, torch.bfloat16, device))
        cases.append(_case(op, C, V, torch.float32, device))
    for M, N in ((C, V), (49152, C)):
        cases.append(_case("transpose_copy", M, N, torch.float8_e4m3fn, device))
    if tune:
        for op in ("transpose_copy", "transpose_add"):
            for bm, bn, warps in TUNING_CANDIDATES:
                cases.append(_case(op, C, V, torch.bfloat16, device, config=(bm, bn, warps),
                                   suffix=f"[{bm}x{bn}w{warps}]"))
    return cases
