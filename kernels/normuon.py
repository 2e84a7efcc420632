"""Fused NorMuon tail: second-moment normalisation, cautious weight decay and the fp32 master update of Muon.

Math, per matrix b of a shard of k matrices (M, N), after Polar Express has produced o (~orthogonal), all in fp32:

    red      = the last dim (each row) when M >= N (tall or square), the first dim (each column) when M < N (wide)
    mean_sq  = mean over red of o^2                         (M, 1) tall / (1, N) wide
    v2      <- lerp(v2, mean_sq, 1 - beta2)                  NorMuon second moment, state, updated in place
    u        = o * rsqrt(max(v2, 1e-10))
    u        = u * (||o||_F / max(||u||_F, 1e-10))           renormalised to o's Frobenius norm, per matrix
    lr_b     = lr * lr_mul[b]                                per-matrix lr (mlp_bank: W_proj^T gets mlp_proj_lr_mul)
    mask     = (u * w >= 0)                                  cautious decay: only where update and weight agree
    w       <- w - lr_b * (u + mask * w * wd)                w: fp32 master, updated in place
    p        = round(w) to the parameter dtype (bf16 round to nearest even, or fp32 copy)

The Frobenius norm of u needs no second pass over the data: within a line (a row of a tall matrix, a column of a
wide one) every element is scaled by the same r = rsqrt(max(v2, 1e-10)), so ||u||_F^2 = sum over lines of
r^2 * (sum of o^2 over the line), and ||o||_F^2 is the sum of the line sums. The result is the same math as the
eager code, with a different fp32 summation order.

Shapes and dtypes: ``o`` (k, M, N) bf16 or fp32, contiguous (Polar Express's output); ``v2`` fp32 (k, M, 1) when
M >= N else (k, 1, N), contiguous; ``master`` fp32 (k, M, N) contiguous; ``lr_mul`` fp32 (k,); ``param_out``
(k, M, N) bf16 or fp32 contiguous (the shard that is all-gathered). Scalars lr, beta2, wd are Python floats,
rounded to fp32 as torch rounds scalar arguments; new values do not recompile (Triton does not specialise floats).

Design (bandwidth, two launches):
- Pass 1 (``_normuon_stats_kernel``), one program per BLOCK_L lines of one matrix: sums o^2 along each line,
  updates v2, and writes the block's two partials (sum of line sums, sum of r^2 * line sums) to a small fp32
  workspace, one slot per program: no atomics, deterministic.
- Pass 2 (``_normuon_apply_kernel``), one program per BLOCK elements of one matrix: reduces its matrix's partials in
  a fixed order (every program of a matrix computes the same bits), then reads o, v2 and w, writes w and p.
Traffic: o is read twice (bf16 2 + 2), w read and written (4 + 4), p written (2): 14 bytes per element.

Used by ``train_gpt.py`` (``Optimizer._muon``) on each rank's shard of attn_bank and mlp_bank on the GPU; on the
CPU the trainer runs :func:`normuon_update_ref` instead (tests/test_normuon.py runs the kernel in Triton's
interpreter).
"""
import torch
import triton
import triton.language as tl

from kernels._checks import check_kernel_device, overlaps

V2_EPS = 1e-10  # floor of the second moment before rsqrt (an all-zero line gets a finite, huge r times 0)
NORM_EPS = 1e-10  # floor of ||u||_F: a zero matrix (shard padding) keeps u = 0 instead of 0 / 0

# (BLOCK_L, BLOCK_A, stats warps, BLOCK, apply warps): pass 1 lines per program and elements per line per loop
# iteration, pass 2 elements per program: 32 x 256 fp32 tiles in pass 1, 4096 elements per program in pass 2
# like kernels.momentum. Checked on one H200 for the 22x3072x768 shards only (`python -m benchmarks --only
# normuon --tune`; the table is in notes/): within a few percent of the fastest candidate; the other shape is not
# tuned.
_DEFAULT_CONFIG = (32, 256, 8, 4096, 8)
TUNING_CANDIDATES = [
    (16, 256, 4, 4096, 8),
    (32, 256, 8, 2048, 8),
    (64, 128, 8, 4096, 16),
    (8, 512, 4, 8192, 16),
]
# Partials reduced per loop iteration in pass 2 (a matrix has ceil(lines / BLOCK_L) of them).
_PARTIAL_BLOCK_MAX = 1024


# ----------------------------------------------------------------------------------------------------
# Reference (pure PyTorch): the same math, in another fp32 summation order; train_gpt.py's CPU path

