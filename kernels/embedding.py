"""Deterministic embedding backward (no floating-point atomics) and an autograd-aware lookup.

Math. For ids of any shape holding N positions and a gradient ``grad_out`` of shape ids.shape + (C,),

    dW[v, :] = sum of grad_out[p, :] over the positions p with ids[p] == v        dW: (V, C)

Rows no id touches are zero.

Accumulate mode (``embedding_backward_accumulate``): for an fp32 accumulator acc (V, C), any row stride,

    acc[v, :] = acc[v, :] + float(round(dW[v, :]))        for every id v in ids; other rows not written

with the same fp32 sum and the same one rounding (to the gradient's dtype) as dW, so acc ends bitwise equal to
``acc.add_(embedding_backward(...))``. An untouched row there gets acc + 0.0, which equals acc for every value
but -0.0 (-0.0 + 0.0 = +0.0 under round to nearest), and for NaN up to the payload. An optimizer accumulator
never holds -0.0: it starts at +0.0 (zeros), and a sum x + y rounded to nearest is -0.0 only when x and y are
both -0.0, so adding anything to a value that is not -0.0 never makes one. (Nor is a rounded segment sum ever
-0.0: it starts from +0.0, and its terms are values of the dtype it is rounded to, so a nonzero sum is at least
that dtype's smallest subnormal in magnitude and does not round to zero.) The mode saves the dense (V, C)
gradient, its write and read, and the read and write of every untouched accumulator row (see Traffic).

The speedrun calls this for the token embedding and the value embeddings
(N = 16384 / 32768 / 49152 tokens per micro-step, C = 768, V = 50304), all indexed by the same ids, so one
:class:`EmbeddingPrep` serves them, and for the bigram table (indexed by the tokens' bigram hashes, with a
prep of its own; V = its rows).

Summation order (this defines the bits; it depends on the ids and the constant ``PIECE`` only, never on the
launch configuration). Positions are stably sorted by id, so the positions of id v form one segment
``[row_ptr[v], row_ptr[v+1])`` of the sorted order, in increasing position order.
  * Segments of at most ``PIECE`` positions are summed sequentially in fp32, starting from +0.0:
    ``((0 + g_0) + g_1) + ...``.
  * Longer segments (frequent ids) are cut at the global tile boundaries of the sorted order (tiles of
    ``PIECE`` positions: [0, PIECE), [PIECE, 2*PIECE), ...). Each piece is summed sequentially as above, and
    the piece partials are added sequentially in tile order. A long segment has more than PIECE positions, so
    a tile meets at most two long segments: the one holding its first position and the one holding its last.
  * The fp32 total is rounded once to the output dtype, to nearest even.
``embedding_backward_ordered_ref`` reproduces this order in plain PyTorch, so tests compare bit for bit.

Kernels (no host synchronisation when a prep is given: every grid depends only on N, C and V):
  1. ``_embedding_bwd_kernel``, grid (ceil(2*T/ROWS) + ceil(V/ROWS), ceil(C/BLOCK_C)) with T = ceil(N/PIECE).
     The first programs compute the piece partials of long segments (item 2*t + side: side 0 = the segment
     holding tile t's first position, side 1 = the one holding its last, when it starts inside the tile) into
     an fp32 scratch (2*T, C). The other programs own ROWS output rows x BLOCK_C channels: they sum every short
     segment, round and write it (accumulate mode: read, add, write), and write zeros for untouched rows, so
     zeroing is fused (accumulate mode: untouched rows are not written at all). Every program works
     on ROWS segments at once, each with its own sequential loop, UNROLL steps per iteration so that UNROLL
     gathers are in flight; no program walks more than PIECE positions, so a skewed id cannot serialise it.
  2. ``_embedding_bwd_combine_kernel``, grid (ceil(T/ROWS), ceil(C/BLOCK_C)): for each long segment (found as
     the one holding the last position of the tile where it starts) add its partials in tile order, round and
     write the row (accumulate mode: read, add, write).
  The modes are one constexpr flag (ACCUMULATE) of the same two kernels. Each output row has one owner, so
  the read-add-write needs no atomics: the row programs write the rows of short segments (at most PIECE
  positions) and skip long ones; the combine kernel writes each long segment once (one lane per segment: the
  tile where it starts), after the first kernel.
Traffic for N=49152, C=768, V=50304, bf16: read 75.5 MB of gradient, write 77.3 MB of weight gradient,
plus 0.4 MB of prep tables: ~36 us at the H200's 4.3 TB/s. Adding that gradient into an fp32 accumulator
(``acc.add_``) moves 77.3 MB + 2 x 154.5 MB more: 539 MB in all, ~125 us. The accumulate mode reads the
gradient and reads and writes the U touched rows of acc (8 bytes per element): U = 31307 for uniform ids (268
MB, ~62 us), 12613 for Zipf ids (153 MB, ~36 us). For the bigram table (V = 251520) dense + add is 2.4 GB,
accumulate at most 0.38 GB (every id distinct).

Dtypes: grad_out bf16 / fp16 / fp32; the output has grad_out's dtype (the weight's, under autograd); all sums
in fp32; the accumulate mode's acc is fp32 and its sums are rounded to grad_out's dtype. ids int32 or int64.

Preparation (``prepare_ids``): a stable sort of the ids plus CSR row offsets. On the CPU (the data loader's
background thread) it is free of GPU synchronisation; ``.pin_memory()`` and ``.to(device, non_blocking=True)``
ship it with the batch. Without a prep, ``embedding_backward`` prepares on the ids' device: torch.sort, and a
host synchronisation to validate the id range (``.item()``).

Used by train_gpt.py through :func:`embedding`: on the GPU the lookups run eagerly before the compiled region,
and their backward after its backward (on the CPU the trainer uses torch's own embedding, :func:`cpu_embedding`). The forward is a plain
gather. Eagerly, :func:`embedding` is a ``torch.autograd.Function`` that calls the forward gather and the
launchers directly; under ``torch.compile`` it traces the custom ops ``speedrun::embedding_fwd``,
``speedrun::embedding_bwd`` and ``speedrun::embedding_bwd_accumulate`` instead (``fullgraph=True``). Both paths
run the same kernels, so they give the same bits; the eager one skips torch.library's Python dispatch of a custom
op, which costs host time on every call of a step that launches its work from Python.
``embedding(ids, weight, prep, acc=acc)`` selects the accumulate mode: the backward adds into acc and gives the
weight no gradient. train_gpt.py passes the optimizer's accumulators on CUDA (--embed-grad-to-acc, the default;
--no-embed-grad-to-acc gives the tables dense gradients instead).
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._checks import interpreting


# Positions per piece of a long segment: part of the summation order (changing it changes the bits), not a
# launch parameter. It bounds the sequential work of one program (a program walks at most PIECE positions)
# and the number of partials of the longest segment (N / PIECE: 768 when all 49152 ids are equal). 64 keeps
# both short for the Zipf-distributed ids of real text.
PIECE = 64

# Launch configuration: rows (segments) per program, channels per program, loop unrolling (gathers in flight
# per segment), warps. Picked because ptxas (sm_90a) reports 110 registers and no spills for it, against 168
# and spills for ROWS=16, BLOCK_C=128. Tuned on one H200 (`python -m benchmarks --only embedding --tune`,
# N=49152, C=768, V=50304, bf16 out): the fastest candidate on Zipf-distributed ids, those of real text (a
# candidate with more rows per program is faster on uniform ids only; times in notes/measurements.md).
DEFAULT_CONFIG = dict(ROWS=8, BLOCK_C=256, UNROLL=8, num_warps=4)
# Under TRITON_INTERPRET=1 (CPU) the cost is per program, so the default uses 8x more rows per program: about
# 10x faster in the interpreter, with the same bits (the summation order depends on the ids and PIECE only).
INTERPRETER_CONFIG = dict(ROWS=64, BLOCK_C=64, UNROLL=8, num_warps=4)
# Candidates for the benchmark's tuning mode (bench_cases(tune=True)); none of them changes the bits.
TUNING_CANDIDATES = [
    dict(ROWS=8, BLOCK_C=256, UNROLL=8, num_warps=4),
    dict(ROWS=16, BLOCK_C=128, UNROLL=8, num_warps=4),
    dict(ROWS=16, BLOCK_C=256, UNROLL=4, num_warps=4),
    dict(ROWS=8, BLOCK_C=128, UNROLL=8, num_warps=2),
    dict(ROWS=16, BLOCK_C=256, UNROLL=8, num_warps=8),
    dict(ROWS=4, BLOCK_C=256, UNROLL=16, num_warps=4),
]

_ID_DTYPES = (torch.int32, torch.int64)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_INT32_MAX = 2 ** 31 - 1


# ---------------------------------------------------------------------------------------------------------
# Preparation of the ids (CPU data loader or device)
# ---------------------------------------------------------------------------------------------------------
class EmbeddingPrep(NamedTuple):
    """Sorted view of one batch of ids; depends only on the ids and num_embeddings."""
    order: torch.Tensor       # (N,) int32: positions sorted by id, ties in position order (stable)
    sorted_ids: torch.Tensor  # (N,) int32: ids[order]
    row_ptr: torch.Tensor     # (V+1,) int32: id v occupies sorted positions row_ptr[v] : row_ptr[v+1]
    num_embeddings: int       # V
    n: int                    # N, the number of ids

    def to(self, device, non_blocking=False):
        return self._replace(order=self.order.to(device, non_blocking=non_blocking),
                             sorted_ids=self.sorted_ids.to(device, non_blocking=non_blocking),
                             row_ptr=self.row_ptr.to(device, non_blocking=non_blocking))

    def pin_memory(self):
        return self._replace(order=self.order.pin_memory(), sorted_ids=self.sorted_ids.pin_memory(),
                             row_ptr=self.row_ptr.pin_memory())


def _check_ids_dtype(ids):
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")


def _check_num_embeddings(num_embeddings):
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int):
        raise TypeError(f"num_embeddings must be an int, got {type(num_embeddings).__name__}")
    if not 0 < num_embeddings < _INT32_MAX:
        raise ValueError(f"num_embeddings must be in [1, 2^31 - 1), got {num_embeddings}")


def prepare_ids(ids, num_embeddings):
    """Stable sort of ``ids`` (any shape, int32/int64) and CSR row offsets, on ids' device.

    Validates 0 <= id < num_embeddings (a host synchronisation when ids live on a GPU)."""
    _check_ids_dtype(ids)
    _check_num_embeddings(num_embeddings)
    flat = ids.reshape(-1)
    n = flat.numel()
    if n > _INT32_MAX:
        raise ValueError(f"at most 2^31 - 1 ids are supported (int32 positions), got {n}")
    if n:
        lo, hi = torch.aminmax(flat)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= num_embeddings:
            bad = lo if lo < 0 else hi
            raise ValueError(f"ids out of range: found id {bad}, expected 0 <= id < {num_embeddings}")
    sorted_ids, order = torch.sort(flat, stable=True)
    sorted_ids = sorted_ids.to(torch.int32)
    bounds = torch.arange(num_embeddings + 1, dtype=torch.int32, device=flat.device)
    row_ptr = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    return EmbeddingPrep(order.to(torch.int32), sorted_ids, row_ptr, num_embeddings, n)


def _check_prep(prep, num_embeddings, n, device):
    if not isinstance(prep, EmbeddingPrep):
        raise TypeError(f"prep must be an EmbeddingPrep (from prepare_ids), got {type(prep).__name__}")
    if prep.num_embeddings != num_embeddings:
        raise ValueError(f"prep was made for num_embeddings={prep.num_embeddings}, but num_embeddings is "
                         f"{num_embeddings}")
    if prep.n != n:
        raise ValueError(f"prep was made for N={prep.n} ids, but ids has {n} elements")
    for name, t, length in (("order", prep.order, n), ("sorted_ids", prep.sorted_ids, n),
                            ("row_ptr", prep.row_ptr, num_embeddings + 1)):
        if t.dtype != torch.int32 or t.shape != (length,):
            raise ValueError(f"prep.{name} must be int32 of shape ({length},), got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"prep.{name} is on {t.device} but grad_out is on {device}: call prep.to(device)")


# ---------------------------------------------------------------------------------------------------------
# Pure-PyTorch references
# ---------------------------------------------------------------------------------------------------------
def embedding_backward_ref(grad_out, ids, num_embeddings, dtype=torch.float64):
    """dW = zeros(V, C).index_add_(0, ids, grad_out) computed in ``dtype`` (float64 by default) on the CPU."""
    C = grad_out.shape[-1]
    g = grad_out.detach().reshape(-1, C).to("cpu", dtype)
    out = torch.zeros(num_embeddings, C, dtype=dtype)
    return out.index_add_(0, ids.reshape(-1).to("cpu", torch.int64), g)


def embedding_backward_ordered_ref(grad_out, ids, num_embeddings):
    """The kernel's fp32 sum, bit for bit: the summation order of the module docstring, in plain PyTorch.

    Returns the fp32 (V, C) sum on the CPU; round it with ``.to(dtype)`` (nearest even) for the output."""
    C = grad_out.shape[-1]
    g = grad_out.detach().reshape(-1, C).to("cpu", torch.float32)
    prep = prepare_ids(ids.to("cpu"), num_embeddings)
    order, row_ptr = prep.order.long(), prep.row_ptr.long()
    gs = g[order]                                                   # gradient rows in sorted order
    out = torch.zeros(num_embeddings, C, dtype=torch.float32)
    counts = row_ptr[1:] - row_ptr[:-1]

    def sequential_sums(lo, cnt):                                   # one fp32 sum per (lo, cnt) item
        acc = torch.zeros(lo.numel(), C, dtype=torch.float32)
        for j in range(int(cnt.max()) if cnt.numel() else 0):
            take = cnt > j
            acc[take] = acc[take] + gs[lo[take] + j]
        return acc

    short = torch.nonzero((counts > 0) & (counts <= PIECE)).reshape(-1)
    out[short] = sequential_sums(row_ptr[short], counts[short])
    for v in torch.nonzero(counts > PIECE).reshape(-1).tolist():     # long segments: pieces per global tile
        lo, hi = int(row_ptr[v]), int(row_ptr[v + 1])
        starts = [lo] + list(range((lo // PIECE + 1) * PIECE, hi, PIECE))
        ends = starts[1:] + [hi]
        parts = sequential_sums(torch.tensor(starts), torch.tensor(ends) - torch.tensor(starts))
        acc = torch.zeros(C, dtype=torch.float32)
        for k in range(parts.shape[0]):
            acc = acc + parts[k]
        out[v] = acc
    return out


def embedding_backward_accumulate_ref(grad_out, ids, acc):
    """The accumulate mode's result, bit for bit, as a new fp32 tensor on the CPU (acc is left alone): every
    touched row v is acc[v] + float(round(s[v])), s the ordered fp32 sum above and round to grad_out's dtype
    (nearest even); untouched rows are acc's, whatever they hold."""
    V = acc.shape[0]
    s = embedding_backward_ordered_ref(grad_out, ids, V)
    out = acc.detach().to("cpu", copy=True)
    touched = torch.bincount(ids.reshape(-1).to("cpu", torch.int64), minlength=V) > 0
    out[touched] = out[touched] + s[touched].to(grad_out.dtype).float()
    return out


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _sequential_sums(
    # gradient rows (N, C) and the sorted positions
    grad_ptr, stride_gn, stride_gc, order_ptr,
    # ROWS segments: first sorted position, length, whether to sum it at all
    lo, cnt, active,
    # channels of this program
    cols, cmask,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
):
    """fp32 sums ((0 + g_lo) + g_lo+1) + ... of ROWS segments at once, each strictly in sorted order.

    Finished segments are left untouched by tl.where (not even given + 0.0) during the extra steps that the
    longest segment of the block forces on them, so the bits cannot depend on ROWS or UNROLL."""
    n_steps = tl.max(tl.where(active, cnt, 0), axis=0)
    acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
    for j0 in range(0, n_steps, UNROLL):
        for u in tl.static_range(UNROLL):
            take = active & (j0 + u < cnt)
            pos = tl.load(order_ptr + lo + j0 + u, mask=take, other=0)
            g = tl.load(grad_ptr + pos.to(tl.int64)[:, None] * stride_gn + cols[None, :] * stride_gc,
                        mask=take[:, None] & cmask[None, :], other=0.0)
            acc = tl.where(take[:, None], acc + g.to(tl.float32), acc)
    return acc


