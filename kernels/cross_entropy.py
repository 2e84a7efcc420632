"""Fused soft-capped multi-token cross entropy: per-row losses, and a one-kernel backward into the logits.

Math. For logits x (N, V), targets (N,) and K weights w_0..w_{K-1} (multi-token prediction: row t is also
scored on the token k places further on, with weight w_k):

    z[t, v]  = A * sigmoid((x[t, v] + B) / C)                 soft-capped logits, computed in fp32
    lse_t    = log sum_v exp(z[t, v])
    loss_t   = sum_k w_k * (lse_t - z[t, targets[t + k]])     over k = 0..K-1 with t + k < N

The last K - 1 rows have fewer terms (k = 0 is always there). With W_t = sum of w_k over the valid k and
g_t the incoming gradient of loss_t, the gradient is

    dL/dx[t, v] = g_t * (W_t * softmax(z_t)[v] - sum_k w_k [t + k < N] [v == targets[t + k]]) * dz/dx[t, v]
    dz/dx       = (A / C) * s * (1 - s),   s = sigmoid((x + B) / C)

Only x gets a gradient (targets are indices; the weights are a schedule, not parameters).

The extra term (the prefix-token loss of train_gpt.py's --prefix-loss). With targets (2, N) instead of (N,),
row 0 is the targets above and row 1 gives each row t one more target q_t, scored with the last weight:

    loss_t  += w_{K-1} * (lse_t - z[t, q_t])                   where q_t >= 0 (a negative q_t: no term)

and the first K - 1 weights are the multi-token terms over row 0. In the gradient, W_t counts w_{K-1} where
q_t >= 0 and the target sum gets w_{K-1} [v == q_t]. A q_t >= V is out of range (below). Kernels: the term
index PREFIX_AT = K - 1 (a compile-time constant, -1 without it) reads its target at targets + N + t.

Numerics. The forward keeps a running maximum m of z over the tiles (one max per tile, the lanes' partial
sums rescaled by exp(m_old - m_new)) and ends with m_t = max_v z[t, v] and S_t = sum_v exp(z[t, v] - m_t);
it saves both as ``stats`` (2, N) fp32, and the backward computes p = exp(z - m_t) / S_t. Saving
lse_t = m_t + log S_t instead would cost precision: lse_t is 20 to 35 here, where one fp32 ulp is ~2^-19, and
that absolute error becomes a relative error of p several times fp32's unit roundoff. A fixed shift
(exp(z - A), no max) would lose precision on GPUs for a similar reason: there exp(y) is computed as
2^(y log2 e), and the rounding of the product costs a relative error of about |y| ulps, |y| ~ 10 for most terms
(with the running max, |y| is small for the terms that dominate the sum and the gradient). For the same
reason the loss is summed as w_k * (log S_t + (m_t - z_k)), two small non-negative terms, rather than as
w_k * (lse_t - z_k). The kernels are written to be bound by the GPU's special-function unit (MUFU: 16 results
per clock per SM, an eighth of the FP32 rate; by static instruction counts), so each element
costs three MUFU operations and little else
(:func:`_softcap`): s = 1 / (1 + 2^t) with t = c1 x + c0 (the constants -log2(e) / C and B c1 folded on the
host: one FFMA, where a correctly rounded (x + B) / C took a MUFU.RCP and ~9 other instructions), 2^t and
exp(z - m) = 2^((z - m) log2 e) by ``tl.exp2`` (one MUFU.EX2 each: ``tl.exp`` adds a multiply and a
subnormal-range fix-up), and the reciprocal as rsqrt(d)^2 plus one Newton step (MUFU.RSQ and three FP32
instructions; ``1 / d`` compiles to a range-checked division of ~8). The test file derives the resulting fp32
error bounds (about 7 u of A for z, u = 2^-24).

Shapes and dtypes. logits (N, V) bf16 or fp32, any row stride (unit column stride: a slice of a wider buffer is
fine); targets (N,) int64, or (2, N) contiguous with the extra term (then K >= 2); weights (K,) fp32 on logits'
device with 1 <= K <= MAX_K = 4, read by the kernels at run time, so changing their values (a per-step schedule)
never recompiles (K itself is a compile-time constant: one compilation per K). A, B, C finite Python floats, C
nonzero. Outputs: losses (N,) fp32 and stats (2, N) fp32 (saved for the backward); dlogits (N, V) in logits' dtype,
a fresh contiguous tensor (no (N, V) fp32 temporary is made).

FP8 gradient for the FP8 LM head. The trainer's FP8 head multiplies the logits gradient in float8_e5m2 twice:
dx = g @ W^T takes it (N, V) row-major, dW = x^T @ g takes g as the second operand, which torch._scaled_mm on
Hopper wants column-major, i.e. a row-major (V, N) copy of g^T. :func:`softcapped_cross_entropy_bwd_e5m2` writes
both from one read of the logits, with a positive FP8 gradient scale ``scale`` (a Python float):

    g8[t, v] = g8t[v, t] = RNE_e5m2(dL/dx[t, v] / scale)                  g8 (N, V), g8t (V, N), float8_e5m2

dL/dx is the fp32 value above, never rounded to bf16 on the way (the eager path it replaces rounded twice:
dlogits to bf16, the division by the scale in bf16, then the cast), with 1/scale folded into the constant
A / (C * scale). RNE_e5m2 is round to nearest, ties to even, onto e5m2's grid: 2 mantissa bits, normals from
2^-14, subnormals the multiples of 2^-16, largest finite 57344; it saturates: magnitudes from 61440 on (and
+-inf) become +-57344, NaN stays NaN. That is a Hopper GPU's conversion (``cvt.rn.satfinite.e5m2x2.f32``, one
instruction per two elements, Triton's ``.to(tl.float8e5)`` there), which the kernels use on the GPU; torch's
``.to(torch.float8_e5m2)`` agrees bit for bit except that it gives +-inf from 61440 on. In Triton's interpreter
(the CPU tests) the kernels round by integer arithmetic on the fp32 bits instead (``_e5m2_bits``, the same
bits; the interpreter's own conversion is wrong). g8t holds the same bytes as g8, transposed; both are fresh
contiguous tensors: the row kernel writes g8 and kernels.transpose.transpose_copy copies it into g8t.

Out-of-range targets. Checking them on the host would synchronise the GPU every step, so the kernels check them
instead: a row that reads a target outside [0, V) (any k with t + k < N, whatever its weight) gets a NaN loss and a
NaN gradient row (in the e5m2 backward: a NaN row of g8 and column of g8t), and so does a row whose extra target q_t
is >= V. Nothing is read out of bounds. (train_gpt.py checks every shard's ids against the vocabulary before it
trains, so there no target is out of range.)

Kernels (the first two run one program per row, which walks the row in tiles of BLOCK_V columns: the full
tiles without masks, then one masked tail tile when BLOCK_V does not divide V):
  * ``_ce_fwd_kernel``: m_t and S_t, then the K gathers of z at the targets; writes losses and stats. Reads
    the logits once.
  * ``_ce_bwd_kernel``: the dense part of the backward: recomputes z and s from the logits and
    p = exp(z - m_t) / S_t and writes g_t W_t p (A/C) s (1 - s) to every column, as if none were a target.
    Reads the logits once and writes the gradient once.
  * ``_ce_bwd_targets_kernel`` (launched right after): each lane of a program of TARGETS_BLOCK_R rows rewrites
    its row's at most K target columns with the full expression, the weights of all the terms that land on a
    column subtracted (K reads and writes per row). Comparing every column with the K targets in the dense pass
    took 2K of its ~18 instructions per element.
  * the same backward with E5M2 (``softcapped_cross_entropy_bwd_e5m2``, the FP8 head): dx / scale is rounded
    to e5m2 (``_to_e5m2``) and stored as one byte per element, row-major (g8); then
    kernels.transpose.transpose_copy writes its transpose g8t.
  * ``_ce_fwd_grad_kernel`` (the gradient in the forward, below): the work of the three above for each row it
    takes, with the gradient's incoming value known in advance, on a persistent grid.
Bounds for the speedrun's N=49152, V=50304 (2.47e9 elements), bf16 logits, on an H200 (4.3 TB/s; MUFU 16
per clock per SM, 132 SMs at 1.98 GHz: 4.2e12 per second):
  * memory: the forward reads 4.95 GB (1.15 ms); the e5m2 backward reads 4.95 GB and writes 2.47 GB (1.7 ms),
    then the transpose reads and writes 2.47 GB each (1.15 ms); a bf16 backward writes 4.95 GB (2.3 ms in all).
  * MUFU: three operations per element, 7.4e9 per direction: 1.77 ms, above the memory bound of every kernel
    but the bf16 backward. The other instructions fit beside them: compiled for sm_90a with the launch's
    specialisations (Triton 3.6, as on the GPU machines; K=3, BLOCK_V=2048, 4 warps), a 16-element tile of the
    e5m2 backward is 286 instructions of which 48 MUFU, each MUFU taking 8 cycles of a scheduler's unit: by
    that count the unit is the bound, issue is not.
  * the gradient in the forward: the logits read once from memory, the gradient written once: e5m2 7.4 GB
    (1.7 ms), bf16 9.9 GB (2.3 ms); MUFU six operations per element (3.5 ms), the bound of both, and the sum of
    the two kernels' MUFU bounds: the kernel saves the backward's memory traffic and launch, not MUFU work.
notes/measurements.md has the kernels' measured times.

FP8 head (:func:`fp8_head_ce`, custom ops ``speedrun::fp8_head_ce`` / ``speedrun::fp8_head_ce_bwd``): the
training LM head x (N, C) @ W (C, V) and this loss in one op. The forward multiplies the e4m3 copies x8 = x / x_s
and w8 = W / w_s (scales FP8_X_S, FP8_W_S; :func:`fp8_e4m3`) with ``torch._scaled_mm`` (fp32 accumulation, logits
in x's dtype), then runs the forward kernel; the backward runs the e5m2 backward above with the caller's gradient
scale and two more FP8 matmuls, dx = g8 @ w8^T and dW = x8^T @ g8t, in the logits' dtype. The e4m3 copies are the
caller's, inputs of the ops beside x and W (whose values the ops do not read: they are there for their
gradients). W changes only at an optimizer step: :func:`fp8_head_weights` makes w8 (C, V) and the transposed copy
w8t (V, C) that torch._scaled_mm wants in the forward, once per step. x changes every call: the caller computes x8
where it computes x (train_gpt.py: inside the compiled step, where inductor writes it from the final norm's kernel).
x8^T, which the backward wants, is copied by kernels.transpose.transpose_copy, as w8t is. It needs a CUDA GPU of
capability >= 8.9 (:func:`fp8_head_support`).

Gradient in the forward (:func:`softcapped_cross_entropy_fwd_grad` and ``_e5m2``, one kernel; the heads
:func:`head_ce_grad_in_fwd` and :func:`fp8_head_ce_grad_in_fwd`). The loss is the last operation of a training
step, and the gradient it will receive is known when its forward runs: train_gpt.py divides the mean loss by
SLOTS, so every row's loss gets g = 1 / (SLOTS N). ``_ce_fwd_grad_kernel`` computes the losses and writes the
gradient for that g in one launch. Per row: the K target logits are gathered; pass A computes m_t and S_t as
``_ce_fwd_kernel`` does (``_row_stats``); pass B writes the dense gradient as ``_ce_bwd_kernel`` does; the target
columns are rewritten as ``_ce_bwd_targets_kernel`` does (after a barrier: other threads wrote them in pass B).
With the same tile and warps its losses and gradient are those of the two kernels, bit for bit. Pass B reads the
row again and computes s and exp(z - m) again: Triton keeps no row-sized buffer in shared memory (a row of fp32 s
is 200 KB), and s kept in global memory would move 8 bytes per element through L2 where re-reading the bf16 row
moves 2. So the kernel does the MUFU work of the two kernels; it saves the second read of the logits from memory
and the backward's launch, provided pass B finds its row in L2. Hence a persistent grid (``programs_per_sm``
programs per SM, each looping over rows: 2 x 132 rows of 100 KB of bf16 logits and 50 KB of e5m2 gradient are 40
MB, under the H100's 50 MB of L2) and pass B walks the tiles backwards, those pass A read last first.

The incoming gradient. The heads return the mean loss (0-d), so the gradient they receive is one number G; their
forward wrote the gradient for G = grad_scale (an argument; train_gpt.py: 1 / SLOTS). The backward multiplies by
r = G / grad_scale, a 0-d tensor on the device (no host sync; exactly 1 when G equals grad_scale), in what
consumes the gradient, not in the (N, V) gradient, whose rescaling would cost another pass over it: the FP8 head
multiplies its gradient scale by r (torch._scaled_mm applies the scale to the fp32 accumulator before the one
rounding of dx and dW: exact for any G), the bf16 head its two products, dx = (g W^T) r and dW = (x^T g) r (exact
where r = 1, else one more rounding of dx and dW to their dtype). Per-row losses would receive a gradient per
row, which the FP8 dW = x8^T diag(r) g8 cannot take without rounding x8 r to e4m3 again.

Memory. The logits are not kept for the backward. The bf16 head writes the gradient over them (in place: the
row's target logits are gathered before a barrier that precedes its first store, and only the row's program reads
the row), so from its matmul to its backward it holds one (N, V) buffer, where the two-kernel path keeps the logits
and allocates dlogits beside them in the backward: the peak drops by 2NV bytes (4.95 GB at N = 49152). The FP8
head frees its logits when its forward returns and keeps g8 (NV bytes) for the backward, which makes g8t: peaks
3NV bytes (forward: logits and g8) and 2NV (backward), where the two-kernel path's backward holds 4NV (logits, g8,
g8t).

Meant for train_gpt.py's LM head, through :func:`softcapped_cross_entropy` (custom ops
``speedrun::softcapped_ce_fwd`` / ``speedrun::softcapped_ce_bwd``, traceable by
``torch.compile(fullgraph=True)``) and :func:`fp8_head_ce`, or with --ce-grad-in-forward (the default) through
:func:`head_ce_grad_in_fwd` and :func:`fp8_head_ce_grad_in_fwd` (custom ops of the same names, the FP8 one with
``speedrun::fp8_head_ce_grad_in_fwd_bwd``); ``python -m benchmarks --only cross_entropy`` measures the kernels,
the two paths side by side, and the FP8 head's backward against the eager paths it replaced. On the CPU the
Triton interpreter is several times slower than the reference at real vocabulary sizes: there the trainer calls
:func:`softcapped_cross_entropy_ref`, which is differentiable by autograd.
"""
import math
from typing import NamedTuple, Tuple

