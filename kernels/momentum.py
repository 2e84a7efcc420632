"""Fused Nesterov momentum + Frobenius normalization: the input of Polar Express (Muon).

Math, per step, elementwise in fp32 (``mu`` is the momentum, ``g`` the gradient, ``buf`` the fp32 state):

    buf <- mu * buf + (1 - mu) * g            (momentum buffer, updated in place)
    u    = (1 - mu) * g + mu * buf            (Nesterov look-ahead, with the new buf)
    b    = bf16(u)                            (round to nearest even)
    X    = bf16( b / (||b||_F * 1.02 + 1e-6) )  per matrix, returned in bf16

The norm is the Frobenius norm of the bf16-rounded values ``b`` (squares summed in fp32), not of the fp32
``u``: X is then exactly what Polar Express would compute from ``b`` with its own normalization, and
Polar Express can take it with ``normalized=True``. The divisor ``sqrt(sum b^2) * 1.02 + 1e-6`` is
computed in fp32 (correctly rounded square root), and ``b / divisor`` is a correctly rounded fp32 division
followed by one rounding to bf16. Since ||X||_2 <= ||X||_F, dividing by 1.02 x the Frobenius norm puts
every singular value below 1/1.02: the 2e-2 safety margin the Polar Express coefficients were computed
for (kernels/polar_express.py's docstring; Amsel et al. 2025, arXiv 2505.16932) absorbs the bf16 rounding
of X. 1e-6 keeps an all-zero update at X = 0 instead of 0/0.

Shapes: ``grad`` is (M, N) or (B, M, N) with any strides, bf16 or fp32; ``buf`` is fp32 of the same
shape and contiguous (it is optimizer state, allocated by us); X is bf16, contiguous, same shape.
In ``train_gpt.py`` the Muon step calls this once per batch of same-shape matrices, e.g. the per-GPU
attention batch (5, 768, 768) and MLP batch (3, 3072, 768), then feeds X to Polar Express.

The momentum ``mu`` changes every step (0.85 -> 0.95 -> 0.85) and must cause neither a recompilation nor
a host sync. It is a Python float, passed to the kernel as a plain fp32 scalar argument. Triton does not
specialize on the value of float arguments: its argument specializer types every Python float as "fp32"
with no specialization key (checked by calling ``native_specialize_impl`` under Triton 3.9, and read in
``handle_float_type`` of triton-lang/triton ``python/src/specialize.cc``, the native specializer that 3.6
also uses; not executed under 3.6 here), so a new value reuses the compiled kernel. Integers *are*
specialized (1 becomes a constant), so the launcher converts with ``float()``. The kernel sees ``mu``
rounded to fp32.

Design (bandwidth): the minimum traffic is 12 bytes per element (g 2, buf 4 + 4, X 2 for bf16 g).
- Pass 1, one program per chunk of BLOCK elements of one matrix: updates buf, writes b = bf16(u) into
  ``out`` and the chunk's sum of b^2 into a small fp32 workspace (one slot per chunk: no atomics).
- Pass 2, one program per chunk of SCALE_BLOCK elements: sums its matrix's partials in a fixed order
  (every program of a matrix computes the same bits), and rescales ``out`` in place. The bf16 ``out``
  of (3, 3072, 768) is 14 MB, within the 50-60 MB L2 of H100/H200, so pass 2 mostly hits L2; it visits
  chunks in reverse order so the most recently written (most likely still cached) lines go first, and
  pass 1 marks its streamed loads evict-first so they do not push ``out`` out of L2.
Both passes are deterministic: bitwise reproducible from run to run.
"""

import torch
import triton
import triton.language as tl

from kernels._checks import check_kernel_device, overlaps

# Polar Express's safety factor (kernels/polar_express.py's docstring) and the epsilon that keeps 0 / 0 away.
NORM_SAFETY = 1.02
NORM_EPS = 1e-6

# (BLOCK, num_warps, SCALE_BLOCK, SCALE_WARPS): pass 1 chunk and warps, pass 2 chunk and warps.
# With 4 elements per thread in pass 1, bf16 and fp32 tensors get the same register layout; with 8 or more,
# Triton (checked with 3.9, sm_90) gives bf16 8 elements per thread and fp32 4 and converts the updated buf
# between the two layouts through shared memory. Pass 2 takes larger chunks so that fewer programs repeat
# the reduction of the (L2-resident) partials.
# Tuned on one H200 (`python -m benchmarks --only momentum --tune`, (3, 3072, 768) bf16; the candidates' times
# are in notes/measurements.md).
_DEFAULT_CONFIG = (4096, 8, 8192, 8)
# Candidates for the benchmark's tuning pass (the last two have 8 elements per thread in pass 1).
TUNING_CANDIDATES = [
    (2048, 16, 16384, 16),
    (1024, 8, 16384, 16),
    (4096, 32, 16384, 16),
    (512, 4, 8192, 8),
    (2048, 16, 8192, 8),
    (2048, 16, 32768, 16),
    (4096, 8, 8192, 8),
    (8192, 16, 16384, 16),
]
# Partials reduced per loop iteration in pass 2 (a matrix has ceil(M*N / BLOCK) of them).
_PARTIAL_BLOCK_MAX = 1024


