"""Fused AdamW with fp32 master weights: one Triton launch updates every tensor of an optimizer step.

Math (decoupled weight decay, as ``torch.optim.AdamW``), per element, for step ``t`` (1-based, after the
increment), all arithmetic in fp32 with every operation rounded once (no fused multiply-add):

    m  <- lerp(m, g, 1 - beta1)                    torch's lerp: m + c*(g - m) if c < 0.5 else g - (g - m)*(1 - c)
    v  <- v*beta2 + ((1 - beta2)*g)*g
    a  <- (-lr/bc1) * (m / (sqrt(v)/sqrt(bc2) + eps))      the Adam step; bc1 = 1 - beta1^t, bc2 = 1 - beta2^t
    w  <- w * (1 - lr*wd)                          decoupled weight decay (with cautious_wd: only where a and w
                                                   have opposite signs, i.e. where the step already moves w
                                                   towards zero; elsewhere w is kept)
    w  <- w + a
    p  <- round(w) to the parameter's dtype        round to nearest even

Without ``cautious_wd`` this is ``torch.optim.AdamW`` (whose decay comes first: it does not depend on m or v, so
the order is the same arithmetic). ``cautious_wd`` is the public speedrun's rule for its Adam parameters ("cautious
weight decay": a parameter whose step points away from zero is not decayed; a row without gradient and without
momentum has a = 0 and is not decayed either).

``w`` is the fp32 master copy of a bf16/fp16 parameter ``p`` (or ``p`` itself when it is fp32). The scalar
coefficients (``1 - lr*wd``, ``1 - beta1``, ``beta2``, ``1 - beta2``, ``sqrt(bc2)``, ``eps``, ``-lr/bc1``) are
computed in Python doubles and rounded to fp32 once, exactly as torch does with its scalar arguments, so the
kernel follows torch's operation order. ``sqrt`` and ``/`` are the correctly rounded ``tl.sqrt_rn`` /
``tl.div_rn`` (Triton's default ``/`` and ``tl.sqrt`` are approximate on the GPU, which breaks parity, see
TransformerEngine's FusedAdam), and the kernel is compiled with ``enable_fp_fusion=False`` so that ``a*b + c``
stays two roundings, as in :func:`fused_adamw_ref`: kernel and reference agree bitwise. Against
``torch.optim.AdamW`` the difference is a few fp32 ulps per step (torch fuses some multiply-adds, and on CUDA
divides by a scalar through its reciprocal).

Multi-tensor launch: the launcher packs, per tensor, the addresses of (param, grad, exp_avg, exp_avg_sq,
master) into an int64 table that the kernel casts back to typed pointers, and a chunk table of (tensor index,
first element), one row per BLOCK elements; program ``i`` updates chunk ``i``. Full chunks take an unmasked,
vectorizable path; only each tensor's last chunk is masked. Tables are cached (keyed by all addresses, sizes
and BLOCK) and rebuilt with one host->device copy when they change; every table starts on a 16-byte boundary
whatever the number of tensors, so that number never selects another compiled kernel. Hyperparameters are
kernel scalars when every tensor of the launch shares them, otherwise a per-tensor fp32 table sent with one
host->device copy per step. No host synchronization.

Shapes and dtypes: any shapes (treated as flat, contiguous); params fp32 / bf16 / fp16; grads any of those
(the trainer may hand fp32 grads of bf16 params); exp_avg, exp_avg_sq and master fp32.

Used by ``train_gpt.py``: :func:`fused_adamw_multi_step` (per-tensor hyperparameters) on the trainer's own sharded
buffers; :class:`FusedAdamW` wraps the same launches as a torch optimizer. ``python -m benchmarks --only adam``
times it (24M bf16 parameters with fp32 masters: 28 bytes/element, ~157 us at 4.3 TB/s on an H200).
"""
import collections
import struct

import torch
import triton
import triton.language as tl

from kernels._checks import check_kernel_device

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (BLOCK, num_warps), tuned on one H200 (`python -m benchmarks --only adam --tune`, 24M bf16 elements with fp32
# master; the candidates' times are in notes/measurements.md).
DEFAULT_CONFIG = (1024, 4)
TUNING_CANDIDATES = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]
# The per-tensor hyperparameter table (when groups differ) has 7 fp32 columns: decay, w1, beta2, w2, bc2_sqrt,
# eps, alpha (the output of adamw_coefficients).
# Launch tables kept for reuse: a few optimizers / flat-buffer sets, each with one or two dtype groups.
_PLAN_CACHE_SIZE = 16


