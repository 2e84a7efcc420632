"""Symmetric Gram products and Polar Express orthogonalization for Muon.

Muon replaces each 2-D update ``G`` (momentum) by the nearest semi-orthogonal matrix, approximated by Polar
Express (Amsel et al. 2025, arXiv 2505.16932): an odd matrix polynomial applied ``steps`` times,

    X0 = G / (||G||_F * 1.02 + 1e-6)                 spectral norm of X0 below 1 (Frobenius bound, 2% margin)
    A  = X X^T                                       (rows <= cols, "wide")   or  X^T X  (rows > cols, "tall")
    B  = b A + c A A                                 A symmetric, so A A = A A^T: one Gram-like kernel
    X <- a X + B X   (wide)                          or  a X + X B  (tall)

so that every singular value s of X goes through p(s) = a s + b s^3 + c s^5. The five (a, b, c) triples below
were computed for 5 iterations, safety factor 2e-2 and cushion 2; they map every s in [1e-3, 1] into a band
around 1 (the tests derive that band from the polynomials). The Gram matrix is min(rows, cols)^2, and the
tall path needs no transpose of the input (X^T X is X X^T of the transposed *view*: only strides change).

Public API (2-D (M, N) or batched 3-D (B, M, N) inputs of any strides, a transposed view included):

    xxt(a, out=None)                      a @ a.mT                     (..., M, M), K = N
    xtx(a, out=None)                      a.mT @ a                     (..., N, N), K = M
    ba_plus_caa(a, alpha, beta, out=None) alpha * a @ a.mT + beta * a  a symmetric (..., N, N)
    polar_express(g, steps=5, normalized=False)   orthogonalized g, same shape and dtype

Each has a pure-PyTorch reference (``xxt_ref``, ``xtx_ref``, ``ba_plus_caa_ref``, ``polar_express_ref``) that
computes in the input's dtype exactly like the reference speedrun (torch.bmm / baddbmm, a bf16 norm), and
gives the float64 reference of the tests when fed float64.

Exact symmetry: a Gram output is computed only for the tiles on and above the diagonal; each such tile is
written twice, as is and transposed into the mirror position, from the same rounded values, so
``out[..., i, j] == out[..., j, i]`` bitwise (inside a diagonal tile the upper triangle is the source of
both halves). ``ba_plus_caa`` therefore reads only the upper tiles of ``beta * a``: ``a`` must be symmetric.
The work is half of a full matmul; the benchmark counts the full 2*B*M*M*K FLOPs as useful, so the halving
shows up as a speedup over cuBLAS and as more TFLOP/s than the hardware does.

Dtype policy: bf16 (production) and fp16 multiply on tensor cores with fp32 accumulation and an fp32
epilogue (alpha * acc + beta * addend), rounded once to the output dtype. fp32 inputs are multiplied with
exact IEEE fp32 dots (``input_precision="ieee"``, no TF32) summed per K block, so the Triton interpreter
on the CPU and the GPU both agree with float64 to fp32 rounding; that path is for tests, not speed.
Outputs have the input's dtype.
``polar_express`` keeps X in the input's dtype between iterations (bf16 in production), like the reference;
its normalization takes the norm in fp32 and rounds X0 once: X0 = dtype(g / (||g||_F * 1.02 + 1e-6)).
``normalized=True`` skips it because ``kernels.momentum.nesterov_momentum`` already produced that X0.

Kernels:
- ``_gram_kernel``: out = alpha * X X^T (+ beta * D), one program per upper-triangular square tile
  (batch outermost), the tile index t -> (i <= j) inverted in closed form; no table, no host sync.
  ``xtx`` is this kernel on the transposed view, ``ba_plus_caa`` adds the ``beta * a`` epilogue.
- ``_gemm_epilogue_kernel``: out = alpha * P Q + beta * C (batched, any strides): the X update of
  Polar Express, ``a X + B X`` (P = B, Q = X) or ``a X + X B`` (P = X, Q = B), with the scale in fp32.
Both load the K loop with 32-bit tile-local offsets on 64-bit per-matrix and per-tile base pointers.

Where train_gpt.py uses it: the Muon step calls ``polar_express(x, normalized=True)`` on the bf16 output of
``nesterov_momentum`` for each group of same-shaped matrices: per GPU in the 8-GPU layout, the attention
weights (5, 768, 768) (wide path) and the MLP weights (3, 3072, 768) (tall path).

Speed (H200; design targets, measured by ``python -m kernels.bench``): the Gram calls launch few CTAs
(a (4, 768, 3072) X X^T has 84 upper tiles of 128 x 128 for 132 SMs), so the default tile is 64 x 64 when
128 x 128 tiles would not fill the SMs. Launch configurations are initial choices for H100/H200, not yet
tuned on the device; ``TUNING_CANDIDATES`` are what the benchmark's tuning pass tries.
"""
import functools
import math
import os