# ----------------------------------------------------------------------------------------------------
# Reference (pure PyTorch)

def _mu_for(momentum):
    """mu as the kernel sees it: the float rounded to fp32."""
    return float(torch.tensor(float(momentum), dtype=torch.float32))


def nesterov_momentum_ref(grad, buf, momentum, out_dtype=torch.bfloat16):
    """Reference: updates ``buf`` in place and returns X (see the module docstring for the math).

    Computes in ``buf``'s dtype: fp32 for the same arithmetic as the kernel, float64 (pass a float64
    copy of buf) for an error-free reference. ``out_dtype=torch.float64`` skips the final rounding of X.
    """
    mu = _mu_for(momentum)
    g = grad.to(buf.dtype)
    step = (1 - mu) * g
    buf.copy_(mu * buf + step)
    u = step + mu * buf
    b = u.to(torch.bfloat16).to(buf.dtype)
    norm = b.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    return (b / (norm * NORM_SAFETY + NORM_EPS)).to(out_dtype)


# ----------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _momentum_update_kernel(
    # tensors
    grad_ptr,       # (B, M, N) bf16/fp32, strides below
    buf_ptr,        # (B, M, N) fp32, contiguous; updated in place
    out_ptr,        # (B, M, N) bf16, contiguous; receives bf16(u)
    partial_ptr,    # (B * chunks,) fp32; receives sum(bf16(u)^2) per chunk
    # scalars
    mu,             # fp32 momentum
    numel,          # M * N, elements per matrix
    n_cols,         # N
    chunks,         # ceil(numel / BLOCK), programs per matrix
    # grad strides in elements
    stride_gb, stride_gm, stride_gn,
    # meta-parameters
    GRAD_DENSE: tl.constexpr,   # each grad matrix is row-major contiguous: offset = b*stride_gb + e
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = (pid // chunks).to(tl.int64)
    chunk = (pid % chunks).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)   # flat index inside the matrix
    mask = offs < numel
    dense = batch * numel + offs
    if GRAD_DENSE:
        g_offs = batch * stride_gb + offs
    else:
        row = offs // n_cols
        g_offs = batch * stride_gb + row * stride_gm + (offs - row * n_cols) * stride_gn

    # g and buf are streamed once: evict them first so that `out` stays in L2 for pass 2.
    g = tl.load(grad_ptr + g_offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    buf = tl.load(buf_ptr + dense, mask=mask, other=0.0, eviction_policy="evict_first")
    step = (1.0 - mu) * g
    buf = mu * buf + step
    u = step + mu * buf
    b = u.to(tl.bfloat16)
    tl.store(buf_ptr + dense, buf, mask=mask)
    tl.store(out_ptr + dense, b, mask=mask)
    bf = b.to(tl.float32)   # masked lanes hold 0 and add nothing
    tl.store(partial_ptr + pid, tl.sum(bf * bf, axis=0))


@triton.jit
def _momentum_scale_kernel(
    # tensors
    out_ptr,        # (B, M, N) bf16, contiguous; bf16(u) in, X out
    partial_ptr,    # (B * chunks,) fp32 from pass 1
    # scalars
    numel,          # M * N
    chunks,         # pass-1 chunks (partials) per matrix
    scale_chunks,   # pass-2 chunks per matrix
    n_programs,     # B * scale_chunks
    # meta-parameters
    SAFETY: tl.constexpr, EPS: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, PARTIAL_BLOCK: tl.constexpr,
):
    # Reverse order: the chunks pass 1 wrote last are the likeliest to still be in L2.
    pid = n_programs - 1 - tl.program_id(0)
    batch = (pid // scale_chunks).to(tl.int64)
    chunk = (pid % scale_chunks).to(tl.int64)

    # Fixed-order reduction of this matrix's partials: the same bits in every program and every run.
    acc = tl.zeros((PARTIAL_BLOCK,), dtype=tl.float32)
    for start in range(0, chunks, PARTIAL_BLOCK):
        idx = start + tl.arange(0, PARTIAL_BLOCK)
        acc += tl.load(partial_ptr + batch * chunks + idx, mask=idx < chunks, other=0.0)
    denom = tl.sqrt_rn(tl.sum(acc, axis=0)) * SAFETY + EPS

    offs = chunk * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK).to(tl.int64)
    mask = offs < numel
    ptrs = out_ptr + batch * numel + offs
    b = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(ptrs, tl.div_rn(b, denom).to(tl.bfloat16), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launcher

def _check(grad, buf, momentum, out):
    if grad.dim() not in (2, 3):
        raise ValueError(f"nesterov_momentum: grad must be 2-D (M, N) or 3-D (B, M, N), got shape {tuple(grad.shape)}")
    if grad.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"nesterov_momentum: grad must be bf16 or fp32, got {grad.dtype}")
    if buf.shape != grad.shape:
        raise ValueError(f"nesterov_momentum: buf shape {tuple(buf.shape)} differs from grad shape {tuple(grad.shape)}")
    if buf.dtype != torch.float32:
        raise TypeError(f"nesterov_momentum: buf (momentum state) must be fp32, got {buf.dtype}")
    if not buf.is_contiguous():
        raise ValueError(f"nesterov_momentum: buf (momentum state) must be contiguous, got strides {buf.stride()}")
    if buf.device != grad.device:
        raise ValueError(f"nesterov_momentum: grad is on {grad.device} and buf on {buf.device}")
    check_kernel_device("nesterov_momentum", grad.device)
    if overlaps(grad, buf):
        raise ValueError("nesterov_momentum: grad and buf overlap in memory")
    if not isinstance(momentum, (float, int)) or isinstance(momentum, bool):
        raise TypeError(f"nesterov_momentum: momentum must be a Python float, got {type(momentum).__name__}")
    if out is not None:
        if out.shape != grad.shape:
            raise ValueError(f"nesterov_momentum: out shape {tuple(out.shape)} differs from grad shape {tuple(grad.shape)}")
        if out.dtype != torch.bfloat16:
            raise TypeError(f"nesterov_momentum: out must be bf16, got {out.dtype}")
        if not out.is_contiguous():
            raise ValueError(f"nesterov_momentum: out must be contiguous, got strides {out.stride()}")
        if out.device != grad.device:
            raise ValueError(f"nesterov_momentum: out is on {out.device}, grad on {grad.device}")
        if overlaps(out, grad) or overlaps(out, buf):
            raise ValueError("nesterov_momentum: out overlaps grad or buf in memory")


def nesterov_momentum(grad, buf, momentum, out=None, *, config=None):
    """Updates ``buf`` in place and returns X = bf16(u) / (||bf16(u)||_F * 1.02 + 1e-6) per matrix (bf16).

    grad: (M, N) or (B, M, N), bf16 or fp32, any strides.
    buf: fp32, same shape, contiguous (momentum state).
    momentum: Python float (rounded to fp32; a new value does not recompile).
    out: optional preallocated bf16 contiguous tensor of grad's shape; returned.
    config: (BLOCK, num_warps, SCALE_BLOCK, SCALE_WARPS) overrides the launch; only the benchmark uses it.
    """
    _check(grad, buf, momentum, out)
    if out is None:
        out = torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)
    if grad.numel() == 0:
        return out
    block, num_warps, scale_block, scale_warps = config if config is not None else _DEFAULT_CONFIG

    g3 = grad if grad.dim() == 3 else grad.unsqueeze(0)
    batch, rows, cols = g3.shape
    numel = rows * cols
    gb, gm, gn = g3.stride()
    grad_dense = (rows == 1 or gm == cols) and (cols == 1 or gn == 1)
    chunks = triton.cdiv(numel, block)
    partials = torch.empty(batch * chunks, dtype=torch.float32, device=grad.device)

    _momentum_update_kernel[(batch * chunks,)](
        g3, buf, out, partials,
        float(momentum), numel, cols, chunks,
        gb, gm, gn,
        GRAD_DENSE=grad_dense, BLOCK=block, num_warps=num_warps,
    )
    scale_chunks = triton.cdiv(numel, scale_block)
    n_programs = batch * scale_chunks
    _momentum_scale_kernel[(n_programs,)](
        out, partials, numel, chunks, scale_chunks, n_programs,
        SAFETY=NORM_SAFETY, EPS=NORM_EPS, SCALE_BLOCK=scale_block,
        PARTIAL_BLOCK=min(triton.next_power_of_2(chunks), _PARTIAL_BLOCK_MAX), num_warps=scale_warps,
    )
    return out