def normuon_update_ref(o, v2, master, lr_mul, *, lr, beta2, wd, param_dtype=torch.bfloat16):
    """Updates ``v2`` and ``master`` in place (fp32) and returns the parameter shard in ``param_dtype``."""
    o = o.float()
    M, N = o.shape[-2:]
    red = -1 if M >= N else -2
    mean_sq = o.square().mean(dim=red, keepdim=True)
    v2.lerp_(mean_sq, 1 - beta2)
    u = o * v2.clamp_min(V2_EPS).rsqrt()
    norm_o = o.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    norm_u = u.square().sum(dim=(-2, -1), keepdim=True).sqrt().clamp_min(NORM_EPS)
    u = u * (norm_o / norm_u)
    lr_t = lr_mul.view(-1, 1, 1) * lr
    mask = (u * master) >= 0
    master.sub_(lr_t * (u + mask * master * wd))
    return master.to(param_dtype)


# ----------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _normuon_stats_kernel(
    # tensors
    o_ptr,          # (k, M, N) bf16/fp32, contiguous
    v2_ptr,         # (k, L) fp32, contiguous; updated in place
    partial_ptr,    # (k, blocks, 2) fp32; receives (sum of o^2, sum of r^2 * line sums) per program
    # scalars
    n_lines,        # L: M (tall/square) or N (wide)
    n_along,        # A: elements summed per line (N tall, M wide)
    stride_line,    # element stride between lines (N tall, 1 wide)
    stride_along,   # element stride along a line (1 tall, N wide)
    n_along_f,      # A as fp32 (the mean's divisor)
    blocks,         # ceil(L / BLOCK_L), programs per matrix
    weight,         # fp32 lerp weight 1 - beta2
    # meta-parameters
    V2_EPS: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_A: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = (pid // blocks).to(tl.int64)
    blk = pid % blocks
    lines = blk * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = lines < n_lines
    base = o_ptr + batch * n_lines * n_along + lines.to(tl.int64)[:, None] * stride_line
    acc = tl.zeros((BLOCK_L, BLOCK_A), dtype=tl.float32)
    for start in range(0, n_along, BLOCK_A):
        along = start + tl.arange(0, BLOCK_A)
        m = lmask[:, None] & (along < n_along)[None, :]
        x = tl.load(base + along.to(tl.int64)[None, :] * stride_along, mask=m, other=0.0).to(tl.float32)
        acc += x * x
    line_sq = tl.sum(acc, axis=1)                       # (BLOCK_L,) sum of o^2 along each line
    mean_sq = tl.div_rn(line_sq, n_along_f)
    v_ptrs = v2_ptr + batch * n_lines + lines
    v = tl.load(v_ptrs, mask=lmask, other=0.0)
    # torch's lerp with weight c = 1 - beta2 < 0.5: v + c * (mean_sq - v)
    v = v + weight * (mean_sq - v)
    tl.store(v_ptrs, v, mask=lmask)
    r2 = tl.div_rn(1.0, tl.maximum(v, V2_EPS))           # r^2 = 1 / max(v2, eps)
    tl.store(partial_ptr + pid * 2, tl.sum(line_sq, axis=0))
    tl.store(partial_ptr + pid * 2 + 1, tl.sum(tl.where(lmask, line_sq * r2, 0.0), axis=0))


@triton.jit
def _normuon_apply_kernel(
    # tensors
    o_ptr,          # (k, M, N) bf16/fp32, contiguous
    v2_ptr,         # (k, L) fp32 from pass 1
    partial_ptr,    # (k, blocks, 2) fp32 from pass 1
    master_ptr,     # (k, M, N) fp32, contiguous; updated in place
    param_ptr,      # (k, M, N) bf16/fp32, contiguous; receives round(master)
    lr_mul_ptr,     # (k,) fp32 per-matrix lr multiplier
    # scalars
    numel,          # M * N
    n_cols,         # N
    n_lines,        # L
    blocks,         # pass-1 programs per matrix
    chunks,         # pass-2 programs per matrix
    lr,             # fp32 base lr
    wd,             # fp32 cautious decay coefficient
    # meta-parameters
    TALL: tl.constexpr,             # lines are rows (M >= N), else columns
    V2_EPS: tl.constexpr, NORM_EPS: tl.constexpr,
    BLOCK: tl.constexpr, PARTIAL_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = (pid // chunks).to(tl.int64)
    chunk = (pid % chunks).to(tl.int64)

    # Fixed-order reduction of this matrix's partials: the same bits in every program and every run.
    acc_o = tl.zeros((PARTIAL_BLOCK,), dtype=tl.float32)
    acc_u = tl.zeros((PARTIAL_BLOCK,), dtype=tl.float32)
    for start in range(0, blocks, PARTIAL_BLOCK):
        idx = start + tl.arange(0, PARTIAL_BLOCK)
        pm = idx < blocks
        acc_o += tl.load(partial_ptr + (batch * blocks + idx) * 2, mask=pm, other=0.0)
        acc_u += tl.load(partial_ptr + (batch * blocks + idx) * 2 + 1, mask=pm, other=0.0)
    norm_o = tl.sqrt_rn(tl.sum(acc_o, axis=0))
    norm_u = tl.maximum(tl.sqrt_rn(tl.sum(acc_u, axis=0)), NORM_EPS)
    ratio = tl.div_rn(norm_o, norm_u)
    lr_b = tl.load(lr_mul_ptr + batch) * lr

    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < numel
    if TALL:
        line = offs // n_cols
    else:
        line = offs % n_cols
    v = tl.load(v2_ptr + batch * n_lines + line, mask=mask, other=1.0)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.maximum(v, V2_EPS)))
    o = tl.load(o_ptr + batch * numel + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(master_ptr + batch * numel + offs, mask=mask, other=0.0)
    u = (o * r) * ratio
    decay = tl.where(u * w >= 0, w * wd, 0.0)
    w = w - lr_b * (u + decay)
    tl.store(master_ptr + batch * numel + offs, w, mask=mask)
    tl.store(param_ptr + batch * numel + offs, w.to(param_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launcher

def _check(o, v2, master, lr_mul, param_out, scalars):
    name = "normuon_update"
    if o.dim() != 3:
        raise ValueError(f"{name}: o must be 3-D (k, M, N), got shape {tuple(o.shape)}")
    k, M, N = o.shape
    v2_shape = (k, M, 1) if M >= N else (k, 1, N)
    for what, t, shape, dtypes in (("o", o, o.shape, (torch.bfloat16, torch.float32)),
                                   ("v2", v2, v2_shape, (torch.float32,)),
                                   ("master", master, o.shape, (torch.float32,)),
                                   ("lr_mul", lr_mul, (k,), (torch.float32,)),
                                   ("param_out", param_out, o.shape, (torch.bfloat16, torch.float32))):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: {what} must have shape {tuple(shape)} for o of shape {tuple(o.shape)}, "
                             f"got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: {what} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
        if t.device != o.device:
            raise ValueError(f"{name}: {what} is on {t.device}, o on {o.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be contiguous, got strides {t.stride()}")
    check_kernel_device(name, o.device)
    written = (("v2", v2), ("master", master), ("param_out", param_out))
    for i, (a_name, a) in enumerate(written):
        for b_name, b in written[i + 1:] + (("o", o), ("lr_mul", lr_mul)):
            if overlaps(a, b):
                raise ValueError(f"{name}: {a_name} and {b_name} overlap in memory")
    for key, value in scalars.items():
        if not isinstance(value, (float, int)) or isinstance(value, bool):
            raise TypeError(f"{name}: {key} must be a Python float, got {type(value).__name__}")


def normuon_update(o, v2, master, lr_mul, param_out, *, lr, beta2, wd, config=None):
    """One NorMuon tail step (module docstring): updates ``v2`` and ``master`` in place, writes ``param_out``.

    o: (k, M, N) bf16/fp32, Polar Express's output.   v2: fp32 (k, M, 1) if M >= N else (k, 1, N), state.
    master: fp32 (k, M, N), state.   lr_mul: fp32 (k,), per-matrix multiplier of ``lr``.
    param_out: (k, M, N) bf16/fp32, receives round(master).   All contiguous, one device.
    lr, beta2, wd: Python floats.   config: (BLOCK_L, BLOCK_A, warps, BLOCK, warps); only the benchmark sets it.
    Returns param_out.
    """
    _check(o, v2, master, lr_mul, param_out, dict(lr=lr, beta2=beta2, wd=wd))
    if o.numel() == 0:
        return param_out
    block_l, block_a, stats_warps, block, apply_warps = config if config is not None else _DEFAULT_CONFIG
    k, M, N = o.shape
    tall = M >= N
    n_lines, n_along = (M, N) if tall else (N, M)
    stride_line, stride_along = (N, 1) if tall else (1, N)
    blocks = triton.cdiv(n_lines, block_l)
    partials = torch.empty((k, blocks, 2), dtype=torch.float32, device=o.device)
    _normuon_stats_kernel[(k * blocks,)](
        o, v2, partials,
        n_lines, n_along, stride_line, stride_along, float(n_along), blocks, float(1 - beta2),
        V2_EPS=V2_EPS, BLOCK_L=block_l, BLOCK_A=min(block_a, triton.next_power_of_2(n_along)),
        num_warps=stats_warps,
    )
    numel = M * N
    chunks = triton.cdiv(numel, block)
    _normuon_apply_kernel[(k * chunks,)](
        o, v2, partials, master, param_out, lr_mul,
        numel, N, n_lines, blocks, chunks, float(lr), float(wd),
        TALL=tall, V2_EPS=V2_EPS, NORM_EPS=NORM_EPS,
        BLOCK=block, PARTIAL_BLOCK=min(triton.next_power_of_2(blocks), _PARTIAL_BLOCK_MAX),
        num_warps=apply_warps,
    )
    return param_out