import torch
import triton
import triton.language as tl

# (a, b, c) of p(s) = a s + b s^3 + c s^5 per iteration: Amsel et al. 2025, computed for 5 iterations,
# safety factor 2e-2, cushion 2 (the values of the reference speedrun).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# X0 = G / (||G||_F * NORM_MARGIN + NORM_EPS): ||X0||_2 <= ||X0||_F < 1 / 1.02, and zero matrices stay zero.
NORM_MARGIN = 1 + 2e-2
NORM_EPS = 1e-6

DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch configurations: dicts of BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages. Gram kernels need square
# tiles (BLOCK_M == BLOCK_N: a tile and its mirror have the same shape).
# Initial choice for H100/H200, not yet tuned on the device: 128 x 128 x 64 tiles, two warpgroups, 3 stages
# (96 KB of operand buffers, two CTAs fit in an SM's 228 KB) when the grid fills the SMs...
_BIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
# ...and 64 x 64 x 64 tiles (4 warps, 4 stages, 64 KB: three CTAs per SM) when 128 x 128 tiles would leave
# SMs idle: a (4, 768, 3072) X X^T is 84 large tiles for 132 SMs, or 312 small ones (at most 3 per SM, so
# 25% less time on the busiest SM than one large tile if the small tiles keep the tensor cores as busy).
_SMALL = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
# The X update has rectangular output tiles: 64 x 128 when 128 x 128 would leave SMs idle.
# Initial choice for H100/H200, not yet tuned on the device.
_GEMM_SMALL = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
# fp32 inputs use FMA dots (exact IEEE fp32, tests only): fp32 operand buffers are twice as large, so smaller
# tiles and 2 stages stay within shared memory. Chosen to compile on H100/H200, not for speed.
_FP32 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)

# Candidates for the benchmark's tuning pass over the Gram kernels (square tiles, <= 8).
TUNING_CANDIDATES = (
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4),
)
# SM count assumed when there is no GPU (the interpreter): H100 SXM and H200 both have 132.
_DEFAULT_SMS = 132


# ----------------------------------------------------------------------------------------------------
# References (pure PyTorch, in the input's dtype; float64 inputs give the tests' references)

def xxt_ref(a):
    """a @ a.mT for a (M, K) or (B, M, K)."""
    return a @ a.mT


def xtx_ref(a):
    """a.mT @ a for a (K, N) or (B, K, N)."""
    return a.mT @ a


def _addmm_ref(c, p, q, alpha, beta):
    """alpha * p @ q + beta * c as one addmm / baddbmm: cuBLAS scales in fp32 and rounds once."""
    if c.dim() == 2:
        return torch.addmm(c, p, q, beta=beta, alpha=alpha)
    return torch.baddbmm(c, p, q, beta=beta, alpha=alpha)


def ba_plus_caa_ref(a, alpha, beta):
    """alpha * a @ a.mT + beta * a (a symmetric), as one baddbmm / addmm."""
    return _addmm_ref(a, a, a.mT, alpha, beta)


