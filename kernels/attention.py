"""Document attention: causal attention within the documents of a packed sequence, over a sliding window.

Math. For one sequence of T tokens holding whole documents, per head h,

    out[t, h] = sum_s softmax_s(scale * q[t, h] . k[s, h]) v[s, h]
                over the keys s with 0 <= t - s < window and doc(s) == doc(t)

Shapes: q, k, v (T, H, D); the documents as ``DocSeq``: cu (n_docs + 1,) int32, the documents' starts and T
(FlashAttention's cumulative sequence lengths, ``doc_cu_seqlens``), docs (T,) int32 the document index per position
(``doc_ids``), max_len an upper bound of the documents' lengths; window: the window in tokens, a 0-d int64 CPU
tensor (an int for the reference). Dtypes: bf16 on CUDA (FlashAttention takes bf16 and fp16); the reference any.

There is no Triton kernel here: on CUDA the op wraps torch's own FlashAttention varlen kernels
(``aten._flash_attention_forward`` / ``_backward``) as the custom ops ``speedrun::doc_attention`` (what the model
calls), ``speedrun::doc_attention_fwd`` and ``speedrun::doc_attention_bwd`` (what torch.compile records in the
forward and backward graphs). ``dense_attend`` is the reference in plain PyTorch: SDPA with the same mask,
dense (T x T); it is also the CPU path.

Where train_gpt.py uses it: ``flash_attend`` (CUDA, bf16) or ``dense_attend`` (CPU, fp32 parameters) is the
``attend`` of every attention sublayer (make_attn_sublayer), inside the compiled region on CUDA; the layers build
the DocSeq of the sequence (and of the paired heads' interleaved 2T sequence) from ``doc_ids`` and the loader's
``doc_cu_seqlens``. tests/test_train_gpt.py and tests/test_model.py check the op against the reference.
"""
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


def doc_ids(ids, bos_id):
    """Document index per position (cumulative BOS count): the mask allows attention within a document."""
    return torch.cumsum((ids == bos_id).to(torch.int32), 0, dtype=torch.int32)


def doc_cu_seqlens(ids, bos_id):
    """(n_docs + 1,) int32 on the CPU: where each document of the 1-D sequence ``ids`` starts (position 0, then
    every BOS after it) and its length T at the end: FlashAttention's cumulative sequence lengths. Computed on
    the host (the loader thread, or evaluation's host-side ids), so no step waits on the device for it."""
    ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids)
    starts = np.flatnonzero(ids == bos_id)
    starts = starts[starts > 0]
    return torch.from_numpy(np.concatenate([[0], starts, [len(ids)]]).astype(np.int32))


class DocSeq(NamedTuple):
    """The document structure of one attention call's sequence."""
    cu: torch.Tensor  # (n_docs + 1,) int32 on the device: document starts and the length (FlashAttention)
    docs: torch.Tensor  # (T,) int32 document index per position (the dense CPU path's mask)
    max_len: int  # an upper bound of the documents' lengths (FlashAttention's grid)


def dense_attend(q, k, v, seq, window, scale):
    """The reference and the CPU path: SDPA with the same mask, dense: causal, same document, q - k < window."""
    pos = torch.arange(seq.docs.numel(), device=seq.docs.device)
    rel = pos[:, None] - pos[None, :]
    mask = (rel >= 0) & (rel < window) & (seq.docs[:, None] == seq.docs[None, :])
    y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale)
    return y.transpose(0, 1)