import torch
import triton
import triton.language as tl

from kernels._checks import check_kernel_device, interpreting, overlaps
from kernels.transpose import transpose_copy

# Most weights (terms per row) supported: the backward holds each term's target and weight in registers.
MAX_K = 4

# Launch configuration per logits dtype: columns per tile, warps. bf16: the fastest of TUNING_CANDIDATES on one
# H200 (`python -m benchmarks --only cross_entropy --tune`) for an earlier form of the kernels, with more MUFU work
# per element; to tune again. fp32: an initial choice (half the columns for the same bytes), not tuned.
DEFAULT_CONFIG = {
    torch.bfloat16: dict(BLOCK_V=2048, num_warps=4),
    torch.float32: dict(BLOCK_V=1024, num_warps=8),
}
# Under TRITON_INTERPRET=1 (CPU) the cost is per tile, so fewer, wider tiles are faster (results differ from
# the GPU configuration only by the order of the fp32 sums).
INTERPRETER_CONFIG = dict(BLOCK_V=4096, num_warps=4)
TUNING_CANDIDATES = [
    dict(BLOCK_V=1024, num_warps=4),
    dict(BLOCK_V=2048, num_warps=4),
    dict(BLOCK_V=2048, num_warps=8),
    dict(BLOCK_V=4096, num_warps=8),
    dict(BLOCK_V=4096, num_warps=16),
]

# The fused kernel (_ce_fwd_grad_kernel): columns per tile, warps, and programs per SM (a persistent launch of
# programs_per_sm * SMs programs, each looping over rows, caps the rows in flight so that pass B re-reads its row from
# L2; 0: one program per row). A choice by that argument (2 x 132 rows of 150 KB of logits and e5m2 gradient in
# flight, under the H100's 50 MB of L2), not tuned: FWD_GRAD_TUNING_CANDIDATES holds both kinds of launch for
# `python -m benchmarks --only cross_entropy --tune`. The interpreter's: INTERPRETER_CONFIG's tile and warps (the
# same fp32 sums as the two-kernel path there) and one program per row.
FWD_GRAD_CONFIG = {
    torch.bfloat16: dict(BLOCK_V=2048, num_warps=8, programs_per_sm=2),
    torch.float32: dict(BLOCK_V=1024, num_warps=8, programs_per_sm=2),
}
INTERPRETER_FWD_GRAD_CONFIG = dict(INTERPRETER_CONFIG, programs_per_sm=0)
FWD_GRAD_TUNING_CANDIDATES = [
    dict(BLOCK_V=2048, num_warps=4, programs_per_sm=0),
    dict(BLOCK_V=2048, num_warps=8, programs_per_sm=1),
    dict(BLOCK_V=2048, num_warps=8, programs_per_sm=2),
    dict(BLOCK_V=2048, num_warps=4, programs_per_sm=4),
    dict(BLOCK_V=4096, num_warps=16, programs_per_sm=1),
    dict(BLOCK_V=4096, num_warps=8, programs_per_sm=2),
]

# The target pass (_ce_bwd_targets_kernel): rows per program, one per lane of 4 warps (K scattered 1- or 2-byte
# stores per row; a few microseconds at the speedrun's N, not measured).
TARGETS_BLOCK_R = 128

_LOGIT_DTYPES = (torch.bfloat16, torch.float32)

# FP8 LM head scales (fp8_head_ce), as in the public record: x is RMS-normed (|x| <= 100 fits e4m3's 448 after
# / x_s), the head's weights are small (|w| <= 1.6). The gradient scale follows the caller's loss normalisation:
# for a loss that is the mean over N rows divided by S more (train_gpt.py: S = SLOTS micro-batches), grad_s =
# FP8_GRAD_S / (N * S) puts the largest gradients (~1/(N * S)) near 600 in e5m2, as the record's scale does for
# its summed loss. The FP8 ops take it as grad_s / grad_s_div, (FP8_GRAD_S, N * S) there: an integer divisor is
# a symbolic size in a compiled caller whose N is dynamic (train_gpt.py --dynamic-tokens), where the float
# quotient would be a constant of the graph, guarded (one recompile per N).
FP8_X_S, FP8_W_S, FP8_GRAD_S = 100 / 448, 1.6 / 448, 0.75 / 448