def _f32(x):
    """Round a Python float to the nearest fp32 value (what torch does to a scalar argument of an fp32 op)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_hparams(lr, beta1, beta2, eps, weight_decay):
    # Same checks and messages as torch.optim.AdamW.
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def adamw_coefficients(*, lr, beta1, beta2, eps, weight_decay, step):
    """The fp32 scalars of one step: (decay, w1, beta2, w2, bc2_sqrt, eps, alpha), computed like torch.

    torch.optim.AdamW (foreach=False) evaluates ``1 - lr*wd``, ``1 - beta1``, ``1 - beta2``, ``(1 - beta2^t)**0.5``
    and ``-(lr / (1 - beta1^t))`` in Python doubles and each becomes an fp32 scalar inside the fp32 op.
    """
    _check_hparams(lr, beta1, beta2, eps, weight_decay)
    if int(step) != step or step < 1:
        raise ValueError(f"step must be a positive integer (1-based, after the increment), got {step}")
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    return (_f32(1.0 - lr * weight_decay), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2), _f32(bc2 ** 0.5),
            _f32(eps), _f32(-(lr / bc1)))


# ----------------------------------------------------------------------------------------------------------------
# Reference


def fused_adamw_ref(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                    cautious_wd=False):
    """One AdamW step in pure PyTorch on fp32 tensors, same formula and operation order as the kernel.

    param, exp_avg, exp_avg_sq: fp32 (any shape, any device); grad: fp32 / bf16 / fp16 of the same shape.
    Returns new fp32 (param, exp_avg, exp_avg_sq); the inputs are not modified. Every operation is rounded to
    fp32 once, as in the kernel.
    """
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"fused_adamw_ref: {name} must be float32, got {t.dtype}")
    decay, w1, b2, w2, bc2_sqrt, eps32, alpha = adamw_coefficients(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)

    def r(x):
        # Each op is evaluated in float64 and rounded to fp32: the correctly rounded fp32 result, since double
        # rounding is harmless for + - * / sqrt when 53 >= 2*24 + 2. Plain fp32 torch ops are not enough: on
        # some CPUs torch's vectorized fp32 sqrt is off by one ulp (seen with torch 2.13 on x86).
        return x.to(torch.float32).to(torch.float64)

    g, w, m, v = (t.to(torch.float64) for t in (grad, param, exp_avg, exp_avg_sq))
    d = r(g - m)
    m = r(m + r(w1 * d)) if w1 < 0.5 else r(g - r(d * (1.0 - w1)))
    v = r(r(v * b2) + r(r(w2 * g) * g))
    # divide by a tensor: CUDA torch divides by a Python scalar through its reciprocal (not correctly rounded)
    denom = r(r(r(v.sqrt()) / torch.full_like(v, bc2_sqrt)) + eps32)
    a = r(alpha * r(m / denom))
    w = torch.where(_shrinks(a, w), r(w * decay), w) if cautious_wd else r(w * decay)
    w = r(w + a)
    w, m, v = (t.to(torch.float32) for t in (w, m, v))
    return w, m, v


def _shrinks(a, w):
    """Where the Adam step a moves w towards zero (opposite signs; exact, unlike a product that can underflow)."""
    return ((a < 0) & (w > 0)) | ((a > 0) & (w < 0))


def fused_adamw_multi_step_ref(params, grads, exp_avgs, exp_avg_sqs, masters, hparams, *, cautious_wd=False):
    """What :func:`fused_adamw_multi_step` does, through :func:`fused_adamw_ref` one tensor at a time, in place:
    the moments and the fp32 master (or the fp32 param where masters[i] is None) take the new values, and a
    low-precision param with a master takes the master rounded to its dtype. The CPU path of train_gpt.py."""
    for p, g, m, v, w, h in zip(params, grads, exp_avgs, exp_avg_sqs, masters, hparams):
        target = p if w is None else w
        new_w, new_m, new_v = fused_adamw_ref(target, g, m, v, **h, cautious_wd=cautious_wd)
        target.copy_(new_w)
        m.copy_(new_m)
        v.copy_(new_v)
        if w is not None:
            p.copy_(new_w.to(p.dtype))


# ----------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask,
                  decay, w1, beta2, w2, bc2_sqrt, eps, alpha,
                  HAS_MASTER: tl.constexpr, ROUND_BF16: tl.constexpr, CAUTIOUS: tl.constexpr):
    """Update the elements ``offs`` (``mask`` None on full chunks, which keeps the accesses vectorizable)."""
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_MASTER:
        w = tl.load(w_ptr + offs, mask=mask)
    else:
        w = tl.load(p_ptr + offs, mask=mask).to(tl.float32)

    d = g - m
    m = tl.where(w1 < 0.5, m + w1 * d, g - d * (1.0 - w1))
    v = v * beta2 + (w2 * g) * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    a = alpha * tl.div_rn(m, denom)
    if CAUTIOUS:  # decay only where the step moves w towards zero (see _shrinks)
        w = tl.where(((a < 0) & (w > 0)) | ((a > 0) & (w < 0)), w * decay, w)
    else:
        w = w * decay
    w = w + a

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    if ROUND_BF16:
        # Round to nearest even on the bit pattern: add 0x7FFF plus the lowest kept bit, truncate. Done by hand
        # because Triton's interpreter truncates fp32 -> bf16; on the GPU it equals the cvt.rn instruction.
        # NaN is kept as is (a NaN with only low mantissa bits set would otherwise carry into an infinity).
        bits = w.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        w = tl.where(w != w, w, bits.to(tl.float32, bitcast=True))
    # The value is now exactly representable in a bf16 param (or rounds to nearest even for fp16 / fp32).
    tl.store(p_ptr + offs, w.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
        # per-tensor tables (int64, one entry per tensor): addresses, element counts
        p_addr, g_addr, m_addr, v_addr, w_addr, numel_ptr,
        # chunk table (int64, 2 entries per chunk): tensor index, first element of the chunk
        chunk_ptr,
        # typed witnesses: the first param / grad of the launch; the addresses are cast to their element types
        p_like, g_like,
        # hyperparameters: kernel scalars, or per-tensor rows of hp_ptr (fp32, 7 each) when HP_TABLE
        hp_ptr, decay, w1, beta2, w2, bc2_sqrt, eps, alpha,
        HAS_MASTER: tl.constexpr, HP_TABLE: tl.constexpr, ROUND_BF16: tl.constexpr, CAUTIOUS: tl.constexpr,
        ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(chunk_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(chunk_ptr + 2 * pid + 1), BLOCK)
    n = tl.load(numel_ptr + t)
    p_ptr = tl.load(p_addr + t).to(tl.pointer_type(p_like.dtype.element_ty))
    g_ptr = tl.load(g_addr + t).to(tl.pointer_type(g_like.dtype.element_ty))
    m_ptr = tl.load(m_addr + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_addr + t).to(tl.pointer_type(tl.float32))
    w_ptr = tl.load(w_addr + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # The launcher checked that every address is a multiple of 16 bytes: allows 16-byte vector accesses.
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
    if HP_TABLE:
        row = hp_ptr + t * 7  # 7 columns, see the table's comment at the top
        decay = tl.load(row + 0)
        w1 = tl.load(row + 1)
        beta2 = tl.load(row + 2)
        w2 = tl.load(row + 3)
        bc2_sqrt = tl.load(row + 4)
        eps = tl.load(row + 5)
        alpha = tl.load(row + 6)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, None, decay, w1, beta2, w2, bc2_sqrt, eps, alpha,
                      HAS_MASTER, ROUND_BF16, CAUTIOUS)
    else:
        _adamw_update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, decay, w1, beta2, w2, bc2_sqrt, eps,
                      alpha, HAS_MASTER, ROUND_BF16, CAUTIOUS)


# ----------------------------------------------------------------------------------------------------------------
# Launchers

_PLAN_CACHE = collections.OrderedDict()


def _plan(params, grads, exp_avgs, exp_avg_sqs, masters, block):
    """Device tables for one launch, cached by content (every address and size), so a hit is always valid.

    Returns (tables: dict of int64 device views, n_chunks, aligned).
    """
    w_list = masters if masters is not None else exp_avgs  # unused by the kernel without masters
    addrs = [t.data_ptr() for lst in (params, grads, exp_avgs, exp_avg_sqs, w_list) for t in lst]
    numels = [p.numel() for p in params]
    key = (params[0].device, block, tuple(addrs), tuple(numels))
    hit = _PLAN_CACHE.get(key)
    if hit is not None:
        _PLAN_CACHE.move_to_end(key)
        return hit
    n_t = len(params)
    counts = torch.tensor([(n + block - 1) // block for n in numels], dtype=torch.int64)
    n_chunks = int(counts.sum())
    tensor_idx = torch.repeat_interleave(torch.arange(n_t, dtype=torch.int64), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    starts = (torch.arange(n_chunks, dtype=torch.int64) - first_chunk[tensor_idx]) * block
    chunks = torch.stack([tensor_idx, starts], dim=1).reshape(-1)
    # Each table starts on a 16-byte boundary (its rows padded to an even count): Triton specializes a pointer
    # argument on its 16-byte alignment, so with views at multiples of n_t * 8 bytes an odd tensor count would give
    # another compiled kernel (the trainer's first step after the untie, 3 -> 4 bf16 tensors, compiled one
    # inside the timed run).
    stride = n_t + n_t % 2
    cols = torch.zeros((6, stride), dtype=torch.int64)
    cols[:, :n_t] = torch.tensor(addrs + numels, dtype=torch.int64).view(6, n_t)
    host = torch.cat([cols.reshape(-1), chunks])
    dev = host.to(params[0].device, non_blocking=True)  # the one host->device copy of a (re)build
    names = ("p", "g", "m", "v", "w", "numel")
    tables = {name: dev[i * stride:i * stride + n_t] for i, name in enumerate(names)}
    tables["chunks"] = dev[len(names) * stride:]
    aligned = all(a % 16 == 0 for a in addrs)
    plan = (tables, n_chunks, aligned)
    _PLAN_CACHE[key] = plan
    if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    return plan


def _check_device(device):
    check_kernel_device("fused AdamW", device)


def _launch(params, grads, exp_avgs, exp_avg_sqs, masters, hps, *, config, cautious_wd=False):
    """One kernel launch over tensors that share (param dtype, grad dtype, has master, device).

    hps: one tuple (decay, w1, beta2, w2, bc2_sqrt, eps, alpha) per tensor. Inputs already checked.
    """
    block, num_warps = config if config is not None else DEFAULT_CONFIG
    keep = [i for i, p in enumerate(params) if p.numel() > 0]
    if not keep:
        return
    if len(keep) != len(params):
        def pick(lst):
            return None if lst is None else [lst[i] for i in keep]
        params, grads, exp_avgs, exp_avg_sqs, masters = map(pick, (params, grads, exp_avgs, exp_avg_sqs, masters))
        hps = pick(hps)
    device = params[0].device
    _check_device(device)
    tables, n_chunks, aligned = _plan(params, grads, exp_avgs, exp_avg_sqs, masters, block)
    uniform = all(h == hps[0] for h in hps)
    if uniform:
        hp_table, scalars = tables["numel"], hps[0]  # hp_table unused: any int64 tensor will do
    else:
        hp_table = torch.tensor(hps, dtype=torch.float32).to(device, non_blocking=True)
        scalars = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    decay, w1, b2, w2, bc2_sqrt, eps, alpha = scalars
    _adamw_kernel[(n_chunks,)](
        tables["p"], tables["g"], tables["m"], tables["v"], tables["w"], tables["numel"],
        tables["chunks"], params[0], grads[0],
        hp_table, decay, w1, b2, w2, bc2_sqrt, eps, alpha,
        HAS_MASTER=masters is not None, HP_TABLE=not uniform,
        ROUND_BF16=params[0].dtype == torch.bfloat16, CAUTIOUS=bool(cautious_wd), ALIGNED=aligned,
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)


def _lists_look_valid(params, grads, exp_avgs, exp_avg_sqs, masters):
    """Cheap whole-list checks (a few set comprehensions); _explain_invalid names the culprit when one fails."""
    states = exp_avgs + exp_avg_sqs + [w for w in masters if w is not None]
    tensors = params + grads + states
    shapes = [p.shape for p in params]
    if not (len({t.layout for t in tensors}) == 1 and tensors[0].layout == torch.strided
            and {t.dtype for t in params + grads} <= set(PARAM_DTYPES)
            and {t.dtype for t in states} == {torch.float32}
            and len({t.device for t in tensors}) == 1
            and all(t.is_contiguous() for t in tensors)
            and [t.shape for t in grads] == shapes and [t.shape for t in exp_avgs] == shapes
            and [t.shape for t in exp_avg_sqs] == shapes
            and all(w is None or w.shape == p.shape for p, w in zip(params, masters))
            and all(w is not None or p.dtype == torch.float32 for p, w in zip(params, masters))):
        return False
    addrs = [t.data_ptr() for t in tensors if t.numel() > 0]
    return len(set(addrs)) == len(addrs)


def _explain_invalid(params, grads, exp_avgs, exp_avg_sqs, masters):
    """Raise the specific error for the first invalid entry (only called once the fast checks failed)."""
    device = params[0].device
    for i in range(len(params)):
        p, g, m, v, w = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], masters[i]
        named = [("params", p), ("grads", g), ("exp_avgs", m), ("exp_avg_sqs", v)] + \
            ([("masters", w)] if w is not None else [])
        for name, t in named:
            if t.is_complex():
                raise TypeError(f"fused_adamw_step: complex tensors are not supported ({name}[{i}] {t.dtype})")
            if t.layout != torch.strided:
                raise RuntimeError(f"fused_adamw_step: sparse tensors are not supported ({name}[{i}] {t.layout})")
        if p.dtype not in PARAM_DTYPES:
            raise TypeError(f"fused_adamw_step: params[{i}] must be float32, bfloat16 or float16, got {p.dtype}")
        if g.dtype not in PARAM_DTYPES:
            raise TypeError(f"fused_adamw_step: grads[{i}] must be float32, bfloat16 or float16, got {g.dtype}")
        if w is None and p.dtype != torch.float32:
            raise ValueError(f"fused_adamw_step: masters[{i}] is None but params[{i}] is {p.dtype}; "
                             "only float32 params may go without an fp32 master")
        for name, t in named:
            if t.shape != p.shape:
                raise ValueError(f"fused_adamw_step: {name}[{i}] has shape {tuple(t.shape)}, "
                                 f"params[{i}] has {tuple(p.shape)}")
            if t.device != device:
                raise ValueError(f"fused_adamw_step: {name}[{i}] is on {t.device}, params[0] on {device}")
            if not t.is_contiguous():
                raise ValueError(f"fused_adamw_step: {name}[{i}] must be contiguous")
            if name not in ("params", "grads") and t.dtype != torch.float32:
                raise TypeError(f"fused_adamw_step: {name}[{i}] must be float32, got {t.dtype}")
    seen = {}
    for name, lst in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("masters", masters)):
        for i, t in enumerate(lst):
            if t is not None and t.numel() > 0:
                other = seen.setdefault(t.data_ptr(), f"{name}[{i}]")
                if other != f"{name}[{i}]":
                    raise ValueError(f"fused_adamw_step: {name}[{i}] and {other} must not alias each other")
    raise AssertionError("fused_adamw_step: inputs failed a check that _explain_invalid does not cover")


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, masters):
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("masters", masters)):
        if len(lst) != n:
            raise ValueError(f"fused_adamw_step: {name} has {len(lst)} entries, params has {n}")
    args = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(masters))
    if n and not _lists_look_valid(*args):
        _explain_invalid(*args)


def _grouped_launches(params, grads, exp_avgs, exp_avg_sqs, masters, hps, *, config, cautious_wd=False):
    """Split by (param dtype, grad dtype, has master, device) and launch once per group."""
    groups = {}
    for i, p in enumerate(params):
        key = (p.dtype, grads[i].dtype, masters[i] is not None, p.device)
        groups.setdefault(key, []).append(i)
    for (_, _, has_master, _), idx in groups.items():
        def pick(lst):
            return [lst[i] for i in idx]
        _launch(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(masters) if has_master else None,
                pick(hps), config=config, cautious_wd=cautious_wd)


def fused_adamw_step(params, grads, exp_avgs, exp_avg_sqs, masters, *, lr, beta1, beta2, eps, weight_decay, step,
                     cautious_wd=False, config=None):
    """One AdamW step over lists of tensors, in place: one launch per (param dtype, grad dtype, has master).

    params:      list of fp32 / bf16 / fp16 tensors, updated (the rounded master where one is given)
    grads:       list of fp32 / bf16 / fp16 tensors, same shapes
    exp_avgs:    list of fp32 first moments, same shapes, updated
    exp_avg_sqs: list of fp32 second moments, same shapes, updated
    masters:     list of fp32 master weights or None (allowed only for fp32 params, updated in place)
    lr, beta1, beta2, eps, weight_decay: Python floats shared by all tensors of the call
    step:        1-based step count after the increment (bias correction)
    cautious_wd: decay only the elements whose Adam step moves them towards zero (see the module docstring)
    config:      (BLOCK, num_warps), default DEFAULT_CONFIG
    All tensors contiguous and on one device.
    """
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, masters)
    hp = adamw_coefficients(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    _grouped_launches(params, grads, exp_avgs, exp_avg_sqs, masters, [hp] * len(params), config=config,
                      cautious_wd=cautious_wd)


def fused_adamw_multi_step(params, grads, exp_avgs, exp_avg_sqs, masters, hparams, *, cautious_wd=False,
                           config=None):
    """Like :func:`fused_adamw_step`, with hyperparameters per tensor: ``hparams[i]`` is a dict of lr, beta1,
    beta2, eps, weight_decay and step for tensor i. Still one launch per (param dtype, grad dtype, has master):
    where the tensors of a launch differ, their coefficients go in the kernel's per-tensor table. ``train_gpt.py``
    updates all its Adam groups with one call per Adam step (two launches: fp32 gates/scalars without masters, bf16
    embeddings/head with fp32 masters), with cautious_wd."""
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, masters)
    if len(hparams) != len(params):
        raise ValueError(f"fused_adamw_multi_step: hparams has {len(hparams)} entries, params has {len(params)}")
    hps = [adamw_coefficients(**h) for h in hparams]
    _grouped_launches(params, grads, exp_avgs, exp_avg_sqs, masters, hps, config=config, cautious_wd=cautious_wd)


# ----------------------------------------------------------------------------------------------------------------
# Optimizer


class FusedAdamW(torch.optim.Optimizer):
    """AdamW holding bf16 / fp16 / fp32 params, with an fp32 master copy of each low-precision one.

    State per param: ``step`` (int), ``exp_avg`` and ``exp_avg_sq`` (fp32), and ``master_param`` (fp32,
    initialised from the param) when ``master_weights`` and the param is not fp32. One ``step()`` is one kernel
    launch per (param dtype, grad dtype, has master) over all params with a grad, across all param groups;
    groups may change lr / betas / eps / weight_decay between steps. Params whose grad is None are skipped
    (their step count does not advance).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, master_weights=True):
        _check_hparams(lr, betas[0], betas[1], eps, weight_decay)
        self.master_weights = master_weights
        self.config = None  # (BLOCK, num_warps) of the launches; None: DEFAULT_CONFIG (the benchmark sets it)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            error = None
            if p.is_complex():
                error = TypeError(f"FusedAdamW does not support complex parameters (got {p.dtype})")
            elif p.dtype not in PARAM_DTYPES:
                error = TypeError(f"FusedAdamW supports float32, bfloat16 and float16 parameters, got {p.dtype}")
            elif not p.is_contiguous():
                error = ValueError("FusedAdamW: parameters must be contiguous")
            if error is not None:
                self.param_groups.pop()
                raise error
        _check_hparams(group["lr"], group["betas"][0], group["betas"][1], group["eps"], group["weight_decay"])

    def _init_state(self, p):
        state = self.state[p]
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        if self.master_weights and p.dtype != torch.float32:
            state["master_param"] = p.detach().to(torch.float32, copy=True)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, grads, ms, vs, ws, hps = [], [], [], [], [], []
        for group in self.param_groups:
            hp_of_step = {}  # the group's coefficients, computed once per distinct step count
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError("FusedAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state = self._init_state(p)
                step = state["step"] = state["step"] + 1
                hp = hp_of_step.get(step)
                if hp is None:
                    beta1, beta2 = group["betas"]
                    hp = hp_of_step[step] = adamw_coefficients(
                        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], step=step)
                params.append(p)
                grads.append(g if g.is_contiguous() else g.contiguous())
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
                ws.append(state.get("master_param"))
                hps.append(hp)
        if params:
            _grouped_launches(params, grads, ms, vs, ws, hps, config=self.config)
        return loss

    def load_state_dict(self, state_dict):
        # torch.optim.Optimizer.load_state_dict casts floating-point state to the param's dtype, which would
        # round the fp32 moments and master to bf16: restore the saved fp32 tensors afterwards.
        super().load_state_dict(state_dict)
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(value) and key in ("exp_avg", "exp_avg_sq", "master_param"):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
