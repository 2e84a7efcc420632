"""Gradient accumulation into fp32: ``acc += grad`` with a low-precision (or fp32) gradient, one Triton launch.

Math, per element: acc <- acc + float32(grad), one fp32 addition rounded to nearest even: the bits of torch's
``acc.add_(grad)`` (which converts grad to fp32 exactly, then adds). NaN and inf propagate as in that addition.

Why a kernel: the trainer folds every parameter's gradient into its fp32 accumulator after each micro-step's
backward (train_gpt.py, ``Optimizer._grad_ready``), about 10 bytes per element for a bf16 gradient. torch runs the
mixed-dtype ``add_`` through its unrolled element-wise loop (one element per thread and access, the casts in
between), not the vectorised one it uses when the dtypes agree. Here each thread reads BLOCK / (32 num_warps)
consecutive elements of each tensor with wide loads and writes its fp32 sums back likewise.

Shapes and dtypes: acc fp32, grad fp32 / bf16 / fp16, the same shape (any number of dims, 0-d included). Each is
read as rows of its last dim: a tensor whose last dim has stride 1 and whose leading dims collapse into one row
index with a single row stride (contiguous tensors, slices of rows such as ``acc[:rows]``, slices of columns such
as ``buf[:, :n]``); the two row strides may differ. Other layouts (a transpose) are refused. acc is written in
place and must not overlap grad. Elements outside acc's view (padding rows, the gaps of a column slice) are not
touched.

Used by train_gpt.py's optimizer to fold gradients into its accumulators; ``python -m benchmarks --only
accumulate`` times it against torch's ``add_`` at the speedrun's gradient shapes.
"""
import torch
import triton
import triton.language as tl

from kernels._checks import check_kernel_device, overlaps

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BLOCK, num_warps): 16 elements per thread (four 16-byte loads of fp32, two of bf16). An initial choice for a
# bandwidth-bound kernel, not tuned; TUNING_CANDIDATES are what `python -m benchmarks --only accumulate --tune`
# compares.
DEFAULT_CONFIG = (2048, 4)
TUNING_CANDIDATES = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)]


# ----------------------------------------------------------------------------------------------------
# Reference


def accumulate_ref(acc, grad):
    """acc += fp32(grad) in place (torch's mixed-dtype add: the same bits as the kernel). Returns acc."""
    return acc.add_(grad)


# ----------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _accumulate_kernel(
    # tensors: acc (M, N) fp32, grad (M, N), each row-major with its own row stride
    acc_ptr, grad_ptr,
    # sizes: numel = M * N
    numel, N,
    # row strides in elements
    stride_acc, stride_grad,
    # meta-parameters
    FLAT: tl.constexpr,  # both tensors contiguous (row strides N): element i at offset i in each
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if FLAT:
        acc_offs, grad_offs = offs, offs
    else:
        row = offs // N
        col = offs - row * N
        acc_offs, grad_offs = row * stride_acc + col, row * stride_grad + col
    a = tl.load(acc_ptr + acc_offs, mask=mask)
    g = tl.load(grad_ptr + grad_offs, mask=mask).to(tl.float32)
    tl.store(acc_ptr + acc_offs, a + g, mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launcher


def _rows(name, t):
    """t as (M, N) rows of its last dim with one row stride, or a ValueError naming the layout."""
    if t.dim() == 0:
        return t.view(1, 1)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"accumulate_: {name}'s last dim must have stride 1, got strides {tuple(t.stride())}")
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"accumulate_: {name}'s leading dims must collapse into rows of one stride, got shape "
                         f"{tuple(t.shape)} strides {tuple(t.stride())}") from None


def accumulate_(acc, grad, *, config=None):
    """acc += fp32(grad) in place (module docstring), one launch. Returns acc.

    ``config`` = (BLOCK, num_warps) overrides the launch; only the benchmark uses it.
    """
    if acc.dtype != torch.float32:
        raise ValueError(f"accumulate_: acc must be float32, got {acc.dtype}")
    if grad.dtype not in GRAD_DTYPES:
        raise ValueError(f"accumulate_: grad must be one of {GRAD_DTYPES}, got {grad.dtype}")
    if acc.shape != grad.shape:
        raise ValueError(f"accumulate_: acc {tuple(acc.shape)} and grad {tuple(grad.shape)} differ in shape")
    if acc.device != grad.device:
        raise ValueError(f"accumulate_: acc on {acc.device} and grad on {grad.device}")
    check_kernel_device("accumulate_", acc.device)
    if overlaps(acc, grad):
        raise ValueError("accumulate_: acc must not overlap grad in memory")
    if acc.numel() == 0:
        return acc
    a2, g2 = _rows("acc", acc), _rows("grad", grad)
    M, N = a2.shape
    if M * max(a2.stride(0), g2.stride(0), N) >= 2 ** 31:
        raise ValueError(f"accumulate_: offsets of {tuple(acc.shape)} exceed int32 (split the tensor)")
    flat = a2.stride(0) == N and g2.stride(0) == N
    block, warps = config or DEFAULT_CONFIG
    _accumulate_kernel[(triton.cdiv(M * N, block),)](
        a2, g2, M * N, N, a2.stride(0), g2.stride(0), FLAT=flat, BLOCK=block, num_warps=warps)
    return acc