# ---------------------------------------------------------------------------------------------------------
# Pure-PyTorch reference
# ---------------------------------------------------------------------------------------------------------
def softcapped_cross_entropy_ref(logits, targets, weights, A, B, C):
    """The module's math in plain PyTorch, differentiable in ``logits`` by autograd.

    Computes in float64 for float64 logits and in fp32 otherwise; returns per-row losses (N,) in that dtype.
    Materialises z (N, V) in that dtype: fine for tests and CPU runs, wasteful on a GPU."""
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = A * torch.sigmoid((logits.to(dt) + B) / C)
    lse = torch.logsumexp(z, dim=-1)
    N = logits.shape[0]
    losses = torch.zeros(N, dtype=dt, device=logits.device)
    w = weights.to(dt)
    if targets.dim() == 2:  # the extra term: weight w[-1], target targets[1, t] where that is >= 0
        extra, targets, w = targets[1], targets[0], w[:-1]
        on = extra >= 0
        picked = z.gather(1, torch.where(on, extra, 0).reshape(-1, 1)).reshape(-1)
        losses = losses + torch.where(on, weights[-1].to(dt) * (lse - picked), 0.0)
    for k in range(min(w.shape[0], N)):
        picked = z[:N - k].gather(1, targets[k:].reshape(-1, 1)).reshape(-1)
        losses = losses + torch.nn.functional.pad(w[k] * (lse[:N - k] - picked), (0, k))
    return losses


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------
_LOG2E = tl.constexpr(1.4426950408889634)
_E5M2_MAX = tl.constexpr(57344.0)


@triton.jit
def _softcap(x, A, c1, c0):
    """(z, s): s = sigmoid((x + B) / C) = 1 / (1 + 2^t), t = c1 x + c0 (c1 = -log2(e) / C, c0 = B c1, folded on the
    host), z = A s, in fp32. The reciprocal of d = 1 + 2^t starts from rsqrt(d)^2 (the GPU's approximate MUFU.RSQ,
    a few ulps off once squared) and takes one Newton step, s = s0 + s0 (1 - d s0), which squares that error away
    and leaves about one rounding (in the interpreter too, whose rsqrt rounds twice: without the step the losses
    missed rule 1's bound there). On a GPU: MUFU.EX2, MUFU.RSQ and about six FP32 instructions per element
    (tl.sigmoid plus tl.div_rn's correctly rounded division took ~25). x = -inf gives 2^t = inf, s = 0 (the step
    is skipped where s0 = 0: d s0 = inf * 0 is NaN there); x = +inf gives s = 1; NaN stays NaN."""
    d = 1.0 + tl.exp2(x.to(tl.float32) * c1 + c0)
    r = tl.rsqrt(d)
    s0 = r * r
    s = tl.where(s0 > 0.0, s0 + s0 * (1.0 - d * s0), s0)
    return A * s, s


@triton.jit
def _row_term(targets_ptr, weights_ptr, row, N, V, k: tl.constexpr, PREFIX_AT: tl.constexpr):
    """Target and weight of term k of this row (weight 0 when t + k >= N), whether the term is present (t + k < N)
    and whether its target is bad (present and outside [0, V)). Term PREFIX_AT (when k equals it) is the extra
    term instead: its target is the row's entry of the second row of targets (2, N), at targets_ptr + N + row,
    present where it is >= 0 (a negative entry: no such term for the row), bad where it is >= V."""
    if k == PREFIX_AT:
        tgt = tl.load(targets_ptr + N + row)
        present = tgt >= 0
        bad = tgt >= V
    else:
        present = row + k < N
        tgt = tl.load(targets_ptr + row + k, mask=present, other=0)
        bad = present & ((tgt < 0) | (tgt >= V))
    w = tl.where(present, tl.load(weights_ptr + k), 0.0)
    return tgt, w, present, bad


