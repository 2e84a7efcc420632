"""Benchmark cases for kernels.accumulate: acc += fp32(grad) at the speedrun's largest gradient shapes (the LM head
(768, 50304), the MLP bank (22, 3072, 768), the stacked value embeddings (5 x 50304, 768), bf16 gradients into fp32
accumulators), one fp32 gradient, and the optimizer's padded form acc[:rows]. Baselines: torch's add_ (the
optimizer's current fold) and the same under torch.compile."""
import torch

from benchmarks import DTYPE_NAME
from kernels.accumulate import TUNING_CANDIDATES, accumulate_


def _torch_add(acc, grad):
    return acc.add_(grad)


def _case(shape, dtype, device, pad_rows=0, config=None, suffix=""):
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = shape[0]
    buf = torch.randn((rows + pad_rows, *shape[1:]), generator=gen).to(device)
    acc = buf[:rows]
    grad = (torch.randn(shape, generator=gen) * 1e-3).to(device=device, dtype=dtype)
    acc_torch, acc_compiled = acc.clone(), acc.clone()
    compiled = torch.compile(_torch_add, dynamic=False)

    def check():
        start = acc.clone()
        want = start.clone().add_(grad)
        accumulate_(acc, grad, config=config)
        same = torch.equal(acc.view(torch.int32), want.view(torch.int32))
        acc.copy_(start)
        if not same:
            raise AssertionError(f"accumulate_{suffix} {tuple(shape)} {dtype}: differs from torch's add_")

    label = "x".join(map(str, shape)) + (f" of {rows + pad_rows} rows" if pad_rows else "")
    return dict(op="accumulate_" + suffix, shape=label, dtype=f"fp32+={DTYPE_NAME[dtype]}",
                fn=lambda: accumulate_(acc, grad, config=config), bytes=grad.numel() * (2 * 4 + grad.element_size()), flops=grad.numel(),
                baselines={"torch": lambda: _torch_add(acc_torch, grad),
                           "torch.compile": lambda: compiled(acc_compiled, grad)},
                check=check)


def bench_cases(device, tune=False):
    C, V = 768, 50304
    cases = [_case((C, V), torch.bfloat16, device), _case((22, 4 * C, C), torch.bfloat16, device),
             _case((5 * V, C), torch.bfloat16, device), _case((C, V), torch.float32, device),
             _case((C, V), torch.bfloat16, device, pad_rows=1)]  # acc[:rows] of a buffer padded to a multiple of W
    if tune:
        for block, warps in TUNING_CANDIDATES:
            cases.append(_case((C, V), torch.bfloat16, device, config=(block, warps), suffix=f"[{block}w{warps}]"))
    return cases
