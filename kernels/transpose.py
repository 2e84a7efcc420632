"""Tiled transposes for the tied token embedding and the transposed LM head.

The token embedding ``embed`` is stored as (V, C) = (50304, 768) and the LM head as its transpose
(C, V) = (768, 50304) so that the head matmul reads it contiguously. When the two are tied,
``train_gpt.py`` keeps them equal with two calls per step that updates them (every ``adam_every`` steps):

    transpose_add(embed_grad, head_grad)   # head_grad += embed_grad.T, before the gradient reduce
    transpose_copy(head, embed)            # embed = head.T, after the optimizer step

Math (src is (M, N), dst is (N, M), any strides on both):

    transpose_copy:  dst[j, i] = src[i, j]                                   (bitwise copy)
    transpose_add:   dst[j, i] = round_dtype(fp32(dst[j, i]) + fp32(src[i, j]))  (one rounding)

Dtype policy:
- ``transpose_copy``: float8 (e5m2, e4m3fn), bf16, fp16, fp32; src and dst of the same dtype. The data is
  moved as raw integers of the same width (int8 / int16 / int32 views), so every bit pattern (NaN
  payloads, negative zero) survives. The FP8 head (kernels/cross_entropy.py) transposes its e5m2 gradient and
  its two e4m3 operands with it.
- ``transpose_add``: bf16, fp16, fp32; src and dst of the same dtype. The addend is never rounded before
  the add: both values are widened to fp32, added once in fp32 (exact IEEE add, as torch does), and the sum
  is rounded once to nearest-even. This is bit for bit ``(dst.float() + src.T.float()).to(dtype)``, which
  is also what ``dst.add_(src.T)`` computes in PyTorch.

Kernel: one program per (BLOCK_M, BLOCK_N) tile of src. The tile is loaded coalesced along src's
contiguous dimension, transposed with ``tl.trans`` (the layout conversion goes through shared memory), and
stored coalesced along dst's contiguous dimension. Programs are visited in groups of ``GROUP_M`` tile rows
so that neighbouring programs touch neighbouring DRAM pages on both sides. It is a plain grid, not a
persistent kernel: CTAs retire as they finish, leaving SMs free for overlapped NCCL kernels. Index math is
64-bit: a 49152 x 50304 matrix has 2.47e9 elements.

Traffic (bf16, 768 x 50304): copy reads 77.3 MB and writes 77.3 MB (35.9 us at 4.3 TB/s on H200); add also
reads dst (231.8 MB, 53.9 us).
"""

import torch
import triton
import triton.language as tl

from kernels._checks import check_kernel_device, overlaps

# Integer types of the same width used to move bits in transpose_copy.
_RAW_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
COPY_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)
ADD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Tiles for the usual case, where src and dst are contiguous along different dimensions (a real
# transpose), keyed by element size in bytes: (BLOCK_M, BLOCK_N, num_warps). Each tile row is at least
# 128 bytes (one full cache line) on both sides, and a tile is 8-16 KB so that several CTAs per SM keep
# enough bytes in flight. 2-byte entry tuned on one H200 (`python -m benchmarks --only transpose --tune`, bf16
# 768x50304; times in notes/measurements.md); the 4-byte entry is an initial choice, not tuned on the device.
# The 1-byte entry (the FP8 head's e5m2 gradient and e4m3 operands, kernels/cross_entropy.py) is an initial
# choice: 128-byte rows on both sides, 16 KB tiles; not tuned.
_TRANSPOSE_CONFIG = {1: (128, 128, 8), 2: (128, 128, 8), 4: (64, 64, 8)}
# When src and dst are contiguous along the same dimension (e.g. dst is itself a transposed view, so the
# operation is a plain strided copy), a long thin tile gives 512-byte runs on both sides.
# Initial choice for H100/H200, not tuned on the device.
_RUN_BYTES, _RUN_ROWS, _RUN_WARPS = 512, 16, 4
# Tile rows per program group: consecutive programs cover GROUP_M tiles down a column of tiles before
# moving along, like the grouped ordering of Triton's matmul tutorial.
_GROUP_M = 8

# Candidates for the benchmark's tuning pass: (BLOCK_M, BLOCK_N, num_warps).
TUNING_CANDIDATES = [
    (64, 64, 4),
    (64, 64, 8),
    (64, 128, 4),
    (128, 64, 4),
    (64, 128, 8),
    (128, 64, 8),
    (128, 128, 8),
    (32, 128, 4),
]


# ----------------------------------------------------------------------------------------------------
# References (pure PyTorch)

def transpose_copy_ref(src, dst):
    """dst = src.T, bitwise."""
    dst.copy_(src.T)
    return dst


def transpose_add_ref(src, dst):
    """dst += src.T: fp32 add of the two values, one rounding to dst's dtype."""
    dst.copy_((dst.float() + src.T.float()).to(dst.dtype))
    return dst


# ----------------------------------------------------------------------------------------------------
# Triton kernel

@triton.jit
def _transpose_kernel(
    # tensors: src (M, N), dst (N, M)
    src_ptr, dst_ptr,
    # sizes
    M, N,
    # strides in elements: src[i, j] at i*stride_sm + j*stride_sn, dst[j, i] at j*stride_dn + i*stride_dm
    stride_sm, stride_sn, stride_dn, stride_dm,
    # meta-parameters
    ADD: tl.constexpr,        # False: dst = src.T;  True: dst = round(fp32(dst) + fp32(src.T))
    EVEN: tl.constexpr,       # M % BLOCK_M == 0 and N % BLOCK_N == 0: no masks needed
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * grid_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows

    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    src_ptrs = src_ptr + (rm[:, None] * stride_sm + rn[None, :] * stride_sn)  # (BLOCK_M, BLOCK_N)
    dst_ptrs = dst_ptr + (rn[:, None] * stride_dn + rm[None, :] * stride_dm)  # (BLOCK_N, BLOCK_M)
    if EVEN:
        tile = tl.trans(tl.load(src_ptrs))
        if ADD:
            acc = tl.load(dst_ptrs).to(tl.float32) + tile.to(tl.float32)
            tile = acc.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptrs, tile)
    else:
        src_mask = (rm[:, None] < M) & (rn[None, :] < N)
        dst_mask = (rn[:, None] < N) & (rm[None, :] < M)
        tile = tl.trans(tl.load(src_ptrs, mask=src_mask))
        if ADD:
            acc = tl.load(dst_ptrs, mask=dst_mask).to(tl.float32) + tile.to(tl.float32)
            tile = acc.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptrs, tile, mask=dst_mask)