@triton.jit
def _row_stats(x_row, cols, V, A, c1, c0, BLOCK_V: tl.constexpr):
    """(m, S) of one row: m = max_v z and S = sum_v exp(z - m), fp32, from one read of its V logits in tiles of
    BLOCK_V columns (``cols`` = tl.arange(0, BLOCK_V)): the full tiles without masks, then the masked tail. The
    lanes' partial sums are rescaled by exp(m_old - m_new) whenever the running max grows."""
    m = -float("inf")                                      # running max of z over the tiles seen
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)          # per-lane sums of exp(z - m)
    v_full = (V // BLOCK_V) * BLOCK_V
    for off in range(0, v_full, BLOCK_V):                  # full tiles: no masks
        z, s = _softcap(tl.load(x_row + off + cols), A, c1, c0)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        acc = acc * tl.exp2((m - m_new) * _LOG2E) + tl.exp2((z - m_new) * _LOG2E)
        m = m_new
    if v_full < V:                                         # masked tail
        msk = v_full + cols < V
        z, s = _softcap(tl.load(x_row + v_full + cols, mask=msk, other=0.0), A, c1, c0)
        z = tl.where(msk, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        acc = acc * tl.exp2((m - m_new) * _LOG2E) + tl.exp2((z - m_new) * _LOG2E)
        m = m_new
    return m, tl.sum(acc, axis=0)


@triton.jit
def _ce_fwd_kernel(
    # logits (N, V), row stride in elements (unit column stride)
    x_ptr, stride_xn,
    # targets (N,) int64, weights (K,) fp32
    targets_ptr, weights_ptr,
    # outputs: losses (N,) fp32, stats (2, N) fp32 (row max of z, sum of exp(z - max))
    losses_ptr, stats_ptr,
    # sizes and softcap constants (A, and c1 = -log2(e) / C, c0 = B c1)
    N, V, A, c1, c0,
    K: tl.constexpr, PREFIX_AT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    m, sumexp = _row_stats(x_row, tl.arange(0, BLOCK_V), V, A, c1, c0, BLOCK_V)
    log_s = tl.log(sumexp)                                 # lse - m

    # loss_t = sum_k w_k * (lse - z_k) = sum_k w_k * (log S + (m - z_k)): two small non-negative terms
    loss = 0.0
    any_bad = False
    for k in tl.static_range(K):
        tgt, w, present, bad = _row_term(targets_ptr, weights_ptr, row, N, V, k, PREFIX_AT)
        zt, st = _softcap(tl.load(x_row + tgt, mask=present & ~bad, other=0.0), A, c1, c0)
        loss += w * (log_s + (m - zt))
        any_bad = any_bad | bad
    loss = tl.where(any_bad, float("nan"), loss)
    tl.store(losses_ptr + row, loss)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + N + row, sumexp)


@triton.jit
def _bwd_row_setup(g_ptr, stride_g, stats_ptr, targets_ptr, weights_ptr, row, N, V, A_over_C, K: tl.constexpr,
                   PREFIX_AT: tl.constexpr):
    """What the backward needs of row(s) ``row``: m_t; the row's factor of the dense part,
    dense = g_t W_t (A / C) / S_t (NaN for a row with a bad target); gc = g_t (A / C) (the targets' factor); and the
    MAX_K terms (target, weight; the absent ones weight 0). A_over_C holds A / (C * scale) for the e5m2 backward.
    ``row`` is one int64 row (_ce_bwd_kernel: scalars) or an int64 (BLOCK_R,) vector of rows below N
    (_ce_bwd_targets_kernel: one per lane); the operations, hence the bits, are the same."""
    m = tl.load(stats_ptr + row)
    inv_s = tl.div_rn(1.0, tl.load(stats_ptr + N + row))
    g = tl.load(g_ptr + row * stride_g).to(tl.float32)
    tgt0, w0, p0, bad = _row_term(targets_ptr, weights_ptr, row, N, V, 0, PREFIX_AT)
    tgt1, w1, tgt2, w2, tgt3, w3 = tgt0, 0.0, tgt0, 0.0, tgt0, 0.0
    if K > 1:
        tgt1, w1, p1, bad1 = _row_term(targets_ptr, weights_ptr, row, N, V, 1, PREFIX_AT)
        bad = bad | bad1
    if K > 2:
        tgt2, w2, p2, bad2 = _row_term(targets_ptr, weights_ptr, row, N, V, 2, PREFIX_AT)
        bad = bad | bad2
    if K > 3:
        tgt3, w3, p3, bad3 = _row_term(targets_ptr, weights_ptr, row, N, V, 3, PREFIX_AT)
        bad = bad | bad3
    g = tl.where(bad, float("nan"), g)                     # poison the whole row, as the forward does
    gc = g * A_over_C
    dense = gc * (w0 + w1 + w2 + w3) * inv_s
    return m, dense, gc, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3


@triton.jit
def _bwd_dense(x, m, dense, A, c1, c0):
    """fp32 dx of logits x at the columns that are no target of the row: dense exp(z - m) s (1 - s), which is
    g W p (A/C) s (1 - s) with p = exp(z - m) / S; x (BLOCK_V,), the row's values scalars. The target columns are
    written again afterwards by _ce_bwd_targets_kernel (``_bwd_target``): comparing every column with K targets cost
    2K instructions per element."""
    z, s = _softcap(x, A, c1, c0)
    return (dense * tl.exp2((z - m) * _LOG2E)) * (s * (1.0 - s))


@triton.jit
def _bwd_target(x, c, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3, K: tl.constexpr):
    """fp32 dx of logits x at column c (a target of the row): (dense exp(z - m) - gc hit) s (1 - s) with
    hit = sum_k w_k [c == t_k] (a column that is the target of several terms gets all their weights)."""
    z, s = _softcap(x, A, c1, c0)
    hit = tl.where(c == tgt0, w0, 0.0)
    if K > 1:
        hit += tl.where(c == tgt1, w1, 0.0)
    if K > 2:
        hit += tl.where(c == tgt2, w2, 0.0)
    if K > 3:
        hit += tl.where(c == tgt3, w3, 0.0)
    return (dense * tl.exp2((z - m) * _LOG2E) - gc * hit) * (s * (1.0 - s))


@triton.jit
def _e5m2_bits(v):
    """uint8 bit patterns of SAT(RNE_e5m2(v)) for fp32 v, in integer and fp32 arithmetic: round to nearest even onto
    e5m2's grid, then magnitudes above the largest finite value 57344 (from 61440 on, and inf) saturate to
    +-57344; NaN stays NaN. This is what a Hopper GPU's conversion (``cvt.rn.satfinite.e5m2x2.f32``, Triton's
    ``.to(tl.float8e5)`` there) does; :func:`_to_e5m2` uses it in Triton's interpreter (the CPU tests), whose
    own fp32 -> e5m2 conversion is wrong: its round-to-nearest adds one to the 2-bit significand without carrying
    into the exponent (1.9417 becomes 1.0, not 2.0) and overflow gives NaN.
      * |v| >= 2^-14 (e5m2 normals): on the bit pattern of |v|, adding 0xFFFFF plus the lowest kept mantissa
        bit and clearing the low 21 bits keeps 2 of fp32's 23 mantissa bits, rounded to nearest even; a carry
        into the exponent is the right result (1.9417 -> 2.0; 61440 and above -> 65536, saturated below).
      * |v| < 2^-14 (e5m2 subnormals, multiples of 2^-16): |v| * 2^16 < 4 is exact, and adding then
        subtracting 1.5 * 2^23 (where the fp32 spacing is 1) rounds it to an integer, to nearest even.
    The rounded value is on e5m2's grid, a subset of fp16's, so the fp32 -> fp16 conversion is exact, and the top
    byte of an fp16 is the e5m2 encoding of the same value."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits ^ mag                                      # the sign bit alone
    a = mag.to(tl.float32, bitcast=True)                   # |v|
    normal = (((mag + 0xFFFFF + ((mag >> 21) & 1)) >> 21) << 21).to(tl.float32, bitcast=True)
    subnormal = ((a * 65536.0 + 12582912.0) - 12582912.0) * 1.52587890625e-05      # 2^16, 1.5 * 2^23, 2^-16
    r = tl.where(a < 6.103515625e-05, subnormal, normal)  # 2^-14
    r = tl.where(r > _E5M2_MAX, _E5M2_MAX, r)              # saturate (65536, inf)
    r = tl.where(a == a, r, float("nan"))                  # NaN: not rounded (a GPU's 0x7FFFFFFF would carry into
                                                           # the sign), one quiet NaN whatever the payload
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return (r.to(tl.float16).to(tl.uint16, bitcast=True) >> 8).to(tl.uint8)


@triton.jit
def _to_e5m2(v, HW_FP8: tl.constexpr):
    """uint8 bit patterns of SAT(RNE_e5m2(v)): the GPU's conversion (one F2FP instruction per two elements) with
    HW_FP8, else the same rounding in integer arithmetic (:func:`_e5m2_bits`, 13 instructions per element; the
    interpreter's own conversion is wrong). The launchers set HW_FP8 outside the interpreter."""
    if HW_FP8:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        return _e5m2_bits(v)


@triton.jit
def _ce_bwd_tile(x_row, dx_row, start, cols, V, m, dense, A, c1, c0, MASKED: tl.constexpr, E5M2: tl.constexpr,
                 HW_FP8: tl.constexpr):
    """One tile of one row: the dense dx (``_bwd_dense``) in dx_row's dtype, or with E5M2 its e5m2 bits."""
    c = start + cols
    msk = c < V if MASKED else None
    dx = _bwd_dense(tl.load(x_row + c, mask=msk, other=0.0 if MASKED else None), m, dense, A, c1, c0)
    tl.store(dx_row + c, _to_e5m2(dx, HW_FP8) if E5M2 else dx.to(dx_row.dtype.element_ty), mask=msk)


@triton.jit
def _ce_bwd_kernel(
    # incoming gradient of the losses (N,) fp32 and its stride (0 when broadcast from a sum)
    g_ptr, stride_g,
    # logits (N, V) and their row stride; the forward's stats (2, N) fp32
    x_ptr, stride_xn, stats_ptr,
    # targets (N,) int64, weights (K,) fp32
    targets_ptr, weights_ptr,
    # output: dlogits (N, V) contiguous, logits' dtype; or with E5M2 its e5m2 bit patterns (a uint8 view)
    dx_ptr,
    # sizes and softcap constants; A_over_C is A / (C * scale) with E5M2
    N, V, A, c1, c0, A_over_C,
    K: tl.constexpr, PREFIX_AT: tl.constexpr, BLOCK_V: tl.constexpr, E5M2: tl.constexpr, HW_FP8: tl.constexpr,
):
    """The dense part of dlogits (every column as if it were no target), one program per row; the row's target
    columns are then rewritten by _ce_bwd_targets_kernel."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xn
    dx_row = dx_ptr + row * V
    m, dense, gc, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3 = _bwd_row_setup(
        g_ptr, stride_g, stats_ptr, targets_ptr, weights_ptr, row, N, V, A_over_C, K, PREFIX_AT)
    cols = tl.arange(0, BLOCK_V)
    v_full = (V // BLOCK_V) * BLOCK_V
    for off in range(0, v_full, BLOCK_V):                  # full tiles: no masks
        _ce_bwd_tile(x_row, dx_row, off, cols, V, m, dense, A, c1, c0, False, E5M2, HW_FP8)
    if v_full < V:                                         # masked tail
        _ce_bwd_tile(x_row, dx_row, v_full, cols, V, m, dense, A, c1, c0, True, E5M2, HW_FP8)


@triton.jit
def _ce_bwd_targets_kernel(
    # as _ce_bwd_kernel
    g_ptr, stride_g, x_ptr, stride_xn, stats_ptr, targets_ptr, weights_ptr, dx_ptr,
    N, V, A, c1, c0, A_over_C,
    K: tl.constexpr, PREFIX_AT: tl.constexpr, BLOCK_R: tl.constexpr, E5M2: tl.constexpr, HW_FP8: tl.constexpr,
):
    """The target columns of BLOCK_R rows (one per lane) after the dense pass: dx at each present, in-range target
    t_k, with all the weights that land on that column (``_bwd_target``), into dlogits (or g8). Two terms with the
    same target write the same value twice. Rows past N (the last block) compute row N - 1's values and store
    nothing. Runs after _ce_bwd_kernel (the same stream), so these writes come last."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < N
    r = tl.minimum(rows, N - 1)
    m, dense, gc, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3 = _bwd_row_setup(
        g_ptr, stride_g, stats_ptr, targets_ptr, weights_ptr, r, N, V, A_over_C, K, PREFIX_AT)
    for k in tl.static_range(K):
        tgt, w, present, bad = _row_term(targets_ptr, weights_ptr, r, N, V, k, PREFIX_AT)
        ok = live & present & ~bad
        x = tl.load(x_ptr + r * stride_xn + tgt, mask=ok, other=0.0)
        dx = _bwd_target(x, tgt, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3, K)
        if E5M2:
            tl.store(dx_ptr + r * V + tgt, _to_e5m2(dx, HW_FP8), mask=ok)
        else:
            tl.store(dx_ptr + r * V + tgt, dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fwd_grad_term(x_row, targets_ptr, weights_ptr, row, N, V, k: tl.constexpr, PREFIX_AT: tl.constexpr):
    """Term k of the row for _ce_fwd_grad_kernel: its target and weight (``_row_term``), whether its target column
    is stored (present and in range), whether the target is bad, and the logit at the target (0 where not stored),
    gathered before the row's gradient is written (which may overwrite the logits)."""
    tgt, w, present, bad = _row_term(targets_ptr, weights_ptr, row, N, V, k, PREFIX_AT)
    ok = present & ~bad
    return tgt, w, ok, bad, tl.load(x_row + tgt, mask=ok, other=0.0)


@triton.jit
def _fwd_grad_target(dx_row, xt, c, ok, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3,
                     K: tl.constexpr, E5M2: tl.constexpr, HW_FP8: tl.constexpr):
    """Rewrites the row's target column c (logit xt; where ``ok``) with the full expression ``_bwd_target``."""
    dx = _bwd_target(xt, c, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3, K)
    if E5M2:
        tl.store(dx_row + c, _to_e5m2(dx, HW_FP8), mask=ok)
    else:
        tl.store(dx_row + c, dx.to(dx_row.dtype.element_ty), mask=ok)


@triton.jit
def _ce_fwd_grad_kernel(
    # logits (N, V), row stride in elements (unit column stride)
    x_ptr, stride_xn,
    # targets (N,) int64, weights (K,) fp32
    targets_ptr, weights_ptr,
    # outputs: losses (N,) fp32; dlogits (N, V) contiguous, logits' dtype (or with E5M2 its e5m2 bits, a uint8
    # view); dlogits may be the logits themselves (in place: each row is read and written by its program alone)
    losses_ptr, dx_ptr,
    # sizes, softcap constants, every row's incoming gradient g, and A / C (A / (C * scale) with E5M2)
    N, V, A, c1, c0, g, A_over_C,
    K: tl.constexpr, PREFIX_AT: tl.constexpr, BLOCK_V: tl.constexpr, E5M2: tl.constexpr, HW_FP8: tl.constexpr,
):
    """The forward and the backward of every row this program takes (rows pid, pid + programs, ...): the K target
    logits gathered; pass A (``_row_stats``) and the loss, as _ce_fwd_kernel; pass B, the dense dlogits of every
    column (``_ce_bwd_tile``, as _ce_bwd_kernel with the incoming gradient g), over the tiles in reverse order (the
    tiles pass A read last come first, while they are most likely in L2); then the K target columns rewritten
    (``_fwd_grad_target``, as _ce_bwd_targets_kernel). Barriers order, within the program, the gathers before pass
    B's stores (in place they overwrite the gathered logits) and pass B's stores before the target columns' (other
    threads write them)."""
    cols = tl.arange(0, BLOCK_V)
    n_full = V // BLOCK_V
    v_full = n_full * BLOCK_V
    for row in range(tl.program_id(0).to(tl.int64), N, tl.num_programs(0)):   # int64 offsets
        x_row = x_ptr + row * stride_xn
        dx_row = dx_ptr + row * V
        tgt0, w0, ok0, bad, xt0 = _fwd_grad_term(x_row, targets_ptr, weights_ptr, row, N, V, 0, PREFIX_AT)
        tgt1, w1, ok1, xt1, tgt2, w2, ok2, xt2, tgt3, w3, ok3, xt3 = tgt0, 0.0, ok0, xt0, tgt0, 0.0, ok0, xt0, \
            tgt0, 0.0, ok0, xt0
        if K > 1:
            tgt1, w1, ok1, bad1, xt1 = _fwd_grad_term(x_row, targets_ptr, weights_ptr, row, N, V, 1, PREFIX_AT)
            bad = bad | bad1
        if K > 2:
            tgt2, w2, ok2, bad2, xt2 = _fwd_grad_term(x_row, targets_ptr, weights_ptr, row, N, V, 2, PREFIX_AT)
            bad = bad | bad2
        if K > 3:
            tgt3, w3, ok3, bad3, xt3 = _fwd_grad_term(x_row, targets_ptr, weights_ptr, row, N, V, 3, PREFIX_AT)
            bad = bad | bad3

        # forward: loss_t = sum_k w_k * (log S + (m - z_k)), summed in _ce_fwd_kernel's order
        m, sumexp = _row_stats(x_row, cols, V, A, c1, c0, BLOCK_V)
        log_s = tl.log(sumexp)
        loss = 0.0
        zt, st = _softcap(xt0, A, c1, c0)
        loss += w0 * (log_s + (m - zt))
        if K > 1:
            zt, st = _softcap(xt1, A, c1, c0)
            loss += w1 * (log_s + (m - zt))
        if K > 2:
            zt, st = _softcap(xt2, A, c1, c0)
            loss += w2 * (log_s + (m - zt))
        if K > 3:
            zt, st = _softcap(xt3, A, c1, c0)
            loss += w3 * (log_s + (m - zt))
        tl.store(losses_ptr + row, tl.where(bad, float("nan"), loss))

        # backward, the factors of _bwd_row_setup: gc = g (A / C), dense = gc W / S (NaN for a row with a bad target)
        gc = tl.where(bad, float("nan"), g) * A_over_C
        dense = gc * (w0 + w1 + w2 + w3) * tl.div_rn(1.0, sumexp)
        tl.debug_barrier()                                 # every thread's gathers before any store to the row
        if v_full < V:                                     # masked tail first
            _ce_bwd_tile(x_row, dx_row, v_full, cols, V, m, dense, A, c1, c0, True, E5M2, HW_FP8)
        for i in range(0, n_full):                         # full tiles, last first
            _ce_bwd_tile(x_row, dx_row, (n_full - 1 - i) * BLOCK_V, cols, V, m, dense, A, c1, c0, False, E5M2,
                         HW_FP8)
        tl.debug_barrier()                                 # the dense stores before the target columns'
        _fwd_grad_target(dx_row, xt0, tgt0, ok0, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3, w3,
                         K, E5M2, HW_FP8)
        if K > 1:
            _fwd_grad_target(dx_row, xt1, tgt1, ok1, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3,
                             w3, K, E5M2, HW_FP8)
        if K > 2:
            _fwd_grad_target(dx_row, xt2, tgt2, ok2, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3,
                             w3, K, E5M2, HW_FP8)
        if K > 3:
            _fwd_grad_target(dx_row, xt3, tgt3, ok3, m, dense, gc, A, c1, c0, tgt0, w0, tgt1, w1, tgt2, w2, tgt3,
                             w3, K, E5M2, HW_FP8)


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------
def _check_scalars(A, B, C):
    for name, val in (("A", A), ("B", B), ("C", C)):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
            raise TypeError(f"softcapped_cross_entropy: {name} must be a finite Python float, got {val!r}")
    if C == 0:
        raise ValueError("softcapped_cross_entropy: C must be nonzero")


def _check_inputs(logits, targets, weights, A, B, C):
    """Validate the shared arguments; returns (N, V, K)."""
    for name, t in (("logits", logits), ("targets", targets), ("weights", weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"softcapped_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"softcapped_cross_entropy: logits must be 2-D (N, V), got shape {tuple(logits.shape)}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"softcapped_cross_entropy: logits must be bfloat16 or float32, got {logits.dtype}")
    N, V = logits.shape
    if V == 0:
        raise ValueError("softcapped_cross_entropy: logits must have at least one column (V >= 1)")
    if V > 1 and logits.stride(1) != 1:
        raise ValueError(f"softcapped_cross_entropy: logits must have unit column stride, got strides "
                         f"{logits.stride()}")
    if targets.dtype != torch.int64:
        raise TypeError(f"softcapped_cross_entropy: targets must be int64, got {targets.dtype}")
    if targets.shape != (N,) and targets.shape != (2, N):
        raise ValueError(f"softcapped_cross_entropy: targets must have shape (N,) = ({N},), or (2, N) = (2, {N}) "
                         f"with the extra term's targets, got {tuple(targets.shape)}")
    if targets.dim() == 2 and N > 0 and targets.stride() != (N, 1):
        raise ValueError(f"softcapped_cross_entropy: targets (2, N) must be contiguous, got strides "
                         f"{targets.stride()}")
    if weights.dtype != torch.float32:
        raise TypeError(f"softcapped_cross_entropy: weights must be float32, got {weights.dtype}")
    if weights.dim() != 1 or weights.numel() == 0:
        raise ValueError(f"softcapped_cross_entropy: weights must be 1-D and non-empty (K,), got shape "
                         f"{tuple(weights.shape)}")
    for name, t in (("targets", targets), ("weights", weights)):
        if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"softcapped_cross_entropy: {name} must be contiguous, got stride {t.stride(0)}")
    K = weights.shape[0]
    if K > MAX_K:
        raise ValueError(f"softcapped_cross_entropy: at most {MAX_K} weights are supported, got K={K}")
    if targets.dim() == 2 and K < 2:
        raise ValueError("softcapped_cross_entropy: targets (2, N) need K >= 2 weights (the last one the extra "
                         f"term's), got K={K}")
    check_kernel_device("softcapped_cross_entropy", logits.device)
    for name, t in (("targets", targets), ("weights", weights)):
        if t.device != logits.device:
            raise ValueError(f"softcapped_cross_entropy: {name} is on {t.device} but logits is on {logits.device}")
    _check_scalars(A, B, C)
    return N, V, K


def _check_grad(grad, N, dev):
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"softcapped_cross_entropy: grad must be a torch.Tensor, got {type(grad).__name__}")
    if grad.shape != (N,) or grad.dtype != torch.float32 or grad.device != dev:
        raise ValueError(f"softcapped_cross_entropy: grad must be a float32 tensor of shape ({N},) on {dev}, got "
                         f"{grad.dtype} {tuple(grad.shape)} on {grad.device}")


def _check_out(name, t, shape, dtype, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"softcapped_cross_entropy: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"softcapped_cross_entropy: {name} must be a contiguous {dtype} tensor of shape "
                         f"{tuple(shape)} on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _prefix_at(targets, K):
    """The kernels' PREFIX_AT: K - 1 (the last term is the extra one) for targets (2, N), else -1 (none)."""
    return K - 1 if targets.dim() == 2 else -1


def _config(logits, config):
    if config is not None:
        return config
    if logits.device.type == "cpu":
        return INTERPRETER_CONFIG
    return DEFAULT_CONFIG[logits.dtype]


def softcapped_cross_entropy_fwd(logits, targets, weights, A, B, C, losses=None, stats=None, config=None):
    """(losses, stats): losses (N,) fp32 and stats (2, N) fp32 (row max of z, sum of exp(z - max)), which the
    backward needs. ``losses``/``stats``: optional preallocated outputs; ``config``: a
    dict(BLOCK_V=..., num_warps=...) overriding the per-dtype default (BLOCK_V a power of two)."""
    N, V, K = _check_inputs(logits, targets, weights, A, B, C)
    dev = logits.device
    if losses is None:
        losses = torch.empty(N, dtype=torch.float32, device=dev)
    if stats is None:
        stats = torch.empty((2, N), dtype=torch.float32, device=dev)
    _check_out("losses", losses, (N,), torch.float32, dev)
    _check_out("stats", stats, (2, N), torch.float32, dev)
    for name, t in (("losses", losses), ("stats", stats)):
        if overlaps(t, logits) or overlaps(t, weights) or overlaps(t, targets):
            raise ValueError(f"softcapped_cross_entropy: {name} must not overlap the inputs in memory")
    if overlaps(losses, stats):
        raise ValueError("softcapped_cross_entropy: losses and stats must not overlap in memory")
    if N == 0:
        return losses, stats
    cfg = _config(logits, config)
    _ce_fwd_kernel[(N,)](
        logits, logits.stride(0), targets, weights, losses, stats, N, V, *_softcap_consts(A, B, C),
        K=K, PREFIX_AT=_prefix_at(targets, K), BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])
    return losses, stats


def softcapped_cross_entropy_bwd(grad, logits, stats, targets, weights, A, B, C, out=None, config=None):
    """dlogits (N, V) in logits' dtype, from the incoming gradient ``grad`` (N,) of the losses and the
    forward's ``stats``. ``out``: optional preallocated contiguous output."""
    N, V, K = _check_inputs(logits, targets, weights, A, B, C)
    dev = logits.device
    _check_grad(grad, N, dev)
    _check_out("stats", stats, (2, N), torch.float32, dev)
    if out is None:
        out = torch.empty((N, V), dtype=logits.dtype, device=dev)
    _check_out("out", out, (N, V), logits.dtype, dev)
    for name, t in (("grad", grad), ("logits", logits), ("stats", stats), ("targets", targets), ("weights", weights)):
        if overlaps(out, t):
            raise ValueError(f"softcapped_cross_entropy: out must not overlap {name} in memory")
    if N == 0:
        return out
    args = (grad, grad.stride(0), logits, logits.stride(0), stats, targets, weights, out)
    consts = (N, V, *_softcap_consts(A, B, C), float(A) / C)
    _launch_bwd(args, consts, K, _prefix_at(targets, K), _config(logits, config), e5m2=False)
    return out


def _softcap_consts(A, B, C):
    """(A, c1, c0) as the kernels take them: sigmoid((x + B) / C) = 1 / (1 + 2^(c1 x + c0)), c1 = -log2(e) / C,
    c0 = B c1 (computed in float64, rounded once to fp32 at the launch)."""
    c1 = -math.log2(math.e) / C
    return float(A), c1, float(B) * c1


def _e5m2_constant(A, C, scale):
    """A / (C * scale), the e5m2 kernels' one fp32 constant for A / C and 1 / scale, after checking ``scale``: the
    positive finite FP8 gradient scale (a Python float)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"softcapped_cross_entropy: scale must be a positive finite Python float, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softcapped_cross_entropy: scale must be a positive finite Python float, got {scale!r}")
    A_over_Cs = float(A) / C / scale
    if not abs(A_over_Cs) <= torch.finfo(torch.float32).max:
        raise ValueError(f"softcapped_cross_entropy: scale={scale!r} is too small: A / (C * scale) overflows fp32")
    return A_over_Cs


def _hw_fp8():
    """Whether the e5m2 rounding is the GPU's conversion (outside Triton's interpreter) or the interpreter-safe
    integer one (:func:`_to_e5m2`): the same bits."""
    return not interpreting()


def _launch_bwd(args, consts, K, prefix_at, cfg, e5m2):
    """The row kernel's dense pass, then the target pass (_ce_bwd_targets_kernel: TARGETS_BLOCK_R rows per program,
    K gathers and stores per row): dlogits in the output's dtype, or (e5m2) g8's bits into a uint8 view. ``args``:
    the kernels' tensor arguments up to the output; ``consts``: (N, V, A, c1, c0, A_over_C); prefix_at: _prefix_at's."""
    _ce_bwd_kernel[(consts[0],)](*args, *consts, K=K, PREFIX_AT=prefix_at, BLOCK_V=cfg["BLOCK_V"], E5M2=e5m2,
                                 HW_FP8=_hw_fp8(), num_warps=cfg["num_warps"])
    _ce_bwd_targets_kernel[(triton.cdiv(consts[0], TARGETS_BLOCK_R),)](
        *args, *consts, K=K, PREFIX_AT=prefix_at, BLOCK_R=TARGETS_BLOCK_R, E5M2=e5m2, HW_FP8=_hw_fp8(), num_warps=4)


def softcapped_cross_entropy_bwd_e5m2(grad, logits, stats, targets, weights, A, B, C, scale, out=None, out_t=None,
                                     config=None, transpose_config=None):
    """(g8, g8t): g8 (N, V) and g8t (V, N), contiguous torch.float8_e5m2, both holding SAT(RNE_e5m2(dlogits / scale))
    (the same bytes, g8t = g8.T), with dlogits the fp32 gradient of :func:`softcapped_cross_entropy_bwd` (module
    docstring). ``scale``: the positive finite FP8 gradient scale (Python float). ``out``/``out_t``: optional
    preallocated outputs. The row kernel writes g8 and kernels.transpose copies it into g8t. ``config``: the row
    kernel's dict(BLOCK_V=..., num_warps=...) overriding the default (BLOCK_V a power of two);
    ``transpose_config``: kernels.transpose's (BLOCK_M, BLOCK_N, num_warps) for g8t."""
    N, V, K = _check_inputs(logits, targets, weights, A, B, C)
    dev = logits.device
    _check_grad(grad, N, dev)
    _check_out("stats", stats, (2, N), torch.float32, dev)
    A_over_Cs = _e5m2_constant(A, C, scale)
    if out is None:
        out = torch.empty((N, V), dtype=torch.float8_e5m2, device=dev)
    if out_t is None:
        out_t = torch.empty((V, N), dtype=torch.float8_e5m2, device=dev)
    _check_out("out", out, (N, V), torch.float8_e5m2, dev)
    _check_out("out_t", out_t, (V, N), torch.float8_e5m2, dev)
    for oname, o in (("out", out), ("out_t", out_t)):
        for name, t in (("grad", grad), ("logits", logits), ("stats", stats), ("targets", targets),
                        ("weights", weights)):
            if overlaps(o, t):
                raise ValueError(f"softcapped_cross_entropy: {oname} must not overlap {name} in memory")
    if overlaps(out, out_t):
        raise ValueError("softcapped_cross_entropy: out and out_t must not overlap in memory")
    if N == 0:
        return out, out_t
    args = (grad, grad.stride(0), logits, logits.stride(0), stats, targets, weights, out.view(torch.uint8))
    consts = (N, V, *_softcap_consts(A, B, C), A_over_Cs)
    _launch_bwd(args, consts, K, _prefix_at(targets, K), _config(logits, config), e5m2=True)
    transpose_copy(out, out_t, config=transpose_config)
    return out, out_t


def _check_row_grad(row_grad):
    message = f"softcapped_cross_entropy: row_grad must be a finite Python float in fp32's range, got {row_grad!r}"
    if isinstance(row_grad, bool) or not isinstance(row_grad, (int, float)):
        raise TypeError(message)
    if not (math.isfinite(row_grad) and abs(row_grad) <= torch.finfo(torch.float32).max):
        raise ValueError(message)


def _same_view(a, b):
    """Whether ``a`` and ``b`` are the same elements in the same layout (an in-place output)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _sm_count(device):
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter: programs_per_sm is the grid)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fwd_grad_config(logits, config):
    if config is not None:
        return config
    if logits.device.type == "cpu":
        return INTERPRETER_FWD_GRAD_CONFIG
    return FWD_GRAD_CONFIG[logits.dtype]


def _launch_fwd_grad(logits, targets, weights, losses, out, A, B, C, row_grad, A_over_C, K, config, e5m2):
    """_ce_fwd_grad_kernel on programs_per_sm programs per SM (at most one per row; 0: one per row)."""
    N, V = logits.shape
    cfg = _fwd_grad_config(logits, config)
    per_sm = cfg.get("programs_per_sm", 0)
    grid = N if per_sm <= 0 else max(1, min(N, per_sm * _sm_count(logits.device)))
    _ce_fwd_grad_kernel[(grid,)](
        logits, logits.stride(0), targets, weights, losses, out, N, V, *_softcap_consts(A, B, C), float(row_grad),
        A_over_C, K=K, PREFIX_AT=_prefix_at(targets, K), BLOCK_V=cfg["BLOCK_V"], E5M2=e5m2, HW_FP8=_hw_fp8(),
        num_warps=cfg["num_warps"])


def _fwd_grad_losses(losses, out, logits, targets, weights, N, dev):
    """The losses output (allocated if None), checked, and checked against every other argument for overlaps."""
    if losses is None:
        losses = torch.empty(N, dtype=torch.float32, device=dev)
    _check_out("losses", losses, (N,), torch.float32, dev)
    for name, t in (("logits", logits), ("targets", targets), ("weights", weights), ("out", out)):
        if overlaps(losses, t):
            raise ValueError(f"softcapped_cross_entropy: losses must not overlap {name} in memory")
    for name, t in (("targets", targets), ("weights", weights)):
        if overlaps(out, t):
            raise ValueError(f"softcapped_cross_entropy: out must not overlap {name} in memory")
    return losses


def softcapped_cross_entropy_fwd_grad(logits, targets, weights, A, B, C, row_grad, losses=None, out=None,
                                      config=None):
    """(losses, dlogits) from one kernel: the per-row losses (N,) fp32 of :func:`softcapped_cross_entropy_fwd` and
    dlogits (N, V) in logits' dtype, the gradient of sum_t row_grad * loss_t (what
    :func:`softcapped_cross_entropy_bwd` gives for an incoming gradient of ``row_grad``, a finite Python float, on
    every row). ``out``: a preallocated contiguous output, or ``logits`` itself (contiguous) to write the gradient
    over the logits; ``losses``: a preallocated output; ``config``: dict(BLOCK_V=..., num_warps=...,
    programs_per_sm=...) overriding the per-dtype default (BLOCK_V a power of two)."""
    N, V, K = _check_inputs(logits, targets, weights, A, B, C)
    _check_row_grad(row_grad)
    dev = logits.device
    if out is None:
        out = torch.empty((N, V), dtype=logits.dtype, device=dev)
    _check_out("out", out, (N, V), logits.dtype, dev)
    if overlaps(out, logits) and not _same_view(out, logits):
        raise ValueError("softcapped_cross_entropy: out must be logits itself (in place) or not overlap it")
    losses = _fwd_grad_losses(losses, out, logits, targets, weights, N, dev)
    if N == 0:
        return losses, out
    _launch_fwd_grad(logits, targets, weights, losses, out, A, B, C, row_grad, float(A) / C, K, config, e5m2=False)
    return losses, out


def softcapped_cross_entropy_fwd_grad_e5m2(logits, targets, weights, A, B, C, row_grad, scale, losses=None,
                                           out=None, config=None):
    """(losses, g8) from one kernel: the per-row losses (N,) fp32 and g8 (N, V) contiguous torch.float8_e5m2, holding
    SAT(RNE_e5m2(dlogits / scale)) with dlogits the fp32 gradient of sum_t row_grad * loss_t (as
    :func:`softcapped_cross_entropy_bwd_e5m2`'s g8 for an incoming gradient of ``row_grad`` on every row; its
    transpose g8t is the caller's, e.g. kernels.transpose.transpose_copy). ``scale``: the positive finite FP8
    gradient scale (Python float). ``losses``/``out``: optional preallocated outputs (out must not overlap the
    logits); ``config`` as :func:`softcapped_cross_entropy_fwd_grad`."""
    N, V, K = _check_inputs(logits, targets, weights, A, B, C)
    _check_row_grad(row_grad)
    dev = logits.device
    A_over_Cs = _e5m2_constant(A, C, scale)
    if out is None:
        out = torch.empty((N, V), dtype=torch.float8_e5m2, device=dev)
    _check_out("out", out, (N, V), torch.float8_e5m2, dev)
    if overlaps(out, logits):
        raise ValueError("softcapped_cross_entropy: out must not overlap logits in memory")
    losses = _fwd_grad_losses(losses, out, logits, targets, weights, N, dev)
    if N == 0:
        return losses, out
    _launch_fwd_grad(logits, targets, weights, losses, out.view(torch.uint8), A, B, C, row_grad, A_over_Cs, K, config,
                     e5m2=True)
    return losses, out


# ---------------------------------------------------------------------------------------------------------
# Autograd (custom ops, traceable by torch.compile)
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("speedrun::softcapped_ce_fwd", mutates_args=())
def _ce_fwd_op(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
               A: float, B: float, C: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return softcapped_cross_entropy_fwd(logits, targets, weights, A, B, C)


@_ce_fwd_op.register_fake
def _(logits, targets, weights, A, B, C):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((2, n), dtype=torch.float32)


@torch.library.custom_op("speedrun::softcapped_ce_bwd", mutates_args=())
def _ce_bwd_op(grad: torch.Tensor, logits: torch.Tensor, stats: torch.Tensor, targets: torch.Tensor,
               weights: torch.Tensor, A: float, B: float, C: float) -> torch.Tensor:
    return softcapped_cross_entropy_bwd(grad, logits, stats, targets, weights, A, B, C)


@_ce_bwd_op.register_fake
def _(grad, logits, stats, targets, weights, A, B, C):
    return logits.new_empty(tuple(logits.shape))


def _ce_setup_context(ctx, inputs, output):
    logits, targets, weights, A, B, C = inputs
    ctx.save_for_backward(logits, output[1], targets, weights)
    ctx.abc = (A, B, C)
    ctx.mark_non_differentiable(output[1])


def _ce_backward_rule(ctx, grad_losses, grad_stats):
    # stats is an internal output marked non-differentiable: grad_stats is None or zeros and is ignored.
    logits, stats, targets, weights = ctx.saved_tensors
    dlogits = None
    if ctx.needs_input_grad[0]:
        dlogits = _ce_bwd_op(grad_losses.float(), logits, stats, targets, weights, *ctx.abc)
    return dlogits, None, None, None, None, None


torch.library.register_autograd("speedrun::softcapped_ce_fwd", _ce_backward_rule, setup_context=_ce_setup_context)


def softcapped_cross_entropy(logits, targets, weights, A, B, C):
    """Per-row losses (N,) fp32 of the module docstring, differentiable in ``logits`` (fused backward)."""
    if isinstance(targets, torch.Tensor) and isinstance(weights, torch.Tensor):
        targets, weights = targets.contiguous(), weights.contiguous()   # (N,) and (K,): cheap copies if any
    _check_inputs(logits, targets, weights, A, B, C)
    return _ce_fwd_op(logits, targets, weights, float(A), float(B), float(C))[0]


# ---------------------------------------------------------------------------------------------------------
# The FP8 LM head and its loss (custom ops, traceable by torch.compile)
# ---------------------------------------------------------------------------------------------------------
def round_to_bf16(v):
    """fp32 v rounded to the nearest bf16 value (ties to even), as fp32, by integer arithmetic on its bits (a NaN is
    returned as it is). Unlike ``v.to(torch.bfloat16)``, this rounding happens where it is written inside a compiled
    region too: inductor computes a fused chain of bf16 operations in fp32 and rounds only what it stores."""
    bits = v.view(torch.int32)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -0x10000  # add half an ulp (less at a tie to an even ulp), cut
    return torch.where(v.isnan(), v, bits.view(torch.float32))  # a NaN's payload could carry into its sign


def fp8_e4m3(t, scale):
    """The FP8 head's e4m3 copy of t / scale as eager PyTorch computes it: the quotient in t's dtype (computed in
    fp32, rounded to t's dtype), then cast (round to nearest, ties to even). Traced by torch.compile with bf16 t, the
    two bf16 roundings are written out (round_to_bf16): there t may be an fp32 value inductor never rounded (a norm's
    output inside the norm's own kernel), and the copy still has the bits eager gives for the stored t. (A scalar
    divisor: CUDA and inductor multiply by its fp32 reciprocal, the CPU divides: the same in eager and compiled code
    on each.) fp16 t traced: the plain expression, whose roundings inductor may skip."""
    if t.dtype == torch.bfloat16 and torch.compiler.is_compiling():
        return round_to_bf16(round_to_bf16(t.float()) / scale).to(torch.float8_e4m3fn)
    return (t / scale).to(torch.float8_e4m3fn)


class Fp8Weights(NamedTuple):
    """The FP8 head's weight operands, :func:`fp8_head_weights` of the head W (C, V): contiguous e4m3 tensors."""
    w8: torch.Tensor  # (C, V) fp8_e4m3(W, w_s): the backward's dx = g8 @ w8^T reads it (as w8.T, column-major)
    w8t: torch.Tensor  # (V, C) w8's transpose, the same bytes: the forward's logits = x8 @ w8 read it (as w8t.T)


def fp8_head_weights(w, w_s):
    """The e4m3 operands of the head w (C, V) at scale w_s, for :func:`fp8_head_ce` and
    :func:`fp8_head_ce_grad_in_fwd`: made once per value of w (train_gpt.py: once per optimizer step) rather than in
    every call. Not differentiable (the ops give w its gradient)."""
    w8 = fp8_e4m3(w.detach(), w_s)
    return Fp8Weights(w8, _transposed(w8))


def _check_fp8_operands(x, w, x8, w8, w8t):
    """x8 must be fp8_e4m3(x, x_s)'s layout, w8 and w8t fp8_head_weights' for w (C, V): a shape or dtype mistake
    fails here, not in a matmul. (Their values are not checked: that would read them.)"""
    C, V = w.shape
    for name, t, shape, maker in (("x8", x8, tuple(x.shape), "fp8_e4m3 of x"), ("w8", w8, (C, V), "fp8_head_weights"),
                                  ("w8t", w8t, (V, C), "fp8_head_weights")):
        if t.dtype != torch.float8_e4m3fn or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"fp8 head: {name} must be a contiguous float8_e4m3fn {shape} tensor ({maker}), got "
                             f"{t.dtype} {tuple(t.shape)}")


@torch.library.custom_op("speedrun::fp8_head_ce", mutates_args=())
def fp8_head_ce(x: torch.Tensor, w: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, w8t: torch.Tensor,
                targets: torch.Tensor, weights: torch.Tensor, x_s: float, w_s: float, grad_s: float, A: float,
                B: float, C: float, grad_s_div: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training head and its loss in one op: per-row losses (N,) fp32 of this module's soft-capped
    multi-token CE of the logits x (N, C) @ w (C, V), computed in FP8 (e4m3 copies x / x_s and w / w_s, fp32
    accumulation, logits in x's dtype). x8 = fp8_e4m3(x, x_s) and w8, w8t = fp8_head_weights(w, w_s) are what the
    op multiplies (x and w are not read; they take the gradients). Also returns what the backward reads: the
    logits and the CE stats. The backward's e5m2 gradient scale is grad_s / grad_s_div (FP8_GRAD_S)."""
    _check_fp8_operands(x, w, x8, w8, w8t)
    logits = _fp8_logits(x8, w8t, x_s, w_s, x.dtype)
    losses, stats = softcapped_cross_entropy_fwd(logits, targets, weights, A, B, C)
    return losses, logits, stats


def _fp8_logits(x8, w8t, x_s, w_s, dtype):
    """logits = x8 @ w8 x_s w_s in ``dtype`` (torch._scaled_mm, fast accumulation), w8 read column-major as w8t.T."""
    one = torch.ones((), dtype=torch.float32, device=x8.device)  # a fill, not a host-to-device copy
    return torch._scaled_mm(x8, w8t.T, scale_a=one * x_s, scale_b=one * w_s, out_dtype=dtype, use_fast_accum=True)


@fp8_head_ce.register_fake
def _(x, w, x8, w8, w8t, targets, weights, x_s, w_s, grad_s, A, B, C, grad_s_div=1):
    N, V = x.shape[0], w.shape[1]
    return x.new_empty(N, dtype=torch.float32), x.new_empty(N, V), x.new_empty(2, N, dtype=torch.float32)


@torch.library.custom_op("speedrun::fp8_head_ce_bwd", mutates_args=())
def fp8_head_ce_bwd(grad: torch.Tensor, logits: torch.Tensor, stats: torch.Tensor, targets: torch.Tensor,
                    weights: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, x_s: float, w_s: float, grad_s: float,
                    A: float, B: float, C: float, grad_s_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of fp8_head_ce. The CE backward writes the logits' gradient as e5m2 (dlogits / grad_s) in the
    two layouts the FP8 matmuls need, g8 (N, V) and g8t (V, N), with no bf16 gradient in between: the row kernel
    writes g8 and kernels.transpose copies it into g8t. dx = g @ w^T and dw = x^T @ g (C, V) come out in the logits'
    dtype, fp32 accumulation (no fast accumulation in the backward, as in the record). The scale is grad_s /
    grad_s_div (FP8_GRAD_S)."""
    grad_s = grad_s / grad_s_div
    g8, g8t = softcapped_cross_entropy_bwd_e5m2(grad, logits, stats, targets, weights, A, B, C, grad_s)
    one = torch.ones((), dtype=torch.float32, device=grad.device)
    return _fp8_head_grads(g8, g8t, x8, w8, one * grad_s, x_s, w_s, logits.dtype)


def _fp8_head_grads(g8, g8t, x8, w8, s_g, x_s, w_s, dtype):
    """(dx, dw) = (g8 @ w8^T s_g w_s, x8^T @ g8 x_s s_g) in ``dtype`` by torch._scaled_mm (fp32 accumulation, no fast
    accumulation); g8t (V, N) is g8's transpose, s_g the gradient's scale, a 0-d fp32 tensor on the device."""
    one = torch.ones((), dtype=torch.float32, device=g8.device)
    dx = torch._scaled_mm(g8, w8.T, scale_a=s_g, scale_b=one * w_s, out_dtype=dtype)
    dw = torch._scaled_mm(_transposed(x8), g8t.T, scale_a=one * x_s, scale_b=s_g, out_dtype=dtype)
    return dx, dw


def _transposed(t8):
    """A fresh contiguous copy of the 2-D FP8 tensor t8's transpose, by kernels.transpose (the same bytes as
    ``t8.T.contiguous()``, whose copy kernel moves one byte per thread)."""
    out = torch.empty((t8.shape[1], t8.shape[0]), dtype=t8.dtype, device=t8.device)
    return transpose_copy(t8, out)


@fp8_head_ce_bwd.register_fake
def _(grad, logits, stats, targets, weights, x8, w8, x_s, w_s, grad_s, A, B, C, grad_s_div=1):
    return logits.new_empty(x8.shape), logits.new_empty(w8.shape)


def _fp8_head_ce_setup(ctx, inputs, output):
    _, _, x8, w8, _, targets, weights, *ctx.consts = inputs
    _, logits, stats = output
    ctx.save_for_backward(logits, stats, targets, weights, x8, w8)
    ctx.mark_non_differentiable(logits, stats)


def _fp8_head_ce_backward(ctx, grad_losses, *_):
    dx, dw = fp8_head_ce_bwd(grad_losses.float(), *ctx.saved_tensors, *ctx.consts)
    return (dx, dw) + (None,) * 12         # x8, w8, w8t, targets, weights, x_s, w_s, grad_s, A, B, C, grad_s_div


fp8_head_ce.register_autograd(_fp8_head_ce_backward, setup_context=_fp8_head_ce_setup)


# ---------------------------------------------------------------------------------------------------------
# The head and its loss with the gradient written in the forward (custom ops, traceable by torch.compile)
# ---------------------------------------------------------------------------------------------------------
def _check_grad_scale(grad_scale):
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)):
        raise TypeError(f"softcapped_cross_entropy: grad_scale must be a nonzero finite Python float, got "
                        f"{grad_scale!r}")
    if not math.isfinite(grad_scale) or grad_scale == 0:
        raise ValueError(f"softcapped_cross_entropy: grad_scale must be a nonzero finite Python float, got "
                         f"{grad_scale!r}")


@torch.library.custom_op("speedrun::head_ce_grad_in_fwd", mutates_args=())
def head_ce_grad_in_fwd(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                        grad_scale: float, A: float, B: float, C: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The head x (N, C) @ w (C, V) (logits in x's dtype) and the mean over rows of this module's soft-capped
    multi-token CE, with the gradient written in the forward: (loss, g), loss 0-d fp32 and g (N, V) in x's dtype
    the gradient of grad_scale * loss in the logits (one kernel, :func:`softcapped_cross_entropy_fwd_grad`, written
    over the logits, which are not kept). The backward (autograd) scales by r = grad / grad_scale on the device:
    dx = (g @ w^T) r, dw = (x^T @ g) r (module docstring)."""
    _check_grad_scale(grad_scale)
    logits = x @ w
    N = logits.shape[0]
    losses, g = softcapped_cross_entropy_fwd_grad(logits, targets, weights, A, B, C, grad_scale / max(N, 1),
                                                  out=logits)
    return losses.mean(), g


@head_ce_grad_in_fwd.register_fake
def _(x, w, targets, weights, grad_scale, A, B, C):
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], w.shape[1])


def _head_ce_grad_in_fwd_setup(ctx, inputs, output):
    x, w, _, _, ctx.grad_scale, *_ = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.mark_non_differentiable(output[1])


def _head_ce_grad_in_fwd_backward(ctx, grad_loss, _):
    x, w, g = ctx.saved_tensors
    r = grad_loss.float() / ctx.grad_scale              # 0-d, on the device: exactly 1 for grad_loss == grad_scale
    dx = (g @ w.T) * r if ctx.needs_input_grad[0] else None
    dw = (x.T @ g) * r if ctx.needs_input_grad[1] else None
    return (dx, dw) + (None,) * 6                         # targets, weights, grad_scale, A, B, C


head_ce_grad_in_fwd.register_autograd(_head_ce_grad_in_fwd_backward, setup_context=_head_ce_grad_in_fwd_setup)


@torch.library.custom_op("speedrun::fp8_head_ce_grad_in_fwd", mutates_args=())
def fp8_head_ce_grad_in_fwd(x: torch.Tensor, w: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor, w8t: torch.Tensor,
                            targets: torch.Tensor, weights: torch.Tensor, x_s: float, w_s: float, grad_s: float,
                            grad_scale: float, A: float, B: float, C: float,
                            grad_s_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_head_ce`'s head (the caller's e4m3 copies, FP8 logits in x's dtype) and the mean over rows of its
    loss, with the gradient written in the forward: (loss, g8), loss 0-d fp32, g8 (N, V) e5m2 the gradient of
    grad_scale * loss in the logits divided by grad_s / grad_s_div (FP8_GRAD_S; one kernel,
    :func:`softcapped_cross_entropy_fwd_grad_e5m2`; the logits are freed when this returns). The backward multiplies
    g8 by x8 and w8."""
    _check_grad_scale(grad_scale)
    _check_fp8_operands(x, w, x8, w8, w8t)
    grad_s = grad_s / grad_s_div
    logits = _fp8_logits(x8, w8t, x_s, w_s, x.dtype)
    N = logits.shape[0]
    losses, g8 = softcapped_cross_entropy_fwd_grad_e5m2(logits, targets, weights, A, B, C, grad_scale / max(N, 1),
                                                        grad_s)
    return losses.mean(), g8


@fp8_head_ce_grad_in_fwd.register_fake
def _(x, w, x8, w8, w8t, targets, weights, x_s, w_s, grad_s, grad_scale, A, B, C, grad_s_div=1):
    return x.new_empty((), dtype=torch.float32), x.new_empty(x.shape[0], w.shape[1], dtype=torch.float8_e5m2)


@torch.library.custom_op("speedrun::fp8_head_ce_grad_in_fwd_bwd", mutates_args=())
def fp8_head_ce_grad_in_fwd_bwd(grad: torch.Tensor, g8: torch.Tensor, x8: torch.Tensor, w8: torch.Tensor,
                                x_s: float, w_s: float, grad_s: float, grad_scale: float,
                                dtype: torch.dtype, grad_s_div: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of fp8_head_ce_grad_in_fwd for the loss's gradient ``grad`` (0-d): g8t = g8^T by kernels.transpose,
    then :func:`fp8_head_ce_bwd`'s two FP8 matmuls with the gradient's scale grad_s * r, grad_s here grad_s /
    grad_s_div and r = grad / grad_scale (a device tensor: exactly grad_s for grad == grad_scale, and for any grad
    applied to the fp32 accumulator before the one rounding of dx and dw to ``dtype``)."""
    s_g = grad.float() / grad_scale * (grad_s / grad_s_div)
    return _fp8_head_grads(g8, _transposed(g8), x8, w8, s_g, x_s, w_s, dtype)


@fp8_head_ce_grad_in_fwd_bwd.register_fake
def _(grad, g8, x8, w8, x_s, w_s, grad_s, grad_scale, dtype, grad_s_div=1):
    return x8.new_empty(x8.shape, dtype=dtype), w8.new_empty(w8.shape, dtype=dtype)


def _fp8_head_ce_grad_in_fwd_setup(ctx, inputs, output):
    x, _, x8, w8, _, _, _, x_s, w_s, grad_s, grad_scale, _, _, _, grad_s_div = inputs
    ctx.save_for_backward(output[1], x8, w8)
    ctx.consts = (x_s, w_s, grad_s, grad_scale, x.dtype, grad_s_div)
    ctx.mark_non_differentiable(output[1])


def _fp8_head_ce_grad_in_fwd_backward(ctx, grad_loss, *_):
    dx, dw = fp8_head_ce_grad_in_fwd_bwd(grad_loss, *ctx.saved_tensors, *ctx.consts)
    return (dx, dw) + (None,) * 13  # x8, w8, w8t, targets, weights, x_s, w_s, grad_s, grad_scale, A, B, C, grad_s_div


fp8_head_ce_grad_in_fwd.register_autograd(_fp8_head_ce_grad_in_fwd_backward,
                                          setup_context=_fp8_head_ce_grad_in_fwd_setup)


def fp8_head_support(device):
    """(usable, reason): torch._scaled_mm with e4m3 needs a CUDA GPU of capability >= 8.9 (Ada, Hopper)."""
    if device.type != "cuda":
        return False, f"no FP8 matmul on {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"capability {cap[0]}.{cap[1]} < 8.9"
    return True, f"capability {cap[0]}.{cap[1]}"