def polar_express_ref(g, steps=5, normalized=False):
    """The reference speedrun's Polar Express, in g's dtype (pass bf16 to match it; float64 for tests)."""
    x = g
    if not normalized:
        x = x / (x.norm(dim=(-2, -1), keepdim=True) * NORM_MARGIN + NORM_EPS)
    tall = g.size(-2) > g.size(-1)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        if tall:
            x = _addmm_ref(x, x, ba_plus_caa_ref(xtx_ref(x), c, b), 1.0, a)  # a X + X B
        else:
            x = _addmm_ref(x, ba_plus_caa_ref(xxt_ref(x), c, b), x, 1.0, a)  # a X + B X
    return x


# ----------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _dot_accumulate(a, b, acc, EXACT_FP32: tl.constexpr):
    """acc + a @ b in fp32. 16-bit inputs: tensor cores accumulating into acc. fp32 inputs: an exact IEEE
    fp32 dot (no TF32) of one K block added to acc, a two-level sum whose rounding error grows with
    BLOCK_K + K / BLOCK_K instead of K (fp32 is the test path: K = 50304 must stay within 2x of cuBLAS)."""
    if EXACT_FP32:
        acc = acc + tl.dot(a, b, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gram_kernel(
    # operand X, (batch, N, K): the Gram matrix is X X^T; a transposed view gives X^T X
    x_ptr, stride_xb, stride_xn, stride_xk,
    # addend D, (batch, N, N), read only when HAS_ADDEND (upper tiles only: D must be symmetric)
    d_ptr, stride_db, stride_dm, stride_dn,
    # output, (batch, N, N)
    out_ptr, stride_ob, stride_om, stride_on,
    # sizes and epilogue scalars: out = alpha * X X^T + beta * D
    N, K, alpha, beta,
    # meta-parameters
    HAS_ADDEND: tl.constexpr,
    MASKED: tl.constexpr,          # N % BLOCK or K % BLOCK_K != 0: masked loads
    EXACT_FP32: tl.constexpr,      # fp32 inputs: IEEE fp32 dots, summed per K block (see _dot_accumulate)
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program -> (batch, upper tile). Tiles of one matrix are numbered column by column:
    # t = j (j + 1) / 2 + i with 0 <= i <= j < nb, so j = floor((sqrt(8 t + 1) - 1) / 2). The fp32 square root
    # can be off by one near perfect squares; the two integer corrections make j exact.
    pid = tl.program_id(0)
    nb = tl.cdiv(N, BLOCK)
    tiles = nb * (nb + 1) // 2
    batch = pid // tiles
    t = pid - batch * tiles
    j = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    j = tl.where(j * (j + 1) // 2 > t, j - 1, j)
    j = tl.where((j + 1) * (j + 2) // 2 <= t, j + 1, j)
    i = t - j * (j + 1) // 2

    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    rows_i = i * BLOCK + offs  # global row (and column) indices of the two row blocks
    rows_j = j * BLOCK + offs
    x_batch = x_ptr + batch.to(tl.int64) * stride_xb
    # Both operands are loaded as (BLOCK, BLOCK_K) tiles of X (coalesced along X's contiguous dimension,
    # whichever it is); the right operand is transposed in registers/shared memory for the dot.
    xi_ptrs = x_batch + (i * BLOCK).to(tl.int64) * stride_xn + (offs[:, None] * stride_xn + offs_k[None, :] * stride_xk)
    xj_ptrs = x_batch + (j * BLOCK).to(tl.int64) * stride_xn + (offs[:, None] * stride_xn + offs_k[None, :] * stride_xk)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if MASKED:
            k_ok = offs_k[None, :] < K - k * BLOCK_K
            xi = tl.load(xi_ptrs, mask=(rows_i[:, None] < N) & k_ok, other=0.0)
            xj = tl.load(xj_ptrs, mask=(rows_j[:, None] < N) & k_ok, other=0.0)
        else:
            xi = tl.load(xi_ptrs)
            xj = tl.load(xj_ptrs)
        acc = _dot_accumulate(xi, tl.trans(xj), acc, EXACT_FP32)
        xi_ptrs += BLOCK_K * stride_xk
        xj_ptrs += BLOCK_K * stride_xk

    # fp32 epilogue, one rounding; the mirror tile is the transpose of the same rounded values.
    val = acc * alpha
    if HAS_ADDEND:
        d_tile = (d_ptr + batch.to(tl.int64) * stride_db + (i * BLOCK).to(tl.int64) * stride_dm
                  + (j * BLOCK).to(tl.int64) * stride_dn)
        d = tl.load(d_tile + (offs[:, None] * stride_dm + offs[None, :] * stride_dn),
                    mask=(rows_i[:, None] < N) & (rows_j[None, :] < N), other=0.0)
        val += beta * d.to(tl.float32)
    val = val.to(out_ptr.dtype.element_ty)
    out_batch = out_ptr + batch.to(tl.int64) * stride_ob
    # Upper part (row <= col) at (i, j); rows_i <= rows_j < N implies rows_i < N.
    upper_ptrs = (out_batch + (i * BLOCK).to(tl.int64) * stride_om + (j * BLOCK).to(tl.int64) * stride_on
                  + (offs[:, None] * stride_om + offs[None, :] * stride_on))
    tl.store(upper_ptrs, val, mask=(rows_i[:, None] <= rows_j[None, :]) & (rows_j[None, :] < N))
    # Strictly lower part (row > col) at (j, i) from the transposed values.
    lower_ptrs = (out_batch + (j * BLOCK).to(tl.int64) * stride_om + (i * BLOCK).to(tl.int64) * stride_on
                  + (offs[:, None] * stride_om + offs[None, :] * stride_on))
    tl.store(lower_ptrs, tl.trans(val), mask=(rows_j[:, None] > rows_i[None, :]) & (rows_j[:, None] < N))


@triton.jit
def _gemm_epilogue_kernel(
    # left operand P, (batch, M, K)
    p_ptr, stride_pb, stride_pm, stride_pk,
    # right operand Q, (batch, K, N)
    q_ptr, stride_qb, stride_qk, stride_qn,
    # addend C, (batch, M, N)
    c_ptr, stride_cb, stride_cm, stride_cn,
    # output, (batch, M, N); must not overlap P, Q or C
    out_ptr, stride_ob, stride_om, stride_on,
    # sizes and epilogue scalars: out = alpha * P Q + beta * C
    M, N, K, alpha, beta,
    # meta-parameters
    MASKED: tl.constexpr,          # M % BLOCK_M, N % BLOCK_N or K % BLOCK_K != 0: masked loads
    EXACT_FP32: tl.constexpr,      # fp32 inputs: IEEE fp32 dots, summed per K block (see _dot_accumulate)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program -> (batch, tile row, tile column), batch outermost: one matrix (at most a few MB) is
    # L2-resident while its tiles run, so no grouped ordering is needed.
    pid = tl.program_id(0)
    nbm = tl.cdiv(M, BLOCK_M)
    nbn = tl.cdiv(N, BLOCK_N)
    batch = pid // (nbm * nbn)
    t = pid - batch * (nbm * nbn)
    pid_m = t // nbn
    pid_n = t - pid_m * nbn

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = pid_m * BLOCK_M + offs_m
    cols = pid_n * BLOCK_N + offs_n
    p_ptrs = (p_ptr + batch.to(tl.int64) * stride_pb + (pid_m * BLOCK_M).to(tl.int64) * stride_pm
              + (offs_m[:, None] * stride_pm + offs_k[None, :] * stride_pk))
    q_ptrs = (q_ptr + batch.to(tl.int64) * stride_qb + (pid_n * BLOCK_N).to(tl.int64) * stride_qn
              + (offs_k[:, None] * stride_qk + offs_n[None, :] * stride_qn))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if MASKED:
            k_rem = K - k * BLOCK_K
            p = tl.load(p_ptrs, mask=(rows[:, None] < M) & (offs_k[None, :] < k_rem), other=0.0)
            q = tl.load(q_ptrs, mask=(offs_k[:, None] < k_rem) & (cols[None, :] < N), other=0.0)
        else:
            p = tl.load(p_ptrs)
            q = tl.load(q_ptrs)
        acc = _dot_accumulate(p, q, acc, EXACT_FP32)
        p_ptrs += BLOCK_K * stride_pk
        q_ptrs += BLOCK_K * stride_qk

    # fp32 epilogue, one rounding
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    c_tile = (c_ptr + batch.to(tl.int64) * stride_cb + (pid_m * BLOCK_M).to(tl.int64) * stride_cm
              + (pid_n * BLOCK_N).to(tl.int64) * stride_cn)
    c = tl.load(c_tile + (offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn), mask=mask, other=0.0)
    val = (alpha * acc + beta * c.to(tl.float32)).to(out_ptr.dtype.element_ty)
    out_tile = (out_ptr + batch.to(tl.int64) * stride_ob + (pid_m * BLOCK_M).to(tl.int64) * stride_om
                + (pid_n * BLOCK_N).to(tl.int64) * stride_on)
    tl.store(out_tile + (offs_m[:, None] * stride_om + offs_n[None, :] * stride_on), val, mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launchers

def _byte_range(t):
    """[first, last) bytes spanned by t (data_ptr includes the storage offset; strides are >= 0)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (start, start + (last + 1) * t.element_size())


def _overlaps(a, b):
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < a1 and b0 < b1 and a0 < b1 and b0 < a1


def _check_input(name, a):
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{name}: input must be a tensor, got {type(a).__name__}")
    if a.dim() not in (2, 3):
        raise ValueError(f"{name}: input must be 2-D (M, N) or batched 3-D (B, M, N), got shape {tuple(a.shape)}")
    if a.dtype not in DTYPES:
        raise TypeError(f"{name}: unsupported dtype {a.dtype}; supported: {', '.join(map(str, DTYPES))}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not (a.device.type == "cuda" or (interpreted and a.device.type == "cpu")):
        raise ValueError(f"{name}: input must be on a CUDA device (or on the CPU with TRITON_INTERPRET=1), "
                         f"got {a.device}")


def _check_out(name, a, out, shape):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: out must be a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: out has shape {tuple(out.shape)}, expected {tuple(shape)} "
                         f"for input {tuple(a.shape)}")
    if out.dtype != a.dtype:
        raise TypeError(f"{name}: out has dtype {out.dtype}, expected the input's dtype {a.dtype}")
    if out.device != a.device:
        raise ValueError(f"{name}: out is on {out.device} and the input on {a.device}; both must be on one device")
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise ValueError(f"{name}: out has a zero stride (an expanded view): several of its elements share memory")
    if _overlaps(a, out):
        raise ValueError(f"{name}: out overlaps the input in memory; the kernel reads the input while writing "
                         f"out, so they must be separate (the check is on the byte ranges they span)")


def _check_config(name, config, square):
    keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
    if not isinstance(config, dict) or set(config) != keys:
        raise ValueError(f"{name}: config must be a dict with exactly the keys {sorted(keys)}, got {config!r}")
    if square and config["BLOCK_M"] != config["BLOCK_N"]:
        raise ValueError(f"{name}: Gram kernels need square tiles (BLOCK_M == BLOCK_N), got {config!r}")


def _as3d(t):
    return t if t.dim() == 3 else t.unsqueeze(0)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device):
    if device.type != "cuda":
        return _DEFAULT_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _gram_config(x3, device):
    """Default Gram tile for X (batch, N, K): large tiles when they fill the SMs, else small ones."""
    if x3.dtype == torch.float32:
        return _FP32
    batch, n = x3.shape[0], x3.shape[1]
    nb = triton.cdiv(n, _BIG["BLOCK_M"])
    return _BIG if batch * nb * (nb + 1) // 2 >= _sms(device) else _SMALL


def _gemm_config(batch, m, n, dtype, device):
    if dtype == torch.float32:
        return _FP32
    tiles = batch * triton.cdiv(m, _BIG["BLOCK_M"]) * triton.cdiv(n, _BIG["BLOCK_N"])
    return _BIG if tiles >= _sms(device) else _GEMM_SMALL


def _launch_gram(x3, out3, alpha, beta, addend3, config):
    """out3 = alpha * x3 @ x3.mT (+ beta * addend3); all 3-D, already checked."""
    batch, n, k = x3.shape
    if batch == 0 or n == 0:
        return
    cfg = config if config is not None else _gram_config(x3, x3.device)
    block, block_k = cfg["BLOCK_M"], cfg["BLOCK_K"]
    nb = triton.cdiv(n, block)
    d3 = addend3 if addend3 is not None else out3  # never read when HAS_ADDEND is False
    _gram_kernel[(batch * nb * (nb + 1) // 2,)](
        x3, *x3.stride(),
        d3, *d3.stride(),
        out3, *out3.stride(),
        n, k, float(alpha), float(beta),
        HAS_ADDEND=addend3 is not None,
        MASKED=(n % block != 0 or k % block_k != 0),
        EXACT_FP32=x3.dtype == torch.float32,
        BLOCK=block, BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _gemm_epilogue(p3, q3, c3, out3, alpha, beta, config=None):
    """out3 = alpha * p3 @ q3 + beta * c3 for 3-D tensors of any strides; out3 must overlap none of them."""
    batch, m, k = p3.shape
    n = q3.shape[2]
    if batch == 0 or m == 0 or n == 0:
        return out3
    cfg = config if config is not None else _gemm_config(batch, m, n, p3.dtype, p3.device)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    _gemm_epilogue_kernel[(batch * triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        p3, *p3.stride(),
        q3, *q3.stride(),
        c3, *c3.stride(),
        out3, *out3.stride(),
        m, n, k, float(alpha), float(beta),
        MASKED=(m % bm != 0 or n % bn != 0 or k % bk != 0),
        EXACT_FP32=p3.dtype == torch.float32,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out3


def _gram(name, a, x, out, alpha, beta, addend, config):
    """Shared launcher: x is a (possibly transposed) view of the checked input a; out = alpha x x^T (+ beta d)."""
    if config is not None:
        _check_config(name, config, square=True)
    shape = (*x.shape[:-1], x.shape[-2])
    if out is None:
        out = torch.empty(shape, dtype=a.dtype, device=a.device)
    else:
        _check_out(name, a, out, shape)
    _launch_gram(_as3d(x), _as3d(out), alpha, beta, None if addend is None else _as3d(addend), config)
    return out


def xxt(a, out=None, *, config=None):
    """a @ a.mT for a (M, K) or (B, M, K) of any strides: (..., M, M), exactly symmetric.

    ``config`` (a dict, see TUNING_CANDIDATES) overrides the tile; only the benchmark uses it.
    """
    _check_input("xxt", a)
    return _gram("xxt", a, a, out, 1.0, 0.0, None, config)


def xtx(a, out=None, *, config=None):
    """a.mT @ a for a (K, N) or (B, K, N) of any strides: (..., N, N), exactly symmetric.

    The Gram kernel runs on the transposed view: no copy, only the strides change.
    """
    _check_input("xtx", a)
    return _gram("xtx", a, a.mT, out, 1.0, 0.0, None, config)


def ba_plus_caa(a, alpha, beta, out=None, *, config=None):
    """alpha * a @ a.mT + beta * a for a symmetric a (N, N) or (B, N, N): exactly symmetric output.

    Only the upper tiles of ``beta * a`` are read (the lower triangle of the result is their mirror), so a
    non-symmetric ``a`` gives the symmetrized upper part, not the reference formula.
    """
    _check_input("ba_plus_caa", a)
    if a.shape[-1] != a.shape[-2]:
        raise ValueError(f"ba_plus_caa: a must be square (a symmetric Gram matrix), got shape {tuple(a.shape)}")
    return _gram("ba_plus_caa", a, a, out, alpha, beta, a, config)


def _normalize_into(g, x0):
    """x0 = dtype(g / (||g||_F * 1.02 + 1e-6)) per matrix: fp32 norm and division, one rounding."""
    norm = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    x0.copy_(g / (norm * NORM_MARGIN + NORM_EPS))


def polar_express(g, steps=5, normalized=False, *, config=None):
    """Polar Express orthogonalization of g (M, N) or (B, M, N), any strides; same shape and dtype as g.

    Tall path (M > N): A = X^T X; B = b A + c A A; X <- a X + X B. Wide path (M <= N): A = X X^T;
    X <- a X + B X. ``steps`` <= 5 uses the first ``steps`` coefficient triples. ``normalized=True``:
    g is already X0 (as produced by ``nesterov_momentum``). g is never modified. ``config`` applies to
    all three kernels (square tiles); only the benchmark and tests use it.
    """
    _check_input("polar_express", g)
    if not isinstance(steps, int) or not 1 <= steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"polar_express: steps must be an int in [1, {len(POLAR_EXPRESS_COEFFS)}], got {steps!r}")
    if config is not None:
        _check_config("polar_express", config, square=True)
    g3 = _as3d(g)
    batch, m, n = g3.shape
    tall = m > n
    small = n if tall else m
    # Buffers, allocated once per call: the Gram matrix A, B = bA + cAA, and two X buffers that the
    # iterations write alternately (the input itself is only read).
    A = torch.empty((batch, small, small), dtype=g.dtype, device=g.device)
    B = torch.empty_like(A)
    bufs = [torch.empty((batch, m, n), dtype=g.dtype, device=g.device) for _ in range(2)]
    if normalized:
        x = g3
    else:
        _normalize_into(g3, bufs[1])
        x = bufs[1]
    for step, (a, b, c) in enumerate(POLAR_EXPRESS_COEFFS[:steps]):
        y = bufs[step % 2]
        if tall:
            _launch_gram(x.mT, A, 1.0, 0.0, None, config)
            _launch_gram(A, B, c, b, A, config)
            _gemm_epilogue(x, B, x, y, 1.0, a, config)
        else:
            _launch_gram(x, A, 1.0, 0.0, None, config)
            _launch_gram(A, B, c, b, A, config)
            _gemm_epilogue(B, x, x, y, 1.0, a, config)
        x = y
    return x if g.dim() == 3 else x[0]


# ----------------------------------------------------------------------------------------------------
# Benchmark

_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _config_name(cfg):
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}w{cfg['num_warps']}s{cfg['num_stages']}"


def _check_rule1(what, ours, lowp, ref64, symmetric):
    """The tests' rule 1 (tests/tolerances.py): error <= 2 x torch's error + one unit roundoff of the scale."""
    u = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[ours.dtype]
    err = (ours.double() - ref64).abs().max().item()
    err_torch = (lowp.double() - ref64).abs().max().item()
    bound = 2 * err_torch + u * ref64.abs().max().item()
    if not err <= bound:
        raise AssertionError(f"{what}: max abs err {err:.4e} > bound {bound:.4e} (torch err {err_torch:.4e})")
    if symmetric and not torch.equal(ours, ours.mT):
        raise AssertionError(f"{what}: output is not exactly symmetric")


def _gram_case(op, shape, device, config=None, dtype=torch.bfloat16):
    gen = torch.Generator(device="cpu").manual_seed(0)
    batch, m, n = shape
    a = (torch.randn(shape, generator=gen) / math.sqrt(n if op == "xxt" else m)).to(device, dtype)
    if op == "ba_plus_caa":
        a = xxt_ref(a)  # a symmetric input, like the A of Polar Express
    alpha, beta = POLAR_EXPRESS_COEFFS[0][2], POLAR_EXPRESS_COEFFS[0][1]
    if op == "xxt":
        size, k = m, n
        ours = functools.partial(xxt, a, config=config)
        torch_fn = functools.partial(torch.bmm, a, a.mT)
        ref = functools.partial(xxt_ref, a.double())
    elif op == "xtx":
        size, k = n, m
        ours = functools.partial(xtx, a, config=config)
        torch_fn = functools.partial(torch.bmm, a.mT, a)
        ref = functools.partial(xtx_ref, a.double())
    else:
        size, k = m, m
        ours = functools.partial(ba_plus_caa, a, alpha, beta, config=config)
        torch_fn = functools.partial(torch.baddbmm, a, a, a.mT, beta=beta, alpha=alpha)
        ref = functools.partial(ba_plus_caa_ref, a.double(), alpha, beta)
    out = torch.empty((batch, size, size), dtype=a.dtype, device=device)
    out_torch = torch.empty_like(out)
    suffix = "" if config is None else f"[{_config_name(config)}]"
    return dict(op=op + suffix, shape="x".join(map(str, shape)), dtype=_DTYPE_NAME[dtype],
                fn=lambda: ours(out=out),
                bytes=a.numel() * a.element_size() + out.numel() * out.element_size(),
                flops=2 * batch * size * size * k,  # full matmul FLOPs: the halving shows as speedup
                baselines={"torch": lambda: torch_fn(out=out_torch)},
                check=lambda: _check_rule1(f"{op}{suffix} {shape}", ours(), torch_fn(), ref(), symmetric=True))


def _polar_flops(batch, m, n, steps=5):
    small, large = min(m, n), max(m, n)
    per_step = 2 * small * small * large + 2 * small ** 3 + 2 * small * small * large
    return batch * steps * per_step


def _polar_case(device):
    """One optimizer step's matrices per GPU: (3, 3072, 768) MLP (tall) + (5, 768, 768) attention (wide)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(3, 3072, 768), (5, 768, 768)]
    gs = [torch.randn(s, generator=gen).to(device, torch.bfloat16) for s in shapes]
    compiled = torch.compile(polar_express_ref, dynamic=False)  # one graph per shape, no dynamic recompile

    def check():
        for g in gs:
            _check_rule1(f"polar_express {tuple(g.shape)}", polar_express(g), polar_express_ref(g),
                         polar_express_ref(g.double()), symmetric=False)

    return dict(op="polar_express", shape="3x3072x768+5x768x768", dtype="bf16",
                fn=lambda: [polar_express(g) for g in gs],
                bytes=sum(2 * g.numel() * g.element_size() for g in gs),
                flops=sum(_polar_flops(*s) for s in shapes),
                baselines={"torch": lambda: [polar_express_ref(g) for g in gs],
                           "torch.compile": lambda: [compiled(g) for g in gs]},
                check=check)


def bench_cases(device, tune=False):
    """Gram products at the speedrun's shapes, and Polar Express over one optimizer step's matrices.

    FLOPs are counted for the full product (2*B*M*M*K for a Gram matrix), not the half the kernels compute.
    With ``tune=True``, every TUNING_CANDIDATES config of the Gram kernels too, named like xxt[128x128x64w8s3].
    """
    gram_shapes = [("xxt", (4, 768, 3072)), ("xtx", (4, 3072, 768)), ("ba_plus_caa", (4, 768, 768)),
                   ("ba_plus_caa", (24, 768, 768)), ("xxt", (24, 768, 768)), ("xtx", (24, 768, 768))]
    cases = [_gram_case(op, shape, device) for op, shape in gram_shapes]
    cases.append(_polar_case(device))
    if tune:
        for op, shape in gram_shapes:
            cases.extend(_gram_case(op, shape, device, config=cfg) for cfg in TUNING_CANDIDATES)
    return cases