def _unit_last_dim(*tensors):
    """Each tensor as it is when its last dim is contiguous (all FlashAttention asks for), else a contiguous copy."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


# The attention ops, registered with torch.library's low-level API (define, then a kernel per dispatch key)
# rather than torch.library.custom_op: the compiled step launches them from Python, twice per attention layer and
# micro-step, and custom_op wraps every call in Python layers of its own (an autograd kernel, a device-kernel
# wrapper with a dynamo guard, an aliasing check). Here the ops the compiled step calls, doc_attention_fwd and
# doc_attention_bwd, run no Python but their CUDA kernels (no autograd kernel: the dispatcher's C++ fallback
# passes them through). doc_attention, the op the model calls, exists for autograd: its autograd kernel applies
# _DocAttention, whose forward calls doc_attention_fwd and whose backward doc_attention_bwd, so that these two,
# not doc_attention, are what torch.compile records in the forward and backward graphs.
_ATTENTION_LIB = torch.library.Library("speedrun", "FRAGMENT")
_ATTENTION_ARGS = "Tensor q, Tensor k, Tensor v, Tensor cu, Tensor window, SymInt max_len, float scale"
for _name in ("doc_attention", "doc_attention_fwd"):
    _ATTENTION_LIB.define(f"{_name}({_ATTENTION_ARGS}) -> (Tensor, Tensor, Tensor)", tags=torch.Tag.pt2_compliant_tag)
_ATTENTION_LIB.define("doc_attention_bwd(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                      "Tensor rng, Tensor cu, Tensor window, SymInt max_len, float scale, bool deterministic) "
                      "-> (Tensor, Tensor, Tensor)", tags=torch.Tag.pt2_compliant_tag)


def _doc_attention_flash(q, k, v, cu, window, max_len, scale):
    """speedrun::doc_attention_fwd on CUDA: causal attention within documents over a sliding window, with torch's
    FlashAttention (varlen) kernels. q, k, v (T, H, D) bf16; cu (n_docs + 1,) int32 document boundaries; window:
    0-d int64 CPU tensor, the window in tokens (a key k is seen by query q iff 0 <= q - k < window and both lie in
    one document). The window is read on the host, from a CPU tensor, so that a compiled caller takes it as an
    argument (no recompilation when it changes) and reading it waits on nothing. Returns (out (T, H, D), the
    softmax log-sum-exp and the RNG state, which the backward needs). q, k, v may be strided views (v is one of the
    fused projection's (T, 3, H, D) output in layers without a value embedding): FlashAttention reads any token
    and head strides, so only a last dim that is not contiguous is copied."""
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        *_unit_last_dim(q, k, v), cu, cu, max_len, max_len, 0.0, True, False, scale=scale,
        window_size_left=int(window) - 1, window_size_right=0)
    return out, lse, rng


def _doc_attention_fake(q, k, v, cu, window, max_len, scale):
    # torch's own shape rule for the op (the log-sum-exp layout differs between versions)
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, window_size_left=0, window_size_right=0)
    return out, lse, rng


def _doc_attention_flash_bwd(grad, q, k, v, out, lse, rng, cu, window, max_len, scale, deterministic):
    """speedrun::doc_attention_bwd on CUDA: (dq, dk, dv) of doc_attention, each contiguous (T, H, D), whatever the
    strides of q, k, v. FlashAttention's backward accumulates dq with atomics unless deterministic algorithms are
    on without warn_only: --deterministic asks for that here, for this call."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        grads = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), *_unit_last_dim(q, k, v), out, lse, cu, cu, max_len, max_len,
            0.0, True, rng, torch.empty(0, device=q.device), scale=scale, window_size_left=int(window) - 1,
            window_size_right=0)
        return tuple(g.contiguous() for g in grads[:3])  # no copy: FlashAttention allocates them contiguous
    finally:
        if deterministic:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _doc_attention_bwd_fake(grad, q, k, v, out, lse, rng, cu, window, max_len, scale, deterministic):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


doc_attention = torch.ops.speedrun.doc_attention.default
doc_attention_fwd = torch.ops.speedrun.doc_attention_fwd.default
doc_attention_bwd = torch.ops.speedrun.doc_attention_bwd.default


class _DocAttention(torch.autograd.Function):
    """doc_attention's autograd: doc_attention_fwd, and doc_attention_bwd for the gradients of q, k and v."""

    @staticmethod
    def forward(ctx, q, k, v, cu, window, max_len, scale):
        out, lse, rng = doc_attention_fwd(q, k, v, cu, window, max_len, scale)
        ctx.save_for_backward(q, k, v, out, lse, rng, cu, window)
        ctx.max_len, ctx.scale = max_len, scale
        ctx.deterministic = torch.are_deterministic_algorithms_enabled()
        ctx.mark_non_differentiable(lse, rng)
        return out, lse, rng

    @staticmethod
    def backward(ctx, grad, *_):
        dq, dk, dv = doc_attention_bwd(grad, *ctx.saved_tensors, ctx.max_len, ctx.scale, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def _doc_attention_autograd(q, k, v, cu, window, max_len, scale):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _DocAttention.apply(q, k, v, cu, window, max_len, scale)
    return doc_attention_fwd(q, k, v, cu, window, max_len, scale)


_ATTENTION_LIB.impl("doc_attention", _doc_attention_autograd, "Autograd")
_ATTENTION_LIB.impl("doc_attention", doc_attention_fwd, "CompositeExplicitAutograd")  # called below autograd
_ATTENTION_LIB.impl("doc_attention_fwd", _doc_attention_flash, "CUDA")
_ATTENTION_LIB.impl("doc_attention_bwd", _doc_attention_flash_bwd, "CUDA")
for _name, _fake in (("doc_attention", _doc_attention_fake), ("doc_attention_fwd", _doc_attention_fake),
                     ("doc_attention_bwd", _doc_attention_bwd_fake)):
    torch.library.register_fake(f"speedrun::{_name}", _fake, lib=_ATTENTION_LIB)


def flash_attend(q, k, v, seq, window, scale):
    """q, k, v (T, H, D) -> (T, H, D) (CUDA): doc_attention over seq's documents, window in tokens. FlashAttention
    takes bf16 (and fp16) only: fp32 parameters (--param-dtype float32) take the dense path."""
    if q.dtype != torch.bfloat16:
        return dense_attend(q, k, v, seq, window, scale)
    return doc_attention(q, k, v, seq.cu, window, seq.max_len, scale)[0]