# ----------------------------------------------------------------------------------------------------
# Launchers

def _check(name, src, dst, allowed):
    if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
        raise TypeError(f"{name}: src and dst must be tensors")
    if src.dim() != 2 or dst.dim() != 2:
        raise ValueError(f"{name}: src and dst must be 2-D, got src {tuple(src.shape)} and dst {tuple(dst.shape)}")
    if dst.shape != (src.shape[1], src.shape[0]):
        raise ValueError(f"{name}: shape mismatch: src {tuple(src.shape)}, dst {tuple(dst.shape)}; "
                         f"dst must have src.T's shape {(src.shape[1], src.shape[0])}")
    if src.dtype != dst.dtype:
        raise TypeError(f"{name}: dtype mismatch: src {src.dtype}, dst {dst.dtype}; both must have the same dtype")
    if src.dtype not in allowed:
        raise TypeError(f"{name}: unsupported dtype {src.dtype}; supported: {', '.join(map(str, allowed))}")
    if src.device != dst.device:
        raise ValueError(f"{name}: src is on {src.device} and dst on {dst.device}; both must be on one device")
    check_kernel_device(name, src.device)
    if any(stride == 0 and size > 1 for size, stride in zip(dst.shape, dst.stride())):
        raise ValueError(f"{name}: dst has a zero stride (an expanded view): several of its elements share memory")
    if overlaps(src, dst):
        raise ValueError(f"{name}: src and dst overlap in memory; an in-place transpose is not supported "
                         f"(the check is on the byte ranges they span)")


def _default_config(src, dst):
    """(BLOCK_M, BLOCK_N, num_warps) from which dimension each side is contiguous along."""
    M, N = src.shape
    size = src.element_size()
    src_fast_n = src.stride(1) == 1 and N > 1
    src_fast_m = src.stride(0) == 1 and M > 1
    dst_fast_n = dst.stride(0) == 1 and N > 1
    dst_fast_m = dst.stride(1) == 1 and M > 1
    if src_fast_n and dst_fast_n:
        return (_RUN_ROWS, _RUN_BYTES // size, _RUN_WARPS)
    if src_fast_m and dst_fast_m:
        return (_RUN_BYTES // size, _RUN_ROWS, _RUN_WARPS)
    return _TRANSPOSE_CONFIG[size]


def _launch(src, dst, add, config):
    M, N = src.shape
    if M == 0 or N == 0:
        return
    block_m, block_n, num_warps = config if config is not None else _default_config(src, dst)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _transpose_kernel[grid](
        src, dst, M, N,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        ADD=add, EVEN=(M % block_m == 0 and N % block_n == 0),
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=_GROUP_M, num_warps=num_warps,
    )


def transpose_copy(src, dst, *, config=None):
    """dst = src.T for src (M, N) and dst (N, M) of any strides; bitwise. Returns dst.

    ``config`` = (BLOCK_M, BLOCK_N, num_warps) overrides the tile; only the benchmark uses it.
    """
    _check("transpose_copy", src, dst, COPY_DTYPES)
    raw = _RAW_DTYPE[src.element_size()]
    _launch(src.view(raw), dst.view(raw), add=False, config=config)
    return dst


def transpose_add(src, dst, *, config=None):
    """dst += src.T for src (M, N) and dst (N, M) of any strides, fp32 add and one rounding. Returns dst.

    ``config`` = (BLOCK_M, BLOCK_N, num_warps) overrides the tile; only the benchmark uses it.
    """
    _check("transpose_add", src, dst, ADD_DTYPES)
    _launch(src, dst, add=True, config=config)
    return dst