@triton.jit
def _round(acc, DTYPE: tl.constexpr):
    """acc (fp32) rounded to DTYPE to nearest even: the one rounding of a sum."""
    if DTYPE == tl.bfloat16:
        # Rounding in integer arithmetic: add 0x7FFF plus the last kept bit below bf16's last mantissa bit,
        # then truncate the low 16 bits (round to nearest even). Done by hand rather than by .to(tl.bfloat16)
        # so that the Triton interpreter (which truncates) gives the GPU's bits; overflow carries into inf.
        bits = acc.to(tl.uint32, bitcast=True)
        inc = 0x7FFF + ((bits >> 16) & 1)
        rounded = ((bits + inc) & 0xFFFF0000).to(tl.float32, bitcast=True)
        val = tl.where(acc != acc, acc, rounded).to(tl.bfloat16)   # NaN payloads could carry into inf
    else:
        val = acc.to(DTYPE)
    return val


@triton.jit
def _store_rows(
    # output rows (V, C) and the rows/channels of this block
    out_ptr, stride_on, rows, cols, mask,
    # fp32 sums to write
    acc,
    # the weight's dtype (the rounding); accumulate mode: out is fp32 and the rounded sums are added to it
    DTYPE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Dense: out = round(acc) (out has dtype DTYPE). Accumulate: out += float(round(acc)) in fp32, the very
    rounding and then the fp32 add that ``out.add_(dense output)`` does. One program owns each (row, channel)."""
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_on + cols[None, :]
    val = _round(acc, DTYPE)
    if ACCUMULATE:
        old = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, old + val.to(tl.float32), mask=mask)
    else:
        tl.store(ptrs, val, mask=mask)


@triton.jit
def _embedding_bwd_kernel(
    # gradient rows (N, C), any strides
    grad_ptr, stride_gn, stride_gc,
    # prep: sorted positions (N,), sorted ids (N,), CSR row offsets (V+1,)
    order_ptr, sorted_ids_ptr, row_ptr_ptr,
    # output (V, C) with unit channel stride; fp32 scratch (2*T, C) for piece partials of long segments
    out_ptr, stride_on, partial_ptr,
    # sizes; programs [0, num_piece_blocks) compute piece partials, the rest own output rows
    N, V, C, num_piece_blocks,
    PIECE: tl.constexpr,
    # the weight's dtype (the rounding); accumulate mode: out is the fp32 accumulator, untouched rows unwritten
    DTYPE: tl.constexpr, ACCUMULATE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    if pid < num_piece_blocks:
        # Piece partials: item 2*t + side of tile t = sorted positions [t*PIECE, (t+1)*PIECE).
        item = pid * ROWS + tl.arange(0, ROWS)
        tile_lo = (item // 2) * PIECE
        tile_hi = tl.minimum(tile_lo + PIECE, N)
        valid = tile_lo < N
        side = item % 2
        p = tl.where(side == 0, tile_lo, tile_hi - 1)
        v = tl.load(sorted_ids_ptr + p, mask=valid, other=0)
        seg_lo = tl.load(row_ptr_ptr + v, mask=valid, other=0)
        seg_hi = tl.load(row_ptr_ptr + v + 1, mask=valid, other=0)
        # side 1 is a different segment from side 0 only when it starts inside the tile
        active = valid & (seg_hi - seg_lo > PIECE) & ((side == 0) | (seg_lo > tile_lo))
        lo = tl.maximum(seg_lo, tile_lo)
        cnt = tl.minimum(seg_hi, tile_hi) - lo
        acc = _sequential_sums(grad_ptr, stride_gn, stride_gc, order_ptr, lo, cnt, active, cols, cmask,
                               ROWS, BLOCK_C, UNROLL)
        ptrs = partial_ptr + item.to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(ptrs, acc, mask=active[:, None] & cmask[None, :])
    else:
        # Output rows: short segments summed and written, long ones left to combine; untouched rows zeroed
        # (dense) or left alone (accumulate: acc + 0.0 would be acc, see the module docstring).
        rows = (pid - num_piece_blocks) * ROWS + tl.arange(0, ROWS)
        rmask = rows < V
        lo = tl.load(row_ptr_ptr + rows, mask=rmask, other=0)
        cnt = tl.load(row_ptr_ptr + rows + 1, mask=rmask, other=0) - lo
        short = rmask & (cnt <= PIECE)
        acc = _sequential_sums(grad_ptr, stride_gn, stride_gc, order_ptr, lo, cnt, short, cols, cmask,
                               ROWS, BLOCK_C, UNROLL)
        write = (short & (cnt > 0)) if ACCUMULATE else short
        _store_rows(out_ptr, stride_on, rows, cols, write[:, None] & cmask[None, :], acc, DTYPE, ACCUMULATE)


@triton.jit
def _embedding_bwd_combine_kernel(
    # fp32 piece partials (2*T, C) from _embedding_bwd_kernel
    partial_ptr,
    # prep: sorted ids (N,), CSR row offsets (V+1,)
    sorted_ids_ptr, row_ptr_ptr,
    # output (V, C) with unit channel stride
    out_ptr, stride_on,
    # sizes
    N, C,
    PIECE: tl.constexpr,
    # the weight's dtype (the rounding); accumulate mode: out is the fp32 accumulator
    DTYPE: tl.constexpr, ACCUMULATE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr, UNROLL: tl.constexpr,
):
    # One lane per tile t: it owns the long segment that holds t's last position if the segment starts in t.
    tile = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    tile_lo = tile * PIECE
    valid = tile_lo < N
    tile_hi = tl.minimum(tile_lo + PIECE, N)
    v = tl.load(sorted_ids_ptr + tile_hi - 1, mask=valid, other=0)
    seg_lo = tl.load(row_ptr_ptr + v, mask=valid, other=0)
    seg_hi = tl.load(row_ptr_ptr + v + 1, mask=valid, other=0)
    active = valid & (seg_hi - seg_lo > PIECE) & (seg_lo >= tile_lo)
    n_parts = (seg_hi - 1) // PIECE - tile + 1
    first_item = 2 * tile + (seg_lo > tile_lo).to(tl.int32)   # side 1 if the segment starts inside the tile
    n_steps = tl.max(tl.where(active, n_parts, 0), axis=0)
    acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
    for k0 in range(0, n_steps, UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + u
            take = active & (k < n_parts)
            item = tl.where(k == 0, first_item, 2 * (tile + k))
            part = tl.load(partial_ptr + item.to(tl.int64)[:, None] * C + cols[None, :],
                           mask=take[:, None] & cmask[None, :], other=0.0)
            acc = tl.where(take[:, None], acc + part, acc)
    _store_rows(out_ptr, stride_on, v, cols, active[:, None] & cmask[None, :], acc, DTYPE, ACCUMULATE)


# ---------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------
def _check_config(config):
    if config is None:
        config = INTERPRETER_CONFIG if interpreting() else DEFAULT_CONFIG
    cfg = dict(config)
    if set(cfg) != set(DEFAULT_CONFIG):
        raise ValueError(f"config must have exactly the keys {sorted(DEFAULT_CONFIG)}, got {sorted(cfg)}")
    for key in ("ROWS", "BLOCK_C", "UNROLL", "num_warps"):
        value = cfg[key]
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config[{key!r}] must be a positive power of two, got {value!r}")
    return cfg


def _check_grad_ids(grad_out, ids, num_embeddings):
    """Checks shared by both modes; returns (device, N, C)."""
    _check_ids_dtype(ids)
    _check_num_embeddings(num_embeddings)
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_out must be a torch.Tensor, got {type(grad_out).__name__}")
    if grad_out.dtype not in _GRAD_DTYPES:
        raise TypeError(f"grad_out must be float32, bfloat16 or float16, got {grad_out.dtype}")
    if grad_out.dim() != ids.dim() + 1 or grad_out.shape[:-1] != ids.shape:
        raise ValueError(f"grad_out must have shape ids.shape + (C,) = {tuple(ids.shape)} + (C,), got "
                         f"{tuple(grad_out.shape)}")
    device = grad_out.device
    if ids.device != device:
        raise ValueError(f"ids is on {ids.device} but grad_out is on {device}")
    return device, ids.numel(), grad_out.shape[-1]


def _check_acc(acc, C, device):
    if acc.shape[1] != C:
        raise ValueError(f"acc must have C = {C} columns (grad_out's last dimension), got {tuple(acc.shape)}")
    if acc.device != device:
        raise ValueError(f"acc is on {acc.device} but grad_out is on {device}")
    # channels contiguous (the kernels' unit channel stride) and rows that do not overlap: each element of acc
    # is one (row, channel), written by one program only
    if acc.numel() and ((C > 1 and acc.stride(1) != 1) or (acc.shape[0] > 1 and acc.stride(0) < C)):
        raise ValueError(f"acc must have unit channel stride and non-overlapping rows, got strides {acc.stride()}")


def _launch(g2, prep, out, accumulate, cfg):
    """Both kernels on (N, C) gradient rows g2 (N, C > 0), rounding to g2's dtype; out: (V, C), see the modes."""
    N, C = g2.shape
    V = out.shape[0]
    T = triton.cdiv(N, PIECE)
    rows, block_c, unroll, warps = cfg["ROWS"], cfg["BLOCK_C"], cfg["UNROLL"], cfg["num_warps"]
    dtype = _TL_DTYPES[g2.dtype]
    partials = torch.empty((max(2 * T, 1), C), dtype=torch.float32, device=g2.device)
    num_piece_blocks = triton.cdiv(2 * T, rows)
    grid = (num_piece_blocks + triton.cdiv(V, rows), triton.cdiv(C, block_c))
    _embedding_bwd_kernel[grid](
        g2, g2.stride(0), g2.stride(1),
        prep.order, prep.sorted_ids, prep.row_ptr,
        out, out.stride(0), partials,
        N, V, C, num_piece_blocks,
        PIECE=PIECE,
        DTYPE=dtype, ACCUMULATE=accumulate,
        ROWS=rows, BLOCK_C=block_c, UNROLL=unroll, num_warps=warps)
    # The combine kernel runs after the first (same stream): it reads the partials, and it alone writes the
    # rows of long segments, which the first kernel's row programs skip (cnt > PIECE).
    _embedding_bwd_combine_kernel[(triton.cdiv(T, rows), triton.cdiv(C, block_c))](
        partials, prep.sorted_ids, prep.row_ptr,
        out, out.stride(0),
        N, C,
        PIECE=PIECE,
        DTYPE=dtype, ACCUMULATE=accumulate,
        ROWS=rows, BLOCK_C=block_c, UNROLL=unroll, num_warps=warps)


def embedding_backward(grad_out, ids, num_embeddings, *, prep=None, config=None):
    """Weight gradient (num_embeddings, C) of an embedding lookup, deterministic (see the module docstring).

    grad_out: (*ids.shape, C) bf16/fp16/fp32. ids: int32/int64 on grad_out's device. Returns a new (V, C)
    tensor of grad_out's dtype.
    prep: ``prepare_ids(ids, V)`` on grad_out's device; without it the ids are prepared here (host sync).
    config: benchmark and tests only.
    With a prep, the values of ids are not read (the prep holds them, validated by prepare_ids); only their
    shape, dtype and device are checked, and N and num_embeddings against the prep's."""
    device, N, C = _check_grad_ids(grad_out, ids, num_embeddings)
    V = num_embeddings
    if prep is None:
        prep = prepare_ids(ids, V)
    else:
        _check_prep(prep, V, N, device)
    out = torch.empty((V, C), dtype=grad_out.dtype, device=device)
    cfg = _check_config(config)
    if C == 0 or N == 0:
        # Nothing to sum; also keeps empty (null-pointer) prep and gradient tensors away from the launcher.
        return out.zero_()
    _launch(grad_out.reshape(N, C), prep, out, False, cfg)   # reshape: a view when possible (strides passed)
    return out


def embedding_backward_accumulate(grad_out, ids, acc, *, prep=None, config=None):
    """acc += embedding_backward(grad_out, ids, acc.shape[0]) bit for bit, without the dense gradient.

    acc: fp32 (V, C), modified in place and returned; any row stride (a view into a padded or stacked buffer),
    unit channel stride. For every id v in ids, acc[v] = acc[v] + float(round(sum)), with the same fp32 sum
    and rounding (to grad_out's dtype) as embedding_backward; rows no id touches are not written (the dense
    path's acc + 0.0 leaves every value but -0.0 unchanged: see the module docstring). grad_out, ids, prep,
    config: as in embedding_backward (V = acc.shape[0])."""
    if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or acc.dim() != 2:
        got = f"{acc.dtype} {tuple(acc.shape)}" if isinstance(acc, torch.Tensor) else type(acc).__name__
        raise TypeError(f"acc must be a 2-D float32 tensor (num_embeddings, C), got {got}")
    V = acc.shape[0]
    device, N, C = _check_grad_ids(grad_out, ids, V)
    _check_acc(acc, C, device)
    if prep is None:
        prep = prepare_ids(ids, V)
    else:
        _check_prep(prep, V, N, device)
    cfg = _check_config(config)
    if C and N:
        _launch(grad_out.reshape(N, C), prep, acc, True, cfg)
    return acc


# ---------------------------------------------------------------------------------------------------------
# Autograd-aware lookup (custom ops, traceable by torch.compile)
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("speedrun::embedding_fwd", mutates_args=())
def _embedding_fwd_op(ids: torch.Tensor, weight: torch.Tensor, order: Optional[torch.Tensor],
                      sorted_ids: Optional[torch.Tensor], row_ptr: Optional[torch.Tensor],
                      acc: Optional[torch.Tensor]) -> torch.Tensor:
    # The prep tensors and acc are inputs only so that setup_context can keep them for the backward.
    return F.embedding(ids, weight)


@_embedding_fwd_op.register_fake
def _(ids, weight, order, sorted_ids, row_ptr, acc):
    return weight.new_empty(tuple(ids.shape) + tuple(weight.shape[1:]))


@torch.library.custom_op("speedrun::embedding_bwd", mutates_args=())
def _embedding_bwd_op(grad: torch.Tensor, ids: torch.Tensor, order: Optional[torch.Tensor],
                      sorted_ids: Optional[torch.Tensor], row_ptr: Optional[torch.Tensor],
                      num_embeddings: int) -> torch.Tensor:
    return embedding_backward(grad, ids, num_embeddings, prep=_prep_of(ids, order, sorted_ids, row_ptr,
                                                                       num_embeddings))


@_embedding_bwd_op.register_fake
def _(grad, ids, order, sorted_ids, row_ptr, num_embeddings):
    return grad.new_empty((num_embeddings, grad.shape[-1]))


@torch.library.custom_op("speedrun::embedding_bwd_accumulate", mutates_args=("acc",))
def _embedding_bwd_accumulate_op(grad: torch.Tensor, ids: torch.Tensor, order: Optional[torch.Tensor],
                                 sorted_ids: Optional[torch.Tensor], row_ptr: Optional[torch.Tensor],
                                 acc: torch.Tensor) -> None:
    embedding_backward_accumulate(grad, ids, acc, prep=_prep_of(ids, order, sorted_ids, row_ptr, acc.shape[0]))


@_embedding_bwd_accumulate_op.register_fake
def _(grad, ids, order, sorted_ids, row_ptr, acc):
    return None


def _prep_of(ids, order, sorted_ids, row_ptr, num_embeddings):
    return None if order is None else EmbeddingPrep(order, sorted_ids, row_ptr, num_embeddings, ids.numel())


def _embedding_setup_context(ctx, inputs, output):
    ids, weight, order, sorted_ids, row_ptr, acc = inputs
    ctx.save_for_backward(ids, order, sorted_ids, row_ptr)
    ctx.num_embeddings = weight.shape[0]
    # Kept as an attribute, not saved: saved tensors are checked against in-place changes, and the backward of
    # one lookup changing acc (or a view of the same buffer: the value-embedding tables) would fail the check
    # of the next one.
    ctx.acc = acc


def _embedding_backward_rule(ctx, grad):
    ids, order, sorted_ids, row_ptr = ctx.saved_tensors
    if ctx.acc is not None:
        # The gradient goes into acc; weight gets none (autograd leaves its .grad None; a post-accumulate-grad
        # hook on it still runs, with .grad None).
        _embedding_bwd_accumulate_op(grad, ids, order, sorted_ids, row_ptr, ctx.acc)
        return None, None, None, None, None, None
    dweight = _embedding_bwd_op(grad, ids, order, sorted_ids, row_ptr, ctx.num_embeddings)
    return None, dweight, None, None, None, None


torch.library.register_autograd("speedrun::embedding_fwd", _embedding_backward_rule,
                                setup_context=_embedding_setup_context)


class _EagerEmbedding(torch.autograd.Function):
    """The eager lookup: the custom ops' forward and backward, called without the custom-op dispatch.

    As there, acc is kept as an attribute, not saved (the in-place check would fail the next lookup into a view
    of the same buffer), and in accumulate mode the weight gets no gradient."""

    @staticmethod
    def forward(ctx, ids, weight, prep, acc):
        ctx.save_for_backward(ids)
        ctx.prep, ctx.acc, ctx.num_embeddings = prep, acc, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, = ctx.saved_tensors
        if ctx.acc is not None:
            embedding_backward_accumulate(grad, ids, ctx.acc, prep=ctx.prep)
            return None, None, None, None
        return None, embedding_backward(grad, ids, ctx.num_embeddings, prep=ctx.prep), None, None


def embedding(ids, weight, prep=None, acc=None):
    """weight[ids] (ids.shape + (C,)), whose backward is the deterministic :func:`embedding_backward`.

    prep: optional ``prepare_ids(ids, weight.shape[0])`` already on weight's device (no host sync in the
    backward); without it the backward prepares the ids on the device.
    acc: optional fp32 tensor of weight's shape (an optimizer's gradient accumulator, any row stride): the
    backward adds the gradient into it (:func:`embedding_backward_accumulate`: acc ends bitwise equal to
    acc + the dense gradient) and gives weight no gradient (weight.grad stays None).
    Eagerly an autograd.Function, under torch.compile the custom ops (same kernels: see the module docstring)."""
    _check_ids_dtype(ids)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D (num_embeddings, C) tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if ids.device != weight.device:
        raise ValueError(f"ids is on {ids.device} but weight is on {weight.device}")
    if acc is not None:
        if not isinstance(acc, torch.Tensor) or acc.dtype != torch.float32 or acc.shape != weight.shape:
            got = f"{acc.dtype} {tuple(acc.shape)}" if isinstance(acc, torch.Tensor) else type(acc).__name__
            raise ValueError(f"acc must be a float32 tensor of weight's shape {tuple(weight.shape)}, got {got}")
        _check_acc(acc, weight.shape[1], weight.device)
    if prep is not None:
        _check_prep(prep, weight.shape[0], ids.numel(), weight.device)
    if not torch.compiler.is_compiling():
        return _EagerEmbedding.apply(ids, weight, prep, acc)
    if prep is None:
        return _embedding_fwd_op(ids, weight, None, None, None, acc)
    return _embedding_fwd_op(ids, weight, prep.order, prep.sorted_ids, prep.row_ptr, acc)


def cpu_embedding(ids, weight, prep=None, acc=None):
    """weight[ids] through torch's embedding (the trainer's CPU path: this module's math without the Triton
    interpreter's cost at 50304 rows); no accumulate mode (build_fns leaves ModelFns.embed_accs off on the CPU)."""
    if acc is not None:
        raise ValueError("cpu_embedding has no accumulate mode (acc): that is kernels.embedding.embedding's")
    return F.embedding(ids, weight)
