"""The record #74 model features of train_gpt.py (bigram hash embedding, paired-head attention, multi-token
prediction, smear, YaRN, key offset, backout, FP8 head, attention lambdas), each against a construction written
again here from the public record's description (float64 where possible), plus one full forward with every
feature on against a float64 reference model, and a short check that every --no-<feature> flag runs.

CPU: fp32 and float64, dense attention, the cross-entropy reference. GPU only (skipped without CUDA): the FP8
head against bf16, and the compiled head with the Triton cross-entropy kernel against the reference.
"""
import collections
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from test_cross_entropy import _scaled_mm_works
from tolerances import assert_close_report, assert_matches_torch

import cli
import train_gpt as tg
from distributed import Dist
from kernels.cross_entropy import fp8_head_ce_bwd, softcapped_cross_entropy_bwd_e5m2

HAS_CUDA = torch.cuda.is_available()
FEATURES = ("bigram", "paired_heads", "mtp", "smear", "yarn", "key_offset", "backout", "fp8_head", "attn_lambdas")


def norm(x):
    """RMS norm with F.rms_norm's default epsilon (the unit roundoff of x's dtype)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def spec_hash(ids, rows, bos):
    """Record #74's get_bigram_hash in Python integers with int32 semantics: position 0 -> rows - 1, else
    (36313 * cur xor 27191 * prev) mod (rows - 1); and our rule: a BOS -> rows - 1."""
    out = [rows - 1]
    for prev, cur in zip(ids[:-1], ids[1:]):
        if cur == bos:
            out.append(rows - 1)
            continue
        a, b = (36313 * cur) & 0xFFFFFFFF, (27191 * prev) & 0xFFFFFFFF
        v = a ^ b
        v = v - (1 << 32) if v >= 1 << 31 else v  # int32
        out.append(v % (rows - 1))
    return out


def spec_freq(D):
    """Angular frequency of rotary pair (i, i + D/2), float64: D/4 from 1 to 1/1024, then D/4 zeros."""
    f = [(1 / 1024) ** (j / (D // 4 - 1)) for j in range(D // 4)]
    return torch.tensor(f + [0.0] * (D // 4), dtype=torch.float64)


def spec_yarn(freq, scale, windows_tokens):
    """YaRN as record #74's Yarn.apply, in float64, along a list of long windows (tokens)."""
    for old, new in zip(windows_tokens, windows_tokens[1:]):
        turns = old * freq / (2 * math.pi)
        ramp = ((turns - 1) / 31).clamp(0, 1)
        freq = freq * (old / new + ramp * (1 - old / new))
        scale = scale * (0.2 * math.log(new / old) + 1)
    return freq, scale


def rope(x, angle):
    """x (..., D), angle (..., D/2) broadcastable: rotate pairs (i, i + D/2) by angle (our layout)."""
    D = x.shape[-1]
    a, b = x[..., :D // 2], x[..., D // 2:]
    c, s = angle.cos(), angle.sin()
    return torch.cat([a * c + b * s, b * c - a * s], -1)


def masked_attention(q, k, v, docs, window, scale):
    """Explicit softmax attention, q/k/v (S, H, D): key j visible from i iff j <= i, i - j < window, same doc."""
    S = q.shape[0]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    mask = (j <= i) & (i - j < window) & (docs[:, None] == docs[None])
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)


def docs_of(ids, bos):
    out, d = [], 0
    for t in ids.tolist():
        d += t == bos
        out.append(d)
    return torch.tensor(out)


# ----------------------------------------------------------------------------------------------------
# Bigram hash


def test_bigram_hash_formula_range_and_position_zero():
    rows = 5 * 512
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (300,), generator=g, dtype=torch.int32)
    ids[[0, 17, 150]] = 511  # BOS tokens, including position 0
    got = tg.bigram_hash(ids, rows, 511)
    assert got.dtype == torch.int32
    assert got.tolist() == spec_hash(ids.tolist(), rows, 511)
    assert got[0] == rows - 1 and got[17] == rows - 1 and got[150] == rows - 1  # position 0 and BOS: reserved
    others = got[ids != 511]
    assert 0 <= int(others.min()) and int(others.max()) < rows - 1  # the others never use the reserved row
    assert got[18] == spec_hash([511, int(ids[18])], rows, -1)[1]  # the token after a BOS hashes with the BOS
    assert torch.equal(tg.bigram_hash(ids.clone(), rows, 511), got)  # deterministic
    # GPT-2 sized ids: int32 products stay below 2^31, our int64 arithmetic gives the same
    big = torch.tensor([50256, 50255, 0, 50303, 12345], dtype=torch.int32)
    assert tg.bigram_hash(big, 5 * 50304, 50256).tolist() == spec_hash(big.tolist(), 5 * 50304, 50256)


def test_loader_hashes_bigrams_of_its_ids(tmp_path):
    import numpy as np
    from data.shards import write_shard
    rng = np.random.default_rng(0)
    docs = [np.concatenate([[511], rng.integers(0, 511, size=int(rng.integers(20, 200)))]) for _ in range(120)]
    write_shard(tmp_path / "t_000001.bin", np.concatenate(docs).astype(np.uint16))
    hp = tg.smoke_hyperparameters()
    loader = tg.TrainLoader(hp, [tmp_path / "t_000001.bin"], Dist(), lambda s: 128)
    mbs = loader.next()
    loader.close()
    for mb in mbs:
        assert mb.bigram.tolist() == spec_hash(mb.ids.tolist(), hp.bigram_vocab_size, hp.bos_id)
        assert torch.equal(mb.bigram_prep.sorted_ids, torch.sort(mb.bigram).values)
    off = tg.TrainLoader(dataclasses.replace(hp, bigram=False), [tmp_path / "t_000001.bin"], Dist(), lambda s: 128)
    mb = off.next()[0]
    off.close()
    assert mb.bigram is None and mb.bigram_prep is None


# ----------------------------------------------------------------------------------------------------
# YaRN and the multi-token schedule


def test_yarn_state_follows_the_stage_path():
    hp = tg.Hyperparameters()
    f0 = spec_freq(hp.head_dim)
    assert_close_report(tg.rotary_freq(hp).double(), f0, atol=0, rtol=8 * 2 ** -24, name="base freq")
    # (1,3) -> (3,7) -> (5,11) -> (6,13): the long window goes 3 -> 7 -> 11 -> 13 blocks
    for w, path in [(3, [3]), (7, [3, 7]), (11, [3, 7, 11]), (13, [3, 7, 11, 13])]:
        freq, scale = tg.yarn_state(hp, w)
        ef, es = spec_yarn(f0, hp.attn_scale, [128 * x for x in path])
        assert_close_report(freq.double(), ef, atol=0, rtol=8 * 2 ** -24, name=f"yarn freq w={w}")
        assert scale == pytest.approx(es, rel=1e-12)
    # a window the table never reaches: one update from the first stage's long window
    freq, scale = tg.yarn_state(hp, 20)
    ef, es = spec_yarn(f0, hp.attn_scale, [384, 2560])
    assert_close_report(freq.double(), ef, atol=0, rtol=8 * 2 ** -24, name="yarn freq w=20")
    assert scale == pytest.approx(es, rel=1e-12)
    # sanity of the hand computation: fast pairs kept, slow pairs interpolated, position-free pairs stay 0
    ef, _ = spec_yarn(f0, 1.0, [384, 896])
    assert ef[0] == f0[0] and ef[hp.head_dim // 4 - 1] == pytest.approx(f0[hp.head_dim // 4 - 1] * 384 / 896)
    assert (ef[hp.head_dim // 4:] == 0).all()
    off = dataclasses.replace(hp, yarn=False)
    freq, scale = tg.yarn_state(off, 13)
    assert torch.equal(freq, tg.rotary_freq(hp)) and scale == hp.attn_scale


def test_final_validation_widens_the_window_without_rescaling():
    """Record #74's last validation: the long window becomes 20 blocks, the rotary frequencies and the softmax
    scale stay those of the last stage's window (13 blocks: its apply_final_ws_ext changes the window only)."""
    hp = tg.Hyperparameters()
    windows, yarn_long = tg.val_windows(hp, hp.total_steps)
    assert (windows, yarn_long) == ((6, 20), 13)
    T = 256
    tables = tg.attn_tables(hp, T, windows, {}, torch.device("cpu"), yarn_long=yarn_long)
    f13, s13 = spec_yarn(spec_freq(hp.head_dim), 0.1, [128 * x for x in (3, 7, 11, 13)])
    ang = torch.arange(T, dtype=torch.float64)[:, None, None] * f13.float().double()
    assert_close_report(tables.cos.double(), torch.cat([ang.cos(), ang.cos()], -1), atol=2 ** -8,
                        name="final cos: the 13-block YaRN")
    assert tables.qscale.item() == pytest.approx(s13, rel=1e-6)
    assert (int(tables.short), int(tables.long)) == (6 * 128, 20 * 128)
    rescaled = tg.attn_tables(hp, T, windows, {}, torch.device("cpu"))  # what widening with YaRN would give
    assert rescaled.qscale.item() > 1.02 * tables.qscale.item()
    # before the end, a validation uses the step's own windows and tables
    assert tg.val_windows(hp, 250) == (tg.windows_at(hp, 250), None)


def test_rotary_tables_plain_and_paired():
    """Full width: cos = [c, c] and sin = [s, -s] over the D dims, c and s of the pairs' angles."""
    hp = tg.smoke_hyperparameters(num_heads=4, head_dim=16)
    T, H = 8, 4
    freq, _ = spec_yarn(spec_freq(16), 1.0, [128, 256])
    cos, sin = tg.rotary_tables(hp, T, torch.device("cpu"), torch.float64, freq.float())
    ang = torch.arange(T, dtype=torch.float64)[:, None, None] * freq.float().double()
    assert cos.shape == sin.shape == (T, 1, 16)
    assert_close_report(cos, torch.cat([ang.cos(), ang.cos()], -1), atol=1e-6, name="cos")
    assert_close_report(sin, torch.cat([ang.sin(), -ang.sin()], -1), atol=1e-6, name="sin")
    cos, sin = tg.rotary_tables(hp, T, torch.device("cpu"), torch.float64, freq.float(), paired=True)
    assert cos.shape == sin.shape == (T, H, 16)
    for h in range(H):  # head h of token t: position 2t + h % 2
        ang = (2 * torch.arange(T, dtype=torch.float64) + h % 2)[:, None] * freq.float().double()
        assert_close_report(cos[:, h], torch.cat([ang.cos(), ang.cos()], -1), atol=1e-6, name=f"paired cos head {h}")
        assert_close_report(sin[:, h], torch.cat([ang.sin(), -ang.sin()], -1), atol=1e-6, name=f"paired sin head {h}")


def half_split_rotary(x, cos, sin):
    """The rotation of pairs (x[i], x[i + D/2]) as two halves concatenated, from the half-width tables c = cos[:D/2]
    and s = sin[:D/2]: [x1 c + x2 s, x2 c - x1 s]."""
    D = x.shape[-1]
    c, s = cos[..., :D // 2], sin[..., :D // 2]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], -1)


def concatenated_key_offset(k, bos):
    """The key offset with the previous token's key as a concatenation [k[0], k[:-1]] (k[0] keeps its own)."""
    D = k.shape[-1]
    stationary = torch.arange(D) % (D // 2) >= D // 4
    return torch.where(stationary & ~bos[:, None, None], torch.cat([k[:1], k[:-1]]), k)


def with_lambdas(fn):
    """The attention sublayer fn taking its four weights and the layer's (W_qkv, W_o) lambdas lam (2,) after them,
    as make_layers applies them: each weight times its lambda, taken in at least fp32 and rounded to the weights'
    dtype once (so lam's gradient is one sum over the four products, rounded once); W_q, W_k and W_v go in as one
    (3C, C) block, as make_layers' view of the bank does."""
    def call(x, wq, wk, wv, wo, lam, *rest, **kw):
        m = lam.to(torch.promote_types(lam.dtype, torch.float32))
        w = torch.stack([wq, wk, wv, wo]) * torch.stack([m[0], m[0], m[0], m[1]])[:, None, None]
        w = w.to(wq.dtype)
        return fn(x, w[:3].flatten(0, 1), w[3], *rest, **kw)
    return call


def _sublayer_grads(hp, fn, dtype, paired, key_offset, T=128, window=48):
    """The attention sublayer fn (dense attention) on _sublayer_inputs in dtype: [out, d of every input]."""
    inp = _sublayer_inputs(hp, T, seed=5)
    freq, scale = tg.yarn_state(hp, 2)
    cos, sin = tg.rotary_tables(hp, T, torch.device("cpu"), dtype, freq, paired=paired)
    docs = tg.doc_ids(inp["ids"], hp.bos_id)
    seq = tg.DocSeq(None, docs.repeat_interleave(2) if paired else docs, None)
    leaves = [t.to(dtype).requires_grad_() for t in (inp["x"], *inp["W"], inp["lam"], inp["ag"], inp["ve"], inp["vg"])]
    bos = inp["ids"] == hp.bos_id
    bos[0] = False  # a sequence that starts inside a document: the key offset's rule for position 0 is seen
    out = fn(*leaves, cos, sin, torch.tensor(scale, dtype=dtype), seq, torch.tensor(window), paired=paired,
             key_offset=key_offset, bos=bos)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(dtype)
    return [out, *torch.autograd.grad(out, leaves, dy)]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _dense_attend_contiguous_grads(q, k, v, seq, window, scale):
    """dense_attend, with the gradients of q, k, v handed back contiguous, as FlashAttention's backward gives them
    (SDPA's CPU backward leaves them in a permuted layout, which elementwise ops keep; the CPU's rms_norm backward
    then sums in another order, which would hide what this file compares)."""
    return tg.dense_attend(*(_ContiguousGrad.apply(t) for t in (q, k, v)), seq, window, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paired,key_offset", [(False, False), (False, True), (True, False)])
def test_rotary_and_key_offset_are_the_concatenating_forms_bit_for_bit(dtype, paired, key_offset, monkeypatch):
    """rotary's full-width form computes, per element, the products and the sum of the half-split formula, and
    offset_keys selects the values the concatenation [k[0], k[:-1]] does (its gradient sums the same terms): the
    attention sublayer's output and every gradient are the same bits with either (eager, CPU; in bf16 every
    product and sum is rounded as the half-split formula rounds it)."""
    hp = tg.smoke_hyperparameters(num_heads=4, head_dim=16)
    fn = with_lambdas(tg.make_attn_sublayer(hp, _dense_attend_contiguous_grads))
    got = _sublayer_grads(hp, fn, dtype, paired, key_offset)
    monkeypatch.setattr(tg, "rotary", half_split_rotary)
    monkeypatch.setattr(tg, "offset_keys", concatenated_key_offset)
    want = _sublayer_grads(hp, fn, dtype, paired, key_offset)
    names = ["out", "dx", "dWq", "dWk", "dWv", "dWo", "dlam", "dgate", "dve", "dvegate"]
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs from the concatenating forms ({dtype}, paired={paired}, " \
                                  f"key_offset={key_offset}): max |diff| {(a.double() - b.double()).abs().max():.3g}"


# Ops that move or gather data rather than compute (each one a copy, a concatenation or a masked load in the
# compiled code): the q/k path's forward and backward graphs should hold none of them but unbind's stacking.
DATA_MOVEMENT = {"cat", "stack", "split", "split_with_sizes", "chunk", "slice", "slice_scatter", "select_scatter",
                 "index", "gather", "constant_pad_nd", "copy", "clone"}


def _traced_graphs(fn, args):
    """The forward and backward graphs inductor would be given for fn(*args) (dynamo, AOT autograd with inductor's
    decompositions and its partitioner), as {name: {op name: count}}, with the total under "nodes"."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            ops = collections.Counter(getattr(getattr(n.target, "overloadpacket", None), "__name__", str(n.target))
                                      for n in gm.graph.nodes if n.op == "call_function")
            graphs[name] = dict(ops, nodes=len(gm.graph.nodes))
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), decompositions=select_decomp_table(),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
        sum(o.float().sum() for o in out).backward()
    finally:
        torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("paired,key_offset", [(False, False), (True, False), (False, True)])
def test_rotary_traces_to_elementwise_ops_only(paired, key_offset, monkeypatch):
    """The q/k path of the attention sublayer (the projection's output as q, k, v, QK-norm, rotary, the softmax
    scale, the key offset), as inductor receives it: in the forward no op that moves data (with the key offset,
    no concatenation: the shifted read is a slice and a pad, which inductor lowers to indexing), in the backward
    only the stacking of (dq, dk, dv) into the projection's gradient (unbind's backward) for a concatenation, and
    fewer nodes in all than the concatenating forms trace to (the half-split rotary slices and concatenates the
    halves in both directions)."""
    hp = tg.smoke_hyperparameters(num_heads=4, head_dim=16)
    T, H, D = 64, hp.num_heads, hp.head_dim
    dtype = torch.bfloat16
    cos, sin = tg.rotary_tables(hp, T, torch.device("cpu"), dtype, paired=paired)
    qscale = torch.tensor(0.12, dtype=dtype)
    bos = torch.zeros(T, dtype=torch.bool)
    bos[[0, 20]] = True

    def qk(qkv):
        q, k, v = qkv.view(T, 3, H, D).unbind(1)
        k = tg.rotary(tg.rms_norm(k), cos, sin)
        return tg.rotary(tg.rms_norm(q), cos, sin) * qscale, tg.offset_keys(k, bos) if key_offset else k, v

    qkv = torch.randn(T, 3 * H * D, dtype=dtype, requires_grad=True)
    ours = _traced_graphs(qk, (qkv,))
    moved = {g: {op: n for op, n in ops.items() if op in DATA_MOVEMENT} for g, ops in ours.items()}
    if key_offset:
        assert "cat" not in moved["fw"] and moved["bw"].get("cat") == 1, f"concatenations in the graphs: {moved}"
    else:
        assert moved == {"fw": {}, "bw": {"cat": 1}}, f"data movement in the q/k path's graphs: {moved}"
    monkeypatch.setattr(tg, "rotary", half_split_rotary)
    monkeypatch.setattr(tg, "offset_keys", concatenated_key_offset)
    split = _traced_graphs(qk, (qkv,))
    for g in ("fw", "bw"):
        assert ours[g]["nodes"] < split[g]["nodes"], f"{g}: {ours[g]['nodes']} nodes, concatenating forms " \
                                                     f"{split[g]['nodes']}"


def test_mtp_weights_follow_the_record_schedule():
    hp = tg.Hyperparameters(scheduled_steps=1450, extension_steps=40)  # record #74's schedule
    assert tg.mtp_weights_at(hp, 0) == (1.0, 0.5, 0.25)
    # stages of 1450 scheduled steps: 0..483, 483..967, 967..1450, then the extension to 1490
    assert tg.mtp_weights_at(hp, 161) == pytest.approx((1.0, 0.5, 0.25 * 2 / 3))  # a third of stage 0
    assert tg.mtp_weights_at(hp, 483) == (1.0, 0.5)
    assert tg.mtp_weights_at(hp, 725) == pytest.approx((1.0, 0.25))  # half of stage 1
    assert tg.mtp_weights_at(hp, 967) == (1.0,) and tg.mtp_weights_at(hp, 1489) == (1.0,)
    assert tg.mtp_weights_at(dataclasses.replace(hp, mtp=False), 0) == (1.0,)
    smoke = tg.smoke_hyperparameters()
    assert [len(tg.mtp_weights_at(smoke, s)) for s in range(smoke.total_steps)] == [3] * 4 + [2] * 4 + [1] * 2


# ----------------------------------------------------------------------------------------------------
# Multi-token loss


def test_mtp_loss_is_the_weighted_sum_inside_the_micro_batch():
    """head_loss (CPU: cross-entropy reference) with weights [1, 0, 0] is the plain mean CE; with
    [1, .5, .25] the mean over rows t of sum_k w_k CE(z_t, target[t + k]) for t + k < N, written out here."""
    hp = tg.smoke_hyperparameters()
    g = torch.Generator().manual_seed(1)
    N, C, V = 37, 16, 50
    x = torch.randn(N, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, V, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    xn = x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(torch.float64).eps)  # F.rms_norm, float64
    z = hp.softcap * torch.sigmoid((xn @ w + 5) / 7.5)
    ce = F.cross_entropy(z, targets, reduction="none")
    loss = lambda wk: tg.head_loss(x, w, targets, torch.tensor(wk, dtype=torch.float64), hp.softcap,
                                   tg.softcapped_cross_entropy_ref, False)
    assert_close_report(loss([1.0, 0.0, 0.0]), ce.mean(), atol=1e-12, name="mtp [1,0,0]")
    wk = [1.0, 0.5, 0.25]
    total = 0.0
    for t in range(N):
        for k in range(3):
            if t + k < N:
                total += wk[k] * F.cross_entropy(z[t:t + 1], targets[t + k:t + k + 1])
    assert_close_report(loss(wk), total / N, atol=1e-12, name="mtp [1,.5,.25]")


# ----------------------------------------------------------------------------------------------------
# Attention sublayer: paired heads, key offset, lambdas


def _sublayer_inputs(hp, T, seed):
    g = torch.Generator().manual_seed(seed)
    C, H = hp.model_dim, hp.num_heads
    ids = torch.randint(0, 500, (T,), generator=g, dtype=torch.int32)
    ids[[0, 50, 51, 90]] = hp.bos_id
    W = [torch.randn(C, C, generator=g, dtype=torch.float64) * C ** -0.5 for _ in range(4)]
    return dict(ids=ids, x=torch.randn(T, C, generator=g, dtype=torch.float64), W=W,
                lam=torch.tensor([0.7, 1.3], dtype=torch.float64),
                ag=torch.randn(H, hp.gate_dims, generator=g, dtype=torch.float64) * 0.3,
                ve=torch.randn(T, C, generator=g, dtype=torch.float64),
                vg=torch.randn(H, hp.gate_dims, generator=g, dtype=torch.float64) * 0.3)


def spec_xsa_part(y, v):
    """y, v (T, H, D): head by head, y's projection on its token's own value normalised as public record #82 does,
    vn = v / max(|v|, 1e-4): (y . vn) vn."""
    out = []
    for hh in range(y.shape[1]):
        yh, vh = y[:, hh], v[:, hh]
        vn = vh / torch.linalg.vector_norm(vh, dim=-1, keepdim=True).clamp_min(1e-4)
        out.append((yh * vn).sum(-1, keepdim=True) * vn)
    return torch.stack(out, 1)


def spec_xsa(y, v, alpha):
    """XSA as record #82 writes it: y - tanh(alpha[h]) (y . vn) vn per head h; alpha (H,) the raw parameters."""
    return y - torch.tanh(alpha)[:, None] * spec_xsa_part(y, v)


def _spec_sublayer(hp, inp, window, scale, freq, paired, key_offset, xsa=None, v_add=None, ve_gate=None):
    """The attention sublayer written out: lambdas on the weights, QK-norm, rotary, key offset, value
    embedding, and for paired heads the explicit interleaved sequence of record #74; xsa (H,): XSA's raw alphas
    (spec_xsa; unpaired heads only) or None. --mudd's last layer: v_add (T, H, D) added to the values and
    ve_gate (T, H) the value embedding's gate (else record #74's 2 sigmoid(.))."""
    x, (Wq, Wk, Wv, Wo), lam = inp["x"], inp["W"], inp["lam"]
    T, C = x.shape
    H, D, G = hp.num_heads, hp.head_dim, hp.gate_dims
    h = norm(x)
    q = (h @ (lam[0] * Wq).T).view(T, H, D)
    k = (h @ (lam[0] * Wk).T).view(T, H, D)
    v = (h @ (lam[0] * Wv).T).view(T, H, D)
    q, k = norm(q), norm(k)
    docs = docs_of(inp["ids"], hp.bos_id)
    # record #74's value-embedding gate: paired layers read 12 dims of the normed input, the others 6 of it and
    # 6 of the value embedding
    g_in = h[:, :G] if paired else torch.cat([h[:, :6], inp["ve"][:, :6]], dim=1)
    if ve_gate is None:
        ve_gate = 2 * torch.sigmoid(g_in @ inp["vg"].T)
    if v_add is not None:
        v = v + v_add
    v = v + ve_gate[..., None] * inp["ve"].view(T, H, D)
    if not paired:
        ang = torch.arange(T, dtype=x.dtype)[:, None, None] * freq.to(x.dtype)
        q, k = rope(q, ang), rope(k, ang)
        if key_offset:
            still = torch.cat([freq == 0, freq == 0])  # dims whose rotation angle is always 0
            k2 = k.clone()
            for t in range(1, T):
                if inp["ids"][t] != hp.bos_id:  # a BOS keeps its own key
                    k2[t, :, still] = k[t - 1, :, still]
            k = k2
        y = masked_attention(q, k, v, docs, window, scale)
        if xsa is not None:
            y = spec_xsa(y, v, xsa)
    else:
        assert xsa is None, "XSA is defined for unpaired heads only"
        # new head j: old head j at position 2t, old head j + H/2 at position 2t + 1; old head h is rotated
        # as position 2t + h % 2 (record #74 rotates pairs (2j, 2j+1) before reading the memory as 2T tokens)
        Hp = H // 2
        qs, ks, vs = (torch.zeros(2 * T, Hp, D, dtype=x.dtype) for _ in range(3))
        for t in range(T):
            for hh in range(H):
                pos, j = 2 * t + hh // Hp, hh % Hp
                ang = (2 * t + hh % 2) * freq
                qs[pos, j], ks[pos, j], vs[pos, j] = rope(q[t, hh], ang), rope(k[t, hh], ang), v[t, hh]
        ys = masked_attention(qs, ks, vs, docs.repeat_interleave(2), window, scale)
        y = torch.zeros(T, H, D, dtype=x.dtype)
        for t in range(T):
            for hh in range(H):
                y[t, hh] = ys[2 * t + hh // Hp, hh % Hp]
    y = y * torch.sigmoid(h[:, :G] @ inp["ag"].T)[..., None]
    return y.reshape(T, C) @ (lam[1] * Wo).T


@pytest.mark.parametrize("paired,key_offset,heads", [(True, False, 4), (True, False, 2), (False, True, 4),
                                                     (False, False, 4)])
def test_attention_sublayer_matches_explicit_construction(paired, key_offset, heads):
    hp = tg.smoke_hyperparameters(num_heads=heads, head_dim=64 // heads)
    T, window = 128, 48
    inp = _sublayer_inputs(hp, T, seed=3)
    freq, scale = spec_yarn(spec_freq(hp.head_dim), 0.12, [128, 256])
    expected = _spec_sublayer(hp, inp, window, scale, freq, paired, key_offset)
    fn = with_lambdas(tg.make_attn_sublayer(hp, tg.dense_attend))

    def run(dtype):
        fq = freq.to(dtype)
        cos, sin = tg.rotary_tables(hp, T, torch.device("cpu"), dtype, fq, paired=paired)
        docs = tg.doc_ids(inp["ids"], hp.bos_id)
        seq = tg.DocSeq(None, docs.repeat_interleave(2) if paired else docs, None)  # the dense path reads docs
        with torch.no_grad():
            return fn(inp["x"].to(dtype), *(w.to(dtype) for w in inp["W"]), inp["lam"].to(dtype), inp["ag"].to(dtype),
                      inp["ve"].to(dtype), inp["vg"].to(dtype), cos, sin, torch.tensor(scale, dtype=dtype), seq,
                      torch.tensor(window), paired=paired, key_offset=key_offset, bos=inp["ids"] == hp.bos_id)

    assert_close_report(run(torch.float64), expected, atol=1e-10, name="float64 sublayer")
    assert_matches_torch(run(torch.float32), expected, _spec_sublayer(
        hp, {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else
                 [w.float() for w in v] if isinstance(v, list) else v) for k, v in inp.items()},
        window, float(scale), freq.float(), paired, key_offset), name="fp32 sublayer")
    # the construction matters: the plain sublayer differs
    if paired or key_offset:
        plain = _spec_sublayer(hp, inp, window, scale, freq, False, False)
        assert (plain - expected).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------------
# XSA (--xsa): the sublayer and the layers against record #82's projection written again (spec_xsa)


def test_xsa_part_matches_the_normalised_projection_for_every_size_of_v():
    """xsa_part (the floor of v.v at 1e-8) against record #82's projection on v / max(|v|, 1e-4) in float64, for
    values of ordinary size, just above and below |v| = 1e-4, tiny and zero: the same function (rule 1 in fp32 with
    the spec in fp32; float64 within a few ulps), no NaN, and zero for v = 0."""
    gen = torch.Generator().manual_seed(11)
    T, H, D = 6, 3, 40
    y = torch.randn(T, H, D, generator=gen, dtype=torch.float64) - 0.3
    v = torch.randn(T, H, D, generator=gen, dtype=torch.float64) + 0.2
    for t, size in ((1, 3e-4), (2, 1e-4 * (1 + 2 ** -20)), (3, 0.7e-4), (4, 1e-9), (5, 0.0)):
        v[t] = v[t] / torch.linalg.vector_norm(v[t], dim=-1, keepdim=True) * size
    spec64, spec32 = spec_xsa_part(y, v), spec_xsa_part(y.float(), v.float())
    assert_close_report(tg.xsa_part(y, v), spec64, atol=1e-14 * spec64.abs().max().item(), name="xsa_part float64")
    assert_matches_torch(tg.xsa_part(y.float(), v.float()), spec64, spec32, name="xsa_part fp32")
    assert not tg.xsa_part(y, v)[5].any() and torch.isfinite(tg.xsa_part(y, v)).all()
    assert tg.xsa_part(y, v)[4].abs().max() < 1e-9 * y[4].abs().max(), "tiny v: a part of order |v|^2 / 1e-8"


def _xsa_hp(**overrides):
    """A layout where every index means something else: 4 layers and 4 heads (alpha (4, 4): its transpose indexes
    too), layer 0 paired, layer 1 without attention (attention index != layer index from layer 2 on); XSA acts on
    layers 2 and 3."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511, num_heads=4, head_dim=16,
                                  no_attn_layers=(1,), paired_head_layers=(0,), xsa=True)
    assert hp.xsa_layers == [2, 3] and hp.attn_layers == [0, 2, 3]
    return dataclasses.replace(hp, **overrides)


@pytest.mark.parametrize("key_offset", [False, True])
def test_xsa_sublayer_and_its_gradients_match_the_spec(key_offset):
    """The unpaired sublayer with XSA (a different alpha per head; one token with v = 0) against _spec_sublayer with
    spec_xsa: output and the gradients of every input, alpha included (through tanh), in float64 (1e-10) and in
    fp32 (rule 1, the spec in fp32 as torch's yardstick); alpha zero is bitwise the sublayer without XSA; the token
    with v = 0 gets no NaN and keeps its output without XSA."""
    hp = _xsa_hp()
    T, window, zero_v = 128, 48, 77
    inp = _sublayer_inputs(hp, T, seed=4)
    inp["x"][zero_v] = 0  # normed input 0, so q, k, v = 0 there before the value embedding ...
    inp["ve"][zero_v] = 0  # ... and after it
    inp["alpha"] = torch.tensor([0.9, -0.6, 0.25, -1.4], dtype=torch.float64)
    freq, scale = spec_yarn(spec_freq(hp.head_dim), 0.12, [128, 256])
    fn = with_lambdas(tg.make_attn_sublayer(hp, tg.dense_attend))
    names = ["x", "Wq", "Wk", "Wv", "Wo", "lam", "ag", "ve", "vg", "alpha"]
    dy = torch.randn(T, hp.model_dim, generator=torch.Generator().manual_seed(8), dtype=torch.float64)

    def leaves(dtype):
        return [t.to(dtype).requires_grad_() for t in [inp["x"], *inp["W"], inp["lam"], inp["ag"], inp["ve"],
                                                       inp["vg"], inp["alpha"]]]

    def ours(dtype, xsa=True, alpha=None):
        x, wq, wk, wv, wo, lam, ag, ve, vg, a = leaves(dtype)
        a = a if alpha is None else alpha.to(dtype).requires_grad_()
        cos, sin = tg.rotary_tables(hp, T, torch.device("cpu"), dtype, freq.to(dtype))
        seq = tg.DocSeq(None, tg.doc_ids(inp["ids"], hp.bos_id), None)
        out = fn(x, wq, wk, wv, wo, lam, ag, ve, vg, cos, sin, torch.tensor(scale, dtype=dtype), seq,
                 torch.tensor(window), key_offset=key_offset, bos=inp["ids"] == hp.bos_id,
                 xsa=torch.tanh(a) if xsa else None)
        grads = torch.autograd.grad(out, [x, wq, wk, wv, wo, lam, ag, ve, vg] + ([a] if xsa else []), dy.to(dtype))
        return [out, *grads]

    def spec(dtype):
        x, wq, wk, wv, wo, lam, ag, ve, vg, a = leaves(dtype)
        out = _spec_sublayer(hp, dict(ids=inp["ids"], x=x, W=[wq, wk, wv, wo], lam=lam, ag=ag, ve=ve, vg=vg), window,
                             scale if dtype == torch.float64 else float(scale), freq.to(dtype), False, key_offset,
                             xsa=a)
        return [out, *torch.autograd.grad(out, [x, wq, wk, wv, wo, lam, ag, ve, vg, a], dy.to(dtype))]

    got64, got32, ref64, ref32 = ours(torch.float64), ours(torch.float32), spec(torch.float64), spec(torch.float32)
    for name, a64, a32, e64, e32 in zip(["out"] + ["d" + n for n in names], got64, got32, ref64, ref32):
        assert torch.isfinite(a32).all() and torch.isfinite(a64).all(), name
        assert_close_report(a64, e64, atol=1e-10 * max(1.0, e64.abs().max().item()), name=f"float64 xsa {name}")
        assert_matches_torch(a32, e64, e32, name=f"fp32 xsa {name}")
    plain = ours(torch.float64, xsa=False)
    assert (plain[0] - got64[0]).abs().max() > 1e-2, "XSA changes the output (the comparisons would see it missing)"
    assert torch.equal(plain[0][zero_v], got64[0][zero_v]), "v = 0: nothing to remove"
    zero = ours(torch.float32, alpha=torch.zeros(hp.num_heads))
    for name, z, p in zip(["out"] + ["d" + n for n in names[:-1]], zero, ours(torch.float32, xsa=False)):
        assert torch.equal(z, p), f"alpha = 0: {name} is not bitwise the sublayer's without XSA"


def _xsa_logits(hp, params, ids, windows=(1, 2)):
    fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False, attention="dense")
    x = fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), windows, {}))
    return tg.head_logits(x, params["lm_head"], hp.softcap)


def test_xsa_layers_and_their_gradients_match_the_reference():
    """fp32 layers + head with --xsa and an alpha of its own in every row (perturbed) against spec_forward in
    float64 (rule 1, spec_forward in fp32 as the yardstick): the logits and the gradient of every parameter the
    spec reads (alpha's rows of layers 2 and 3, and zero in its paired and attention-free rows); the logits move
    away from --no-xsa's. A tanh left out, another sign, alpha read by attention index or transposed, or XSA in the
    paired layer is off by far more than the bound."""
    hp = _xsa_hp()
    params = perturbed(hp, seed=12)
    ids, windows = _ids(hp, 256, seed=13), (1, 2)
    dlogits = torch.randn(256, hp.vocab_size, generator=torch.Generator().manual_seed(14))
    ours = _xsa_logits(hp, params, ids, windows)
    grads = dict(zip(params, torch.autograd.grad(ours, list(params.values()), dlogits, allow_unused=True)))
    P64 = {k: v.detach().double().requires_grad_() for k, v in params.items()}
    P32 = {k: v.detach().float().requires_grad_() for k, v in params.items()}
    ref64, ref32 = spec_forward(hp, P64, ids, windows), spec_forward(hp, P32, ids, windows)
    assert_matches_torch(ours.detach(), ref64.detach(), ref32.detach(), name="logits with xsa")
    g64 = dict(zip(P64, torch.autograd.grad(ref64, list(P64.values()), dlogits.double(), allow_unused=True)))
    g32 = dict(zip(P32, torch.autograd.grad(ref32, list(P32.values()), dlogits, allow_unused=True)))
    for k in params:
        if g64[k] is None:  # the spec does not read it (the embedding tables are looked up by index: it does)
            assert grads[k] is None or not grads[k].any(), k
            continue
        assert_matches_torch(grads[k], g64[k], g32[k], name=f"d{k} with xsa")
    assert grads["xsa_alpha"][[2, 3]].abs().min() > 0 and not grads["xsa_alpha"][[0, 1]].any()
    off = _xsa_logits(dataclasses.replace(hp, xsa=False), params, ids, windows)
    assert (off - ours).abs().max() > 1e-2, "--xsa does not change the logits"


def test_xsa_reads_only_its_layers_rows_and_alpha_zero_is_off():
    """Bitwise: --xsa with alpha zero gives --no-xsa's logits; so does --xsa with alpha nonzero in the rows of the
    paired layer 0 and the attention-free layer 1 only; --no-xsa ignores alpha whatever its values."""
    hp = _xsa_hp()
    params = perturbed(hp, seed=15)
    ids = _ids(hp, 256, seed=16)
    with torch.no_grad():
        off = _xsa_logits(dataclasses.replace(hp, xsa=False), params, ids)
        params["xsa_alpha"][2:] = 0
        assert torch.equal(_xsa_logits(hp, params, ids), off), "alpha of a layer without XSA was read"
        params["xsa_alpha"].zero_()
        assert torch.equal(_xsa_logits(hp, params, ids), off), "alpha zero is not bitwise --no-xsa"
        assert torch.equal(_xsa_logits(dataclasses.replace(hp, xsa=False), params, ids), off)


def test_xsa_layers_come_from_the_layout():
    """XSA's layers: the attention layers without paired heads, from the flags (on by default; none with --no-xsa);
    all attention layers with --no-paired-heads; an --xsa that acts nowhere is refused in one line, and the
    sublayer refuses XSA with paired heads."""
    hp = tg.Hyperparameters()
    assert hp.xsa_layers == [1, 3, 4, 7, 8, 10]
    assert tg.Hyperparameters(xsa=False).xsa_layers == []
    assert dataclasses.replace(hp, paired_heads=False).xsa_layers == [0, 1, 2, 3, 4, 5, 7, 8, 9, 10]
    assert _xsa_hp(paired_head_layers=(0, 3)).xsa_layers == [2]
    args, hp = cli.parse_args(["--smoke", "--xsa"], tg.Hyperparameters, tg.smoke_hyperparameters)
    assert hp.xsa and hp.xsa_layers == [1, 3]
    args, hp = cli.parse_args(["--smoke", "--xsa", "--paired-head-layers", "0,1,2,3"], tg.Hyperparameters,
                              tg.smoke_hyperparameters)
    with pytest.raises(tg.SettingsError, match="--xsa: every attention layer has paired heads"):
        cli.check_settings(hp, args, tg.check_world_size, tg.untie_step, tg.BLOCK)
    with pytest.raises(ValueError, match="XSA needs one value vector per head and token"):
        tg.make_attn_sublayer(hp, tg.dense_attend)(*[None] * 11, paired=True, xsa=torch.zeros(hp.num_heads))


# ----------------------------------------------------------------------------------------------------
# Smear, backout, bigram, lambdas: one full forward against a float64 reference model


def spec_gelu(x):
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))


MUDD_SCALE = 0.2 / 3 ** 0.5  # record #81's _mudd_scale: 0.2 / sqrt(its three sources)


def spec_mudd_layer(P, x, start, back, H):
    """Record #81's MUDD block after layer 9, on (T, C) states: per token t, the coefficients
    c[t, ch, j] = (sum_k gelu(x[t] . W1[0, k]) W2[0, k, ch, j] + b[0, ch, j]) * 0.2 / sqrt(3); the stream becomes
    x + c[., 1, 2] x + c[., 1, 0] start + c[., 1, 1] back; the next layer's value correction is
    1.15 (c[., 0, 0] start + c[., 0, 1] back + c[., 0, 2] x), head by head; head h's value gate is
    c[., h // (H/2), 3] + 2; columns 4 / 5 are the next layer's residual / output weights (channel 0 attention,
    1 MLP), columns 6 / 7 of channel 0 its x0 / bigram weights."""
    T, C = x.shape
    hid = spec_gelu(x @ P["mudd_w1"][0].T)
    c = (torch.einsum("tk,kcj->tcj", hid, P["mudd_w2"][0]) + P["mudd_bias"][0]) * MUDD_SCALE
    col = lambda ch, j: c[:, ch, j][:, None]  # noqa: E731
    v = 1.15 * (col(0, 0) * start + col(0, 1) * back + col(0, 2) * x)
    gate = torch.stack([c[:, hh // (H // 2), 3] + 2 for hh in range(H)], dim=1)
    out = dict(v=v.view(T, H, C // H), ve_gate=gate, resid_attn=col(0, 4), post_attn=col(0, 5),
               resid_mlp=col(1, 4), post_mlp=col(1, 5), x0=col(0, 6), bigram=col(0, 7))
    return x + col(1, 2) * x + col(1, 0) * start + col(1, 1) * back, out


def spec_mudd_final(P, x, sources):
    """Record #81's MUDD after the last layer: x + sum_j c[., j] sources[j] with c from row 1, channel 1,
    columns 0-4 (W1[1], W2[1, :, 1, :5], b[1, 1, :5])."""
    hid = spec_gelu(x @ P["mudd_w1"][1].T)
    c = (hid @ P["mudd_w2"][1, :, 1, :5] + P["mudd_bias"][1, 1, :5]) * MUDD_SCALE
    for j, s in enumerate(sources):
        x = x + c[:, j:j + 1] * s
    return x


def spec_forward(hp, P, ids, windows):
    """Record #74's forward on our model (README.md: its deviations), per layer, in P's dtype: one lane until
    parallel_start (attention output added unweighted, x0 and the bigram injected after each attention), then
    two lanes with per-lane output weights; the U-net skip gated by sigmoid(skip_lambda) * 2 * sigmoid(x0 . w).
    hp.one_stream, record #77's forward: never a second lane; x <- resid * x + post[i, 0, 0] * attention(norm(a))
    + injections with a = x, or the output of layer backout_layer once it exists; the skip is x after
    skip_from's MLP. hp.mudd, record #81 on that: spec_mudd_layer after layer L-2, its gates and weights in
    layer L-1, and spec_mudd_final in place of the backout."""
    T, C, H, D, L, V = ids.numel(), hp.model_dim, hp.num_heads, hp.head_dim, hp.num_layers, hp.vocab_size
    dt, G = P["embed"].dtype, hp.gate_dims
    n_attn = len(hp.attn_layers)
    sc = P["scalars"]
    lams = sc[:2 * n_attn].view(n_attn, 2)
    smear_l, backout_l, skip_l = sc[2 * n_attn], sc[2 * n_attn + 1], sc[2 * n_attn + 2]
    resid, post, x0l, bl = P["resid_lambdas"], P["post_lambdas"], P["x0_lambdas"], P["bigram_lambdas"]
    # long windows of the smoke table: 1 -> 2 blocks; windows (., 2) come after one YaRN update
    path = [128] if windows[1] == 1 else [128, 256]
    freq, scale = spec_yarn(spec_freq(D), hp.attn_scale, path) if hp.yarn else (spec_freq(D), hp.attn_scale)
    freq = freq.float().to(dt)  # train_gpt keeps the frequencies in fp32
    e = P["embed"][ids.long()]
    if hp.smear:
        e2 = e.clone()
        for t in range(1, T):
            if ids[t] == hp.bos_id:  # no smear into a document's first token
                continue
            e2[t] = e[t] + smear_l * torch.sigmoid(e[t, :G] @ P["smear_gate"][0]) * e[t - 1]
        e = e2
    x0 = norm(e)
    big = P["bigram_embed"][torch.tensor(spec_hash(ids.tolist(), hp.bigram_vocab_size, hp.bos_id))] if hp.bigram else None
    lane0 = x0 if big is None else x0 + bl[0] * big
    start, mudd = lane0, None  # --mudd: the stream before layer 0; what layer L-2 hands layer L-1
    lane1, skip, back = None, None, None
    ve_tabs = P["value_embeds"].view(hp.num_ve, V, C)
    vg = 0
    for i in range(L):
        if i == hp.parallel_start and not hp.one_stream:
            lane1 = lane0
        if i == hp.skip_to:
            gate = torch.sigmoid(skip_l) * 2 * torch.sigmoid(x0[:, :G] @ P["skip_gate"][0])[:, None]
            lane0 = lane0 + gate * skip
            lane1 = None if lane1 is None else lane1 + gate * skip
        if i in hp.attn_layers:
            a = hp.attn_layers.index(i)
            paired = hp.paired_heads and i in hp.paired_head_layers
            long = i in hp.long_window_layers
            t = hp.ve_tables[i]
            reads = back if hp.one_stream and i > hp.backout_layer else lane0
            inp = dict(ids=ids, x=reads, W=list(P["attn_bank"][4 * a:4 * a + 4]),
                       lam=lams[a] if hp.attn_lambdas else torch.ones(2, dtype=dt), ag=P["attn_gate"][a],
                       ve=ve_tabs[t][ids.long()] if t >= 0 else torch.zeros(T, C, dtype=dt),
                       vg=P["ve_gate"][vg] if t >= 0 else torch.zeros(H, G, dtype=dt))
            vg += t >= 0
            out = _spec_sublayer(hp, inp, 128 * windows[1 if long else 0], scale, freq, paired,
                                 hp.key_offset and long and not paired,
                                 xsa=P["xsa_alpha"][i] if hp.xsa and not paired else None,
                                 v_add=mudd["v"] if mudd else None, ve_gate=mudd["ve_gate"] if mudd else None)
            inject = x0l[i] * x0 + (bl[i] * big if big is not None and i > 0 else 0)
            if mudd:
                inject = mudd["x0"] * start + (mudd["bigram"] * big if big is not None else 0)
                lane0 = mudd["resid_attn"] * lane0 + mudd["post_attn"] * out + inject
            elif hp.one_stream:
                lane0 = resid[i, 0] * lane0 + post[i, 0, 0] * out + inject
            elif lane1 is None:
                lane0 = resid[i, 0] * lane0 + out + inject
            else:
                lane0, lane1 = (resid[i, 0] * lane0 + post[i, 0, 0] * out + inject,
                                resid[i, 0] * lane1 + post[i, 0, 1] * out)
        if i == hp.skip_from and not hp.one_stream:
            skip = lane0
        out = torch.relu(norm(lane0 if lane1 is None else lane1) @ P["mlp_bank"][2 * i].T) ** 2 @ P["mlp_bank"][2 * i + 1]
        if mudd:
            lane0 = mudd["resid_mlp"] * lane0 + mudd["post_mlp"] * out
        else:
            lane0, lane1 = (resid[i, 1] * lane0 + post[i, 1, 0] * out,
                            None if lane1 is None else resid[i, 1] * lane1 + post[i, 1, 1] * out)
        if i == hp.skip_from and hp.one_stream:
            skip = lane0
        if i == hp.backout_layer:
            back = lane0
        if hp.mudd and i == L - 2:
            before_last = lane0
            lane0, mudd = spec_mudd_layer(P, lane0, start, back, H)
    x = lane0 if lane1 is None else (lane0 + lane1) / 2
    if hp.mudd:
        x = spec_mudd_final(P, x, [start, back, before_last, ve_tabs[0][ids.long()], skip])
    elif hp.backout:
        x = x - backout_l * back
    return hp.softcap * torch.sigmoid((norm(x) @ P["lm_head"] + 5) / 7.5)


def perturbed(hp, seed):
    """init_params with every zero-initialised tensor and every feature scalar moved, fp32."""
    p = tg.init_params(hp, torch.device("cpu"), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for k in ("attn_gate", "ve_gate", "smear_gate", "skip_gate", "bigram_embed"):
            p[k].copy_(torch.randn(p[k].shape, generator=g) * 0.3)
        p["mlp_bank"][1::2] = torch.randn(p["mlp_bank"][1::2].shape, generator=g) * hp.mlp_dim ** -0.5
        p["bigram_lambdas"].add_(torch.rand(hp.num_layers, generator=g) * 0.3)
        # --xsa's alphas, distinct per layer and head, in every row (the rows XSA skips must stay unread); from a
        # generator of their own, so the other tensors keep their values
        p["xsa_alpha"].copy_(torch.randn(p["xsa_alpha"].shape, generator=torch.Generator().manual_seed(seed + 2)))
        # --mudd's W2 (zero at init) and bias, likewise. W2 of 0.3 x N(0, 1) makes the whole forward ill-conditioned
        # (fp32's own error in the logits 1e-2); 0.05 keeps it at 3e-4, and test_mudd_blocks_match_the_spec checks
        # the blocks alone at full size
        g3 = torch.Generator().manual_seed(seed + 3)
        p["mudd_w2"].copy_(torch.randn(p["mudd_w2"].shape, generator=g3) * 0.05)
        p["mudd_bias"].add_(torch.randn(p["mudd_bias"].shape, generator=g3))
        p["x0_lambdas"].copy_(torch.rand(hp.num_layers, generator=g) * 0.5)
        for k in ("resid_lambdas", "post_lambdas"):
            p[k].add_(torch.randn(p[k].shape, generator=g) * 0.2)
        p["scalars"].add_(torch.randn(p["scalars"].shape, generator=g) * 0.3)  # lambdas, smear, backout, skip
    return {k: v.detach().requires_grad_() for k, v in p.items()}


def _ids(hp, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hp.bos_id, (T,), generator=g, dtype=torch.int32)
    ids[[0, 40, 41, T // 2 + 7, T - 20]] = hp.bos_id
    return ids


def _cpu_logits(hp, params, ids, windows):
    """fns.layers and the head in eager mode on the CPU (dense attention), without gradients."""
    fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False, attention="dense")
    with torch.no_grad():
        return tg.head_logits(fns.layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), windows, {})),
                              params["lm_head"], hp.softcap)


def _assert_matches_spec(logits, hp, params, ids, windows, name):
    """Rule 1 against spec_forward in float64, with spec_forward in fp32 as the fp32 error's scale."""
    P64 = {k: v.detach().double() for k, v in params.items()}
    P32 = {k: v.detach().float() for k, v in params.items()}
    assert_matches_torch(logits, spec_forward(hp, P64, ids, windows), spec_forward(hp, P32, ids, windows), name=name)


def test_full_forward_with_every_feature_matches_reference():
    """fp32 layers + head (dense attention) vs spec_forward in float64 (rule 1 with spec_forward in fp32),
    every feature on; and each feature changes the logits (the comparison would see it missing)."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511)
    params = perturbed(hp, seed=5)
    ids, windows = _ids(hp, 384, seed=6), (1, 2)
    ours = _cpu_logits(hp, params, ids, windows)
    _assert_matches_spec(ours, hp, params, ids, windows, name="logits, all features")
    for f in ("bigram", "paired_heads", "smear", "yarn", "key_offset", "backout", "attn_lambdas"):
        off = dataclasses.replace(hp, **{f: False})
        other = _cpu_logits(off, params, ids, windows)
        # (tolerances above are ~1e-6: a change of 1e-4 would be seen)
        assert (other - ours).abs().max() > 1e-4, f"--no-{f} does not change the logits"
        _assert_matches_spec(other, off, params, ids, windows, name=f"logits without {f}")


def test_one_stream_forward_matches_reference():
    """--one-stream (record #77) vs spec_forward in float64 (rule 1), every feature on; and it changes the logits.
    backout_layer 1 of the four layers: the first attention after it reads what the stream holds anyway, the
    second (layer 3) reads layer 1's output where the stream has moved on; the skip leaves layer 1 and joins
    before layer 2."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511, one_stream=True, backout_layer=1)
    assert (hp.skip_from, hp.skip_to) == (1, 2) and {2, 3} <= set(hp.attn_layers)
    _check_opt_in_against_spec(hp, "one_stream")


def _check_opt_in_against_spec(hp, flag):
    """The forward of hp (its opt-in ``flag`` on), perturbed parameters, vs spec_forward in float64 (rule 1); and
    the flag changes the logits (off: the forward without it)."""
    params = perturbed(hp, seed=5)
    ids, windows = _ids(hp, 384, seed=6), (1, 2)
    ours = _cpu_logits(hp, params, ids, windows)
    _assert_matches_spec(ours, hp, params, ids, windows, name=f"logits, {flag}")
    off = _cpu_logits(dataclasses.replace(hp, **{flag: False}), params, ids, windows)
    assert (ours - off).abs().max() > 1e-4, f"{flag} does not change the logits"


def _mudd_hp(**overrides):
    """The smoke model with --one-stream --mudd, four heads (two per value-gate channel) and its backout layer
    moved before layer L-2 = 2 (check_mudd): to layer 0, so that back and the skip (after layer 1) differ."""
    return tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511, one_stream=True, mudd=True,
                                    backout_layer=0, num_heads=4, head_dim=16, **overrides)


def test_mudd_forward_matches_reference():
    """--mudd (record #81 on one stream) vs spec_forward in float64 (rule 1), every feature on, W2 and the biases
    moved off their init; and it changes the logits against --one-stream alone."""
    _check_opt_in_against_spec(_mudd_hp(), "mudd")


@pytest.mark.parametrize("heads", [2, 6])
def test_mudd_blocks_match_the_spec(heads):
    """tg.mudd_layer and tg.mudd_final in fp32 vs spec_mudd_layer / spec_mudd_final in float64 (rule 1 with the
    spec in fp32): every output, at the full width (768) and odd T, W2 and the biases random; 6 heads: three per
    value-gate channel."""
    T, C = 37, 768
    g = torch.Generator().manual_seed(heads)
    P = {"mudd_w1": (torch.rand(2, 64, C, generator=g) * 2 - 1) * C ** -0.5,
         "mudd_w2": torch.randn(2, 64, 2, 8, generator=g) * 0.3, "mudd_bias": torch.randn(2, 2, 8, generator=g) * 3}
    x, start, back = (torch.randn(T, C, generator=g) * 2 for _ in range(3))
    sources = [torch.randn(T, C, generator=g) for _ in range(5)]
    w = lambda row: [P[k][row] for k in ("mudd_w1", "mudd_w2", "mudd_bias")]  # noqa: E731
    new, gates = tg.mudd_layer(x, start, back, *w(0), heads)
    final = tg.mudd_final(x, sources, *w(1))
    specs = {}
    for dt in (torch.float64, torch.float32):
        Pd = {k: v.to(dt) for k, v in P.items()}
        s_new, s_gates = spec_mudd_layer(Pd, x.to(dt), start.to(dt), back.to(dt), heads)
        specs[dt] = dict(s_gates, new=s_new, final=spec_mudd_final(Pd, x.to(dt), [s.to(dt) for s in sources]))
    ours = dict(gates._asdict(), v=gates.v_add, new=new, final=final)
    for k in specs[torch.float64]:
        assert_matches_torch(ours[k], specs[torch.float64][k], specs[torch.float32][k], name=f"mudd {k}")


def test_mudd_starts_as_the_static_scalars_it_replaces():
    """At init (W2 zero) every MUDD coefficient is its bias x 0.2/sqrt(3): layer L-1's residual weights sqrt(1.1),
    output weights 1, x0 weight 0, bigram weight 0.05 (record #74's inits of the scalars they replace), value gate
    2, no value correction, the stream after layer L-2 unchanged, and the final mix -0.5 x back (the backout's
    0.5, to bf16-like precision: the record's bias -4.34) and 0 x the other four sources."""
    hp = _mudd_hp()
    p = tg.init_params(hp, torch.device("cpu"), 0)
    T, C, H = 64, hp.model_dim, hp.num_heads
    g = torch.Generator().manual_seed(1)
    x, start, back = (torch.randn(T, C, generator=g) for _ in range(3))
    w = [p[k].detach()[0] for k in ("mudd_w1", "mudd_w2", "mudd_bias")]
    new, gates = tg.mudd_layer(x, start, back, *w, H)
    assert torch.equal(new, x) and not gates.v_add.any() and gates.v_add.shape == (T, H, C // H)
    assert torch.equal(gates.ve_gate, torch.full((T, H), 2.0))
    for name, want in (("resid_attn", 1.1 ** 0.5), ("resid_mlp", 1.1 ** 0.5), ("post_attn", 1.0),
                       ("post_mlp", 1.0), ("x0", 0.0), ("bigram", 0.05)):
        got = getattr(gates, name)
        assert got.shape == (T, 1) and torch.allclose(got, torch.full((T, 1), want), rtol=1e-6, atol=0), name
    sources = [torch.randn(T, C, generator=g) for _ in range(5)]
    w1 = [p[k].detach()[1] for k in ("mudd_w1", "mudd_w2", "mudd_bias")]
    delta = tg.mudd_final(x, sources, *w1) - x
    torch.testing.assert_close(delta, -4.34 * MUDD_SCALE * sources[1], rtol=1e-5, atol=1e-6)
    assert abs(-4.34 * MUDD_SCALE + 0.5) < 2e-3


def test_mudd_gradients_reach_its_rows_and_not_the_scalars_it_replaces(device):
    """--mudd on the test device: W1, W2 and both bias rows get gradients (W1 only once W2 is nonzero); layer
    L-1's static residual, output, x0 and bigram weights, its value-embedding gate and backout_lambda, all
    replaced, get none."""
    hp = _mudd_hp()
    grad = _training_grads(hp, device)
    L = hp.num_layers
    for k in ("mudd_w1", "mudd_w2"):
        assert grad[k][0].abs().max() > 0 and grad[k][1].abs().max() > 0, k
    # the bias: layer L-2's row in every column but channel 1's last two (x0 and bigram weights come from channel
    # 0 alone); the final row only in the five columns of channel 1 it reads
    b = grad["mudd_bias"]
    assert (b[0, 0] != 0).all() and (b[0, 1, :6] != 0).all() and not b[0, 1, 6:].any()
    assert (b[1, 1, :5] != 0).all() and not b[1, 0].any() and not b[1, 1, 5:].any()
    for k in ("resid_lambdas", "post_lambdas", "x0_lambdas", "bigram_lambdas"):
        assert not grad[k][L - 1].any() and grad[k][:L - 1].abs().max() > 0, k
    n_attn = len(hp.attn_layers)
    assert grad["scalars"][2 * n_attn + 1] == 0  # backout_lambda
    assert not grad["ve_gate"][-1].any() and grad["ve_gate"][0].abs().max() > 0  # layers 0 and 3 have one


def test_full_forward_gradients_reach_every_feature_parameter(device):
    """On the test device (the embedding backward: our Triton kernel on CUDA, torch's on the CPU)."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511)
    params = {k: v.detach().to(device).requires_grad_() for k, v in perturbed(hp, seed=7).items()}
    ids = _ids(hp, 256, seed=8)
    targets = torch.randint(0, 511, (256,), generator=torch.Generator().manual_seed(9))
    fns = tg.build_fns(hp, torch.device(device), compile_model=False, attention="dense")
    prep = tg.prepare_ids(ids, hp.vocab_size)
    big = tg.bigram_hash(ids, hp.bigram_vocab_size, hp.bos_id)
    mb = tg.MicroBatch(ids.to(device), targets.to(device), prep.to(device), bigram=big.to(device),
                       bigram_prep=tg.prepare_ids(big, hp.bigram_vocab_size).to(device))
    loss = tg.forward(hp, params, fns, mb, (1, 2), {}, train=True, mtp=torch.tensor([1.0, 0.5, 0.25], device=device))
    loss.backward()
    for k in ("bigram_embed", "bigram_lambdas", "smear_gate", "skip_gate"):
        assert params[k].grad is not None and params[k].grad.abs().max() > 0, k
    assert (params["scalars"].grad != 0).all()  # attention lambdas, smear, backout, skip
    assert (params["resid_lambdas"].grad != 0).all() and (params["x0_lambdas"].grad[hp.attn_layers] != 0).all()
    # output weights: the MLP's into lane 0 everywhere; from parallel_start on, every weight into both lanes
    post = params["post_lambdas"].grad
    assert (post[:, 1, 0] != 0).all() and (post[hp.parallel_start:] != 0).all()
    # the bigram gradient lands on the hashed rows only (through our deterministic embedding kernel)
    rows = set(big.tolist())
    touched = set(torch.nonzero(params["bigram_embed"].grad.abs().sum(1)).flatten().tolist())
    assert touched == rows


def _training_grads(hp, device):
    """The gradients of one training micro-batch's loss (256 tokens, multi-token weights) on the test device,
    eager, dense attention, from perturbed(hp, seed=7): {name: grad}."""
    params = {k: v.detach().to(device).requires_grad_() for k, v in perturbed(hp, seed=7).items()}
    ids = _ids(hp, 256, seed=8)
    targets = torch.randint(0, 511, (256,), generator=torch.Generator().manual_seed(9))
    fns = tg.build_fns(hp, torch.device(device), compile_model=False, attention="dense")
    mb = tg.MicroBatch(ids.to(device), targets.to(device))
    mtp = torch.tensor([1.0, 0.5, 0.25], device=device)
    tg.forward(hp, params, fns, mb, (1, 2), {}, train=True, mtp=mtp).backward()
    return {k: v.grad for k, v in params.items()}


def test_one_stream_gradients_reach_lane_zero_weights_only(device):
    """--one-stream: every attention's and MLP's output weight into lane 0 gets a gradient; the lane-1 weights,
    unread, get zero."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511, one_stream=True)
    post = _training_grads(hp, device)["post_lambdas"]
    assert (post[hp.attn_layers, 0, 0] != 0).all() and (post[:, 1, 0] != 0).all()
    assert not post[:, :, 1].any()


def _trace_layers(hp, backend, backward=False, T=256):
    """Run fns.layers (CPU, dense attention, init_params) once under torch.compile with ``backend`` (a graph
    recorder), then the backward of its sum with ``backward``."""
    params = tg.init_params(hp, torch.device("cpu"), 0)
    fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False, attention="dense")
    ids = torch.arange(T, dtype=torch.int32) % hp.bos_id
    ids[[0, 100]] = hp.bos_id
    torch._dynamo.reset()
    try:
        layers = torch.compile(fns.layers, backend=backend, fullgraph=True, dynamic=False)
        x = layers(*tg.model_inputs(hp, params, fns, tg.MicroBatch(ids), (1, 2), {}))
        if backward:
            x.float().sum().backward()
    finally:
        torch._dynamo.reset()


def _float_casts_traced(hp, T=256):
    """The floating-point dtype casts (a .to() whose output dtype is another float dtype) of tables (not of
    activations: T rows) in the graph dynamo traces from fns.layers, without compiling it."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _trace_layers(hp, record, T=T)
    casts = 0
    for node in graphs[0].graph.nodes:
        if node.op in ("call_method", "call_function") and node.target in ("to", torch.Tensor.to):
            src, out = node.args[0].meta["example_value"], node.meta["example_value"]
            casts += src.dtype.is_floating_point and out.dtype != src.dtype and (src.dim() == 0 or src.shape[0] != T)
    return casts


@pytest.mark.parametrize("xsa", [False, True])
def test_layers_cast_each_scalar_and_gate_table_once(xsa):
    """bf16 layers: the fp32 scalar and gate tables are cast to the lanes' dtype once per micro-step, whatever the
    depth, rather than once per use (each per-use cast of a scalar is a tiny kernel of its own in the compiled
    forward and one more in its backward): the traced graph of 4 and of 6 layers holds the same number of casts.
    With --xsa (alpha's tanh table: one cast more), traced as one full graph as the compiled step is."""
    counts = []
    for layers in (4, 6):
        hp = tg.smoke_hyperparameters(param_dtype="bfloat16", vocab_size=512, bos_id=511, num_layers=layers,
                                      ve_tables=(0,) + (-1,) * (layers - 2) + (0,), xsa=xsa)
        counts.append(_float_casts_traced(hp))
    assert counts[0] == counts[1], f"float casts in the traced layers: {counts[0]} at 4 layers, {counts[1]} at 6"
    if xsa:
        assert counts[0] == _float_casts_traced(dataclasses.replace(hp, num_layers=4, xsa=False,
                                                                    ve_tables=(0, -1, -1, 0))) + 1


def _backward_graph_traced(hp):
    """The backward graph (fx.GraphModule) AOT autograd makes of fns.layers, without compiling it."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    _trace_layers(hp, aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward), bw_compiler=record),
                  backward=True)
    return graphs[0]


def _backward_ops_traced(hp, leave_out=()):
    """Counts of the aten ops in the backward graph AOT autograd makes of fns.layers, without compiling it;
    leave_out: the shapes whose select_backward / slice_backward ops are not counted (a bank's per-layer views)."""
    def counted(n):
        return not (str(n.target) in ("aten.select_backward.default", "aten.slice_backward.default")
                    and tuple(n.args[1]) in leave_out)
    return collections.Counter(str(n.target) for n in _backward_graph_traced(hp).graph.nodes
                               if n.op == "call_function" and counted(n))


@pytest.mark.parametrize("layout", ["record74", "default"])
def test_scalar_gradients_are_assembled_without_per_row_kernels(layout):
    """The backward writes the scalar tables' gradients without a step per layer: no select_backward per row
    (each is a put-back kernel of its own when compiled: a row indexed after an unbind) and no zero fill per
    unread entry (a stacked gradient's unread slot). The backward graphs of 4 and of 6 layers hold the same
    number of select_backward ops (the count grows with the depth when each layer's rows are put back), and no
    zeros op (an unread slot's fill). The attention bank's per-layer views are not scalar rows: their
    select_backward ops (W_o's) are left out here (test_attention_bank_gradient_is_assembled_without_copies)."""
    counts = []
    for layers in (4, 6):
        extra = {} if layout == "record74" else dict(one_stream=True, mudd=True, xsa=True, backout_layer=0,
                                                      num_heads=4, head_dim=16)
        hp = tg.smoke_hyperparameters(param_dtype="bfloat16", vocab_size=512, bos_id=511, num_layers=layers,
                                      ve_tables=(0,) + (-1,) * (layers - 2) + (0,), **extra)
        C = hp.model_dim
        ops = _backward_ops_traced(hp, leave_out=[(4 * len(hp.attn_layers), C, C)])
        counts.append({k: ops[k] for k in ("aten.select_backward.default", "aten.zeros.default")})
    assert counts[0] == counts[1], f"backward ops at 4 layers {counts[0]}, at 6 {counts[1]}"
    assert counts[0]["aten.zeros.default"] == 0, f"zero fills in the backward: {counts}"


@pytest.mark.parametrize("lambdas", [True, False])
def test_attention_bank_gradient_is_assembled_without_copies(lambdas):
    """Each attention layer reads [W_q; W_k; W_v] and W_o as two views of the bank (make_layers), so the bank's
    gradient in the backward is put together from whole matmul outputs: one slice_backward (the (3C, C) block)
    and one select_backward (W_o) per attention layer, at the bank's shape, and no cat or stack of the bank's
    size (a stack of the four matrices' gradients, where W_qkv's three are slices of one matmul output, copies
    them: three copy kernels per layer on the GPU). Layouts of 4 and 6 layers, with and without the attention
    lambdas (the lambdas' product read through the views, or the parameter itself)."""
    for layers in (4, 6):
        hp = tg.smoke_hyperparameters(param_dtype="bfloat16", vocab_size=512, bos_id=511, num_layers=layers,
                                      ve_tables=(0,) + (-1,) * (layers - 2) + (0,), attn_lambdas=lambdas)
        A, C = len(hp.attn_layers), hp.model_dim
        bank = [4 * A, C, C]
        nodes = [n for n in _backward_graph_traced(hp).graph.nodes if n.op == "call_function"]
        views = collections.Counter(str(n.target) for n in nodes
                                    if str(n.target) in ("aten.select_backward.default", "aten.slice_backward.default")
                                    and list(n.args[1]) == bank)
        assert views == {"aten.select_backward.default": A, "aten.slice_backward.default": A}, (layers, views)
        joins = [n for n in nodes if str(n.target) in ("aten.cat.default", "aten.stack.default")
                 and list(n.meta["val"].shape) in (bank, [A, 4 * C, C], [4 * A * C, C])]
        assert joins == [], (layers, [(str(n.target), list(n.meta["val"].shape)) for n in joins])


def test_weight_and_lambda_gradients_are_summed_in_one_reduction_each():
    """The residual, output, x0 and bigram weights' gradients: per-token partial sums (the kernels that reduce over
    each token's row), then one reduction over the tokens for all of them, rather than a full reduction (to 0-d)
    per weight. The attention lambdas' gradients: one reduction over the whole attention bank's gradient, rather
    than one per weight matrix. So the backward graphs of 4 and of 6 layers (the default's layout) hold the same
    number of full reductions (a lambda multiplying its matrix alone adds one per matrix)."""
    counts = []
    for layers in (4, 6):
        hp = tg.smoke_hyperparameters(param_dtype="bfloat16", vocab_size=512, bos_id=511, num_layers=layers,
                                      ve_tables=(0,) + (-1,) * (layers - 2) + (0,), one_stream=True, mudd=True,
                                      xsa=True, backout_layer=0, num_heads=4, head_dim=16)
        assert hp.attn_lambdas
        counts.append(_backward_ops_traced(hp)["aten.sum.default"])
    assert counts[0] == counts[1], f"full reductions in the backward: {counts[0]} at 4 layers, {counts[1]} at 6"


def spec_scalar_reads(hp):
    """Which entries of each scalar and gate table the model reads, as boolean masks in the tables' shapes (the
    per-head tables by row), from the model's description: layer L-1 with MUDD takes per-token weights in place
    of its residual, output, x0 and bigram scalars and its value gate; a layer without attention has no
    attention sublayer; the attention's output weight exists on one stream (lane 0) and where two lanes run
    (both lanes), the MLP's lane-0 weight in every layer; x0 and the bigram are injected after each attention (the
    bigram's layer-0 weight in the prelude); XSA acts on the unpaired attention layers; scalars: the (W_qkv, W_o)
    lambdas, smear, backout (not with MUDD: its final mix replaces it), skip (always)."""
    L = hp.num_layers
    static = [not (hp.mudd and i == L - 1) for i in range(L)]
    has_attn = [i not in hp.no_attn_layers for i in range(L)]
    two = [not hp.one_stream and i >= hp.parallel_start for i in range(L)]
    post = torch.zeros(L, 2, 2, dtype=torch.bool)
    resid = torch.zeros(L, 2, dtype=torch.bool)
    for i in range(L):
        for s in (0, 1):
            if static[i] and (s == 1 or has_attn[i]):
                resid[i, s] = True
                post[i, s, 0] = s == 1 or hp.one_stream or two[i]
                post[i, s, 1] = two[i]
    attn = [static[i] and has_attn[i] for i in range(L)]
    n = 2 * sum(has_attn)
    ve_rows = [static[i] for i in range(L) if has_attn[i] and hp.ve_tables[i] >= 0]
    return {
        "scalars": torch.tensor([hp.attn_lambdas] * n + [hp.smear, hp.backout and not hp.mudd, True]),
        "resid_lambdas": resid, "post_lambdas": post,
        "x0_lambdas": torch.tensor(attn),
        "bigram_lambdas": torch.tensor([hp.bigram and (i == 0 or attn[i]) for i in range(L)]),
        "xsa_alpha": torch.tensor([hp.xsa and has_attn[i] and i not in hp.paired_layers for i in range(L)]),
        "ve_gate": torch.tensor(ve_rows),
    }


SCALAR_LAYOUTS = {  # six layers, layer 3 without attention, MUDD's backout before layer L-2
    "record74": {},
    "one_stream": dict(one_stream=True, xsa=True),
    "mudd": dict(one_stream=True, mudd=True, xsa=True),
    "features_off": dict(bigram=False, smear=False, attn_lambdas=False, backout=False),
}


@pytest.mark.parametrize("layout", list(SCALAR_LAYOUTS))
def test_scalar_reads_are_the_entries_with_gradients(layout):
    """tg.scalar_reads (the entries make_layers takes from each table) is the spec's set of read entries, and a
    training micro-batch's gradient is nonzero on exactly those (perturbed parameters): a declared entry the
    model does not read would cost a zero fill, one it reads and does not declare would fail to trace."""
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511, num_layers=6, no_attn_layers=(3,),
                                  ve_tables=(0, -1, 1, -1, -1, 0), long_window_layers=(1, 5), skip_from=1, skip_to=3,
                                  parallel_start=4, backout_layer=1, num_heads=4, head_dim=16,
                                  **SCALAR_LAYOUTS[layout])
    spec = spec_scalar_reads(hp)
    grads = _training_grads(hp, "cpu")
    for k, mask in spec.items():
        g = torch.zeros(mask.shape) if grads[k] is None else grads[k]  # None: the table is not read at all
        got = (g != 0) if g.dim() == mask.dim() else (g != 0).flatten(1).any(1)
        assert torch.equal(got, mask), f"{layout}: {k}: gradient on {got.int().tolist()}, reads {mask.int().tolist()}"
    declared = tg.scalar_reads(hp)
    L, n = hp.num_layers, 2 * len(hp.attn_layers)
    views = {"scalars": spec["scalars"][:n + 2], "resid": spec["resid_lambdas"].reshape(-1),
             "post": spec["post_lambdas"].permute(2, 0, 1).reshape(-1), "x0": spec["x0_lambdas"],
             "bigram": spec["bigram_lambdas"], "xsa": spec["xsa_alpha"], "ve_gate": spec["ve_gate"]}
    assert set(declared) == set(views)
    for k, mask in views.items():
        assert sorted(declared[k]) == torch.nonzero(mask).flatten().tolist(), f"{layout}: scalar_reads[{k!r}]"


def test_take_returns_the_rows_of_runs_as_views():
    t = torch.arange(24.0).view(8, 3)
    got = tg.take(t, [6, 0, 2, 3, 7, 3])
    assert sorted(got) == [0, 2, 3, 6, 7]
    for i, row in got.items():
        assert torch.equal(row, t[i]) and row.data_ptr() == t[i].data_ptr()
    assert tg.take(t, []) == {}


# ----------------------------------------------------------------------------------------------------
# FP8 head


def test_fp8_head_falls_back_to_the_same_math_on_cpu():
    hp = tg.smoke_hyperparameters(param_dtype="float32", vocab_size=512, bos_id=511)
    on, off = (tg.build_fns(dataclasses.replace(hp, fp8_head=f), torch.device("cpu"), compile_model=False)
               for f in (True, False))
    assert on.head_path == "float32 (no FP8 matmul on cpu)" and off.head_path == "float32 (--no-fp8-head)"
    g = torch.Generator().manual_seed(2)
    x = torch.randn(128, hp.model_dim, generator=g)
    w = (torch.randn(hp.model_dim, 512, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, 512, (128,), generator=g)
    wk = torch.tensor([1.0, 0.5])
    la = on.loss(x, w, t, wk)
    ga, = torch.autograd.grad(la, w)
    lb = off.loss(x, w, t, wk)
    gb, = torch.autograd.grad(lb, w)
    assert torch.equal(la, lb) and torch.equal(ga, gb)

    def spec(x, w):  # the head in the parameters' dtype: mean_t [CE(z_t, t_t) + 0.5 CE(z_t, t_{t+1})]
        z = hp.softcap * torch.sigmoid((norm(x) @ w + 5) / 7.5)
        ce = F.cross_entropy(z, t, reduction="none")
        return (ce.sum() + 0.5 * F.cross_entropy(z[:-1], t[1:], reduction="sum")) / len(t)

    # fp32 mean of N = 128 row losses summed in another order than the spec: bound N * u relative (the
    # worst case of recursive summation); a bf16 matmul would be off by ~2^-8 relative.
    e = spec(x.double(), w.detach().double())
    assert_close_report(la, e, atol=128 * 2 ** -24 * e.abs().item(), name="fallback loss")


SOFTCAP3 = (23.0, 5.0, 7.5)  # (A, B, C): logits -> A sigmoid((logits + B) / C), as train_gpt.py
E4M3_U, E4M3_SUB = 2.0 ** -4, 2.0 ** -10  # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormal step 2^-9


def _fp8_case(dev, N, C, V, seed, w_std):
    g = torch.Generator().manual_seed(seed)
    x = norm(torch.randn(N, C, generator=g)).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(C, V, generator=g) * w_std).to(dev, torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(dev)
    t[1] = t[0]  # a repeated target
    wk = torch.tensor([1.0, 0.5, 0.25], device=dev)
    return x, w, t, wk, tg.FP8_GRAD_S / (N * tg.SLOTS)


def _spec_ce64(logits, t, wk, A, B, C):
    """Float64 per-row losses sum_k w_k (lse_t - z[t, t_{t+k}]) of soft-capped logits (t + k < N)."""
    z = A * torch.sigmoid((logits.double() + B) / C)
    lse = torch.logsumexp(z, 1)
    N = z.shape[0]
    out = torch.zeros(N, dtype=torch.float64, device=z.device)
    for k, w in enumerate(wk.tolist()):
        out[:N - k] += w * (lse[:N - k] - z[torch.arange(N - k, device=z.device), t[k:]])
    return out


def _check_fp8_head_ce(dev, N, C, V, seed, w_std, rows=None):
    """fp8_head_ce forward and backward, piece by piece against float64 specifications written here:
    e4m3 operands (torch's cast of x / x_s, w / w_s, bitwise), logits (the float64 product of the dequantised
    operands, up to the bf16 rounding of the output and the fp32 / fast accumulation), losses (float64 CE of
    the op's own logits, within the CE kernel's derived error), the e5m2 gradient (rule 3 against the float64
    CE gradient of those logits), and dx, dw: autograd through the op runs the backward op; its two matmuls equal,
    bit for bit, torch._scaled_mm restated from the specification's operands (the kernel's e5m2 gradient g8 and
    its transpose, the e4m3 copies checked above, the scales grad_s, w_s, x_s), and the float64 products of those
    operands within rule 5 of tests/tolerances.py (one bf16 rounding plus the device's FP8 accumulation error:
    fp32 on the CPU, Hopper's tensor-core accumulation on a GPU).

    Why both: rule 5's GPU term is an estimate of the tensor cores' truncating accumulation (the fp32 bound
    failed on one H200 by less than half a bf16 ulp on 16 of 1536 elements of dx: the accumulation, not dx,
    was off); the restated call pins the composition (operands, layouts, scales) exactly on every device, so a
    scale off by any factor, a transposed or swapped operand, or another gradient than g8 fails there."""
    from tests.test_cross_entropy import spec_grad_terms, spec_grad
    from tests.tolerances import assert_fp8_gemm, assert_rounded_e5m2
    A, B, Cs = SOFTCAP3
    u = 2.0 ** -24
    x, w, t, wk, gs = _fp8_case(dev, N, C, V, seed, w_std)
    x8, (w8, w8t) = tg.fp8_e4m3(x.detach(), tg.FP8_X_S), tg.fp8_head_weights(w, tg.FP8_W_S)
    losses, logits, stats = tg.fp8_head_ce(x, w, x8, w8, w8t, t, wk, tg.FP8_X_S, tg.FP8_W_S, gs, A, B, Cs)
    x8_spec = (x.detach() / tg.FP8_X_S).to(torch.float8_e4m3fn)
    w8_spec = (w.detach() / tg.FP8_W_S).to(torch.float8_e4m3fn)
    assert torch.equal(x8.view(torch.uint8), x8_spec.view(torch.uint8))
    assert torch.equal(w8.view(torch.uint8), w8_spec.view(torch.uint8))
    xq, wq = x8.double() * tg.FP8_X_S, w8.double() * tg.FP8_W_S
    r = slice(None) if rows is None else rows
    e_logits = xq[r] @ wq
    terms = xq[r].abs() @ wq.abs()
    # bf16 output: half an ulp (2^-8 relative); fp32 (CPU) or Hopper's fast FP8 accumulation: 2^-10 of the terms
    assert_close_report(logits[r].double(), e_logits, atol=2.0 ** -10 * terms.max().item(), rtol=2.0 ** -8,
                        name="fp8 logits")
    # losses: the CE kernel's derived error (tests/test_cross_entropy: 6 u A for the row max, 581 u of the
    # sum of exponentials, a few u A per picked logit) times the row's summed weight 1.75
    e_loss = _spec_ce64(logits, t, wk, A, B, Cs)
    bound = 1.75 * (600 + 12 * A) * u
    assert_close_report(losses[r].double(), e_loss[r], atol=bound, name="fp8 head losses")
    loss = losses.mean()
    dx, dw = torch.autograd.grad(loss, (x, w))
    grad = torch.full((N,), 1.0 / N, device=dev)
    dx2, dw2 = fp8_head_ce_bwd(grad, logits, stats, t, wk, x8, w8, tg.FP8_X_S, tg.FP8_W_S, gs, A, B, Cs)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2), "autograd does not run fp8_head_ce_bwd"
    g8, _ = softcapped_cross_entropy_bwd_e5m2(grad, logits, stats, t, wk, A, B, Cs, gs)
    # the spec over the checked rows plus the K - 1 after them (a row's later terms read their targets)
    ext = slice(None) if rows is None else slice(0, rows.stop + len(wk) - 1)
    n = N if rows is None else rows.stop
    lg = logits[ext].detach()
    assert_rounded_e5m2(g8[r], spec_grad(lg, t[ext], wk, grad[ext], A, B, Cs)[:n] / gs,
                        spec_grad_terms(lg, t[ext], wk, grad[ext], gs, A, B, Cs)[:n], name="fp8 head e5m2 gradient")
    # dx = g8 @ w8^T grad_s w_s and dw = x8^T @ g8 x_s grad_s, restated (torch._scaled_mm wants its second operand
    # column-major, hence the transposed copies' .T): the same call on the same operands gives the same bits
    scale = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)
    spec_dx = torch._scaled_mm(g8, w8_spec.T, scale_a=scale(gs), scale_b=scale(tg.FP8_W_S), out_dtype=torch.bfloat16)
    spec_dw = torch._scaled_mm(x8_spec.T.contiguous(), g8.T.contiguous().T, scale_a=scale(tg.FP8_X_S),
                               scale_b=scale(gs), out_dtype=torch.bfloat16)
    assert torch.equal(dx, spec_dx), "fp8 head dx is not g8 @ w8^T * grad_s * w_s"
    assert torch.equal(dw, spec_dw), "fp8 head dw is not x8^T @ g8 * x_s * grad_s"
    gq = g8.double() * gs
    accumulation = "tensor_core" if dev.type == "cuda" else "fp32"
    assert dx.dtype == dw.dtype == torch.bfloat16
    assert_fp8_gemm(dx[r], gq[r] @ wq.T, gq[r].abs() @ wq.abs().T, V, accumulation, name="fp8 head dx")
    assert_fp8_gemm(dw, xq.T @ gq, xq.abs().T @ gq.abs(), N, accumulation, name="fp8 head dw")
    # the quantisation is real: the exact product differs by more than the logits bound above
    exact = x.detach().double()[r] @ w.detach().double()
    assert (exact - e_logits).abs().max() > 2.0 ** -8 * e_logits.abs().max()


def test_fp8_head_ce_matches_quantised_spec_small_shapes(device):
    """Small shapes on the test device (on the CPU the e5m2 kernels run in Triton's interpreter): V = 208 is not
    a multiple of the kernels' tiles, N = 48 not of the transpose's (both multiples of 16, as torch._scaled_mm
    requires on a GPU)."""
    if not _scaled_mm_works(device):
        pytest.skip(f"this torch has no torch._scaled_mm on {device}")
    _check_fp8_head_ce(torch.device(device), 48, 32, 208, seed=4, w_std=0.2)


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmul needs CUDA capability >= 8.9")
def test_fp8_head_ce_matches_quantised_spec_on_gpu():
    """The speedrun's head shape (C = 768, V = 50304) with N = 2048 rows; the float64 checks on 256 rows."""
    _check_fp8_head_ce(torch.device("cuda"), 2048, 768, 50304, seed=0, w_std=0.04, rows=slice(0, 256))


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmul needs CUDA capability >= 8.9")
def test_fp8_head_loss_within_the_e4m3_rounding_bound_on_gpu():
    """The compiled training head, FP8 against the exact loss of the same bf16 inputs. The bound follows from
    e4m3 rounding alone: |x8 * x_s - x| <= 2^-4 |x| + 2^-10 x_s per element (3 mantissa bits; the subnormal
    step is 2^-9), likewise for w, so a logit moves by at most d = (2^-4 |x| + 2^-10 x_s) @ |w| +
    |x| @ (2^-4 |w| + 2^-10 w_s) (+ the products' second-order term, + 2^-8 |logit| for the bf16 output).
    A soft-capped logit A sigmoid((l + B) / C) moves by at most A / (4 C) times that, and a row's loss
    W_t (lse - z) by at most 2 W_t max_v of it; the mean loss by the mean of the rows' bounds. The FP8 loss
    must also differ from the exact one (the quantisation is real), and a bf16 head must be within it."""
    dev = torch.device("cuda")
    hp = tg.Hyperparameters()
    fp8 = tg.build_fns(hp, dev, compile_model=True)
    bf = tg.build_fns(dataclasses.replace(hp, fp8_head=False), dev, compile_model=True)
    assert fp8.head_path.startswith("fp8") and bf.head_path.startswith("bfloat16")
    A, B, Cs = SOFTCAP3
    x, w, t, wk, _ = _fp8_case(dev, 2048, 768, 50304, seed=1, w_std=0.04)
    x = torch.randn_like(x.float()).bfloat16()  # the head norms its input itself
    compiled = [torch.compile(f.loss, fullgraph=True, dynamic=False) for f in (fp8, bf)]
    l8, lb = (loss(x, w, t, wk, f.head_operands(w)).item() for loss, f in zip(compiled, (fp8, bf)))
    xn = tg.rms_norm(x).double()
    wd = w.detach().double()
    exact = (_spec_ce64(xn @ wd, t, wk, A, B, Cs)).mean().item()
    dx_ = E4M3_U * xn.abs() + E4M3_SUB * tg.FP8_X_S
    dw_ = E4M3_U * wd.abs() + E4M3_SUB * tg.FP8_W_S
    d_logit = dx_ @ wd.abs() + xn.abs() @ dw_ + dx_ @ dw_ + 2.0 ** -8 * (xn @ wd).abs()
    W = torch.tensor([1.75] * (len(t) - 2) + [1.5, 1.0], dtype=torch.float64, device=dev)
    bound = (2 * W * (A / (4 * Cs)) * d_logit.max(1).values).mean().item()
    assert abs(l8 - exact) <= bound, (l8, exact, bound)
    assert abs(lb - exact) <= bound, (lb, exact, bound)
    assert l8 != exact


@pytest.mark.skipif(not HAS_CUDA, reason="the Triton cross-entropy kernel in the compiled head is the CUDA path")
def test_compiled_head_with_ce_kernel_matches_reference_on_gpu():
    """Compiled training head (bf16 matmul, Triton CE kernel) vs eager head with the CE reference, bf16 inputs:
    loss and gradients (rule 1 against float64)."""
    dev = torch.device("cuda")
    hp = dataclasses.replace(tg.Hyperparameters(), fp8_head=False)
    fns = tg.build_fns(hp, dev, compile_model=True)
    g = torch.Generator().manual_seed(1)
    N, V = 1024, 50304
    x = torch.randn(N, 768, generator=g).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(768, V, generator=g) * 0.04).to(dev, torch.bfloat16).requires_grad_()
    t = torch.randint(0, 50257, (N,), generator=g).to(dev)
    wk = torch.tensor([1.0, 0.5, 0.25], device=dev)
    loss = torch.compile(fns.loss, fullgraph=True, dynamic=False)(x, w, t, wk)
    dx, dw = torch.autograd.grad(loss, (x, w))
    ref = lambda a, b, c: tg.head_loss(a, b, t, c, hp.softcap, tg.softcapped_cross_entropy_ref, False)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    l64 = ref(x64, w64, wk.double())
    dx64, dw64 = torch.autograd.grad(l64, (x64, w64))
    lbf = ref(x, w, wk)
    dxbf, dwbf = torch.autograd.grad(lbf, (x, w))
    assert_matches_torch(loss, l64, lbf, name="compiled head loss")
    assert_matches_torch(dx, dx64, dxbf, name="compiled head dx")
    assert_matches_torch(dw, dw64, dwbf, name="compiled head dw")


# ----------------------------------------------------------------------------------------------------
# Every --no-<feature> flag: parsed, and one training micro-step runs and learns


@pytest.mark.parametrize("feature", FEATURES)
def test_disable_flag_parses_and_trains(feature, device):
    _, hp = cli.parse_args(["--smoke", f"--no-{feature.replace('_', '-')}"], tg.Hyperparameters,
                           tg.smoke_hyperparameters)
    assert getattr(hp, feature) is False
    assert all(getattr(hp, f) for f in FEATURES if f != feature)
    hp = dataclasses.replace(hp, param_dtype="float32", vocab_size=512, bos_id=511)
    params = {k: v.detach().to(device).requires_grad_() for k, v in perturbed(hp, seed=1).items()}
    ids = _ids(hp, 128, seed=2)
    targets = torch.roll(ids.long(), -1)
    fns = tg.build_fns(hp, torch.device(device), compile_model=False, attention="dense")
    mb = tg.MicroBatch(ids.to(device), targets.to(device), tg.prepare_ids(ids, hp.vocab_size).to(device))
    mtp = torch.tensor(tg.mtp_weights_at(hp, 0), device=device)
    opt = tg.Optimizer(hp, params, Dist(device=torch.device(device)))
    losses = []
    for step in range(2):
        loss = tg.forward(hp, params, fns, mb, (1, 2), {}, train=True, mtp=mtp)
        loss.backward()  # the optimizer's hooks fold the gradients into its accumulators
        opt.step(tg.step_plan(hp, step), 1.0, 0.9)
        losses.append(loss.item())
    assert math.isfinite(losses[0]) and losses[1] < losses[0], losses


@pytest.mark.skipif(not HAS_CUDA, reason="FlashAttention runs on CUDA only")
@pytest.mark.parametrize("paired,key_offset,with_ve,xsa", [(True, False, True, False), (False, True, True, False),
                                                         (False, False, False, False), (False, True, True, True),
                                                         (False, False, False, True)])
def test_compiled_sublayer_with_flash_attention_matches_dense_on_gpu(paired, key_offset, with_ve, xsa, monkeypatch):
    """The GPU form of the sublayer (compiled, speedrun::doc_attention over the documents of the sequence, or of
    the interleaved 2T sequence for paired heads), bf16 forward and backward, against the dense sublayer
    (rule 1 with the dense one in float64 and bf16). Without a value embedding, v reaches the op as a strided
    view of the fused projection's output, and dv comes back through the op's fake layout. xsa: --xsa's part
    (tanh(alpha) per head, alpha a leaf) in the compiled region, dalpha too. dalpha[h] = -sech^2(alpha[h]) *
    sum over tokens and dims of g * part (g: the gradient of y - tanh(alpha) * part), T * D = 32768 terms that
    cancel: its scale is the magnitude of those terms (the policy's scale for sums of products), read from the
    dense float64 run (the gradient reaching part is -tanh(alpha) * g)."""
    hp = tg.smoke_hyperparameters(num_heads=4, head_dim=64)
    hp = dataclasses.replace(hp, model_dim=256)
    T, window = 512, 128
    dev = torch.device("cuda")
    inp = _sublayer_inputs(hp, T, seed=9)
    freq, scale = tg.yarn_state(hp, 2)
    ours = with_lambdas(torch.compile(tg.make_attn_sublayer(hp, tg.flash_attend), fullgraph=True, dynamic=False))
    dense = with_lambdas(tg.make_attn_sublayer(hp, tg.dense_attend))
    ids = inp["ids"].to(dev)
    cu = tg.doc_cu_seqlens(inp["ids"], hp.bos_id).to(dev)
    docs = tg.doc_ids(ids, hp.bos_id)
    seq = (tg.DocSeq(2 * cu, docs.repeat_interleave(2), 2 * T) if paired else tg.DocSeq(cu, docs, T))

    parts = []

    def xsa_part(y, v):  # tg.xsa_part, keeping the part and the gradient that reaches it
        part = real_xsa_part(y, v)
        part.register_hook(lambda grad: parts.append((part.detach(), grad)))
        return part

    def run(fn, dtype):
        parts.clear()
        cos, sin = tg.rotary_tables(hp, T, dev, dtype, freq, paired=paired)
        alpha = torch.tensor([0.9, -0.6, 0.25, -1.4], dtype=torch.float64)
        leaves = [inp["x"], *inp["W"], inp["lam"], inp["ag"]] + ([inp["ve"], inp["vg"]] if with_ve else [])
        leaves = [t.to(dev, dtype).requires_grad_() for t in leaves + ([alpha] if xsa else [])]
        ins = leaves[:-1] if xsa else leaves
        out = fn(*ins, *([] if with_ve else [None, None]), cos, sin, torch.tensor(scale, device=dev), seq,
                 torch.tensor(window), paired=paired, key_offset=key_offset, bos=ids == hp.bos_id,
                 xsa=torch.tanh(leaves[-1]) if xsa else None)
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        return [out, *torch.autograd.grad(out, leaves, dy)]

    got = run(ours, torch.bfloat16)
    real_xsa_part = tg.xsa_part
    monkeypatch.setattr(tg, "xsa_part", xsa_part)  # after ours is compiled: the dense runs only
    ref64 = run(dense, torch.float64)
    scales = {}
    if xsa:
        assert len(parts) == 1, "the dense float64 run's part and its gradient"
        (part, grad), alpha = parts[0], torch.tensor([0.9, -0.6, 0.25, -1.4], dtype=torch.float64, device=dev)
        terms = (grad * part).abs().sum((0, 2)) / torch.tanh(alpha).abs() * (1 - torch.tanh(alpha) ** 2)
        scales["dalpha"] = terms.max().item()
    ref_lp = run(dense, torch.bfloat16)
    names = ["out", "dx", "dWq", "dWk", "dWv", "dWo", "dlam", "dgate"] + (["dve", "dvegate"] if with_ve else [])
    names += ["dalpha"] if xsa else []
    assert len(got) == len(names)
    for name, a, e, l in zip(names, got, ref64, ref_lp):
        assert_matches_torch(a, e, l, name=f"sublayer {name} paired={paired} key_offset={key_offset} ve={with_ve} "
                                           f"xsa={xsa}", scale=scales.get(name))


def test_fused_mlp_sublayer_matches_the_composite(device):
    """fused_mlp_sublayer (the norm, then kernels.mlp.relu2_mlp) against the composite mlp_sublayer: the output
    and the gradients of the lane and both matrices, in fp32 (IEEE dots in the kernel, on either device), against
    the composite in float64 (rule 1, torch's fp32 composite as the yardstick). A fused path that skipped the norm,
    swapped W_fc and W_proj^T or dropped a gradient is off by O(1)."""
    gen = torch.Generator().manual_seed(5)
    T, C, H = 37, 24, 72
    x = torch.randn(T, C, generator=gen) - 0.3
    w_fc = torch.randn(H, C, generator=gen) * C ** -0.5
    w_proj_t = torch.randn(H, C, generator=gen) * H ** -0.5
    dy = torch.randn(T, C, generator=gen)

    def run(fn, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, w_fc, w_proj_t)]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, dy.to(device, dtype))]

    got = run(tg.fused_mlp_sublayer, torch.float32)
    ref64, ref32 = run(tg.mlp_sublayer, torch.float64), run(tg.mlp_sublayer, torch.float32)
    for name, a, e, l in zip(["out", "dx", "dw_fc", "dw_proj_t"], got, ref64, ref32):
        assert_matches_torch(a, e, l, name=f"fused mlp sublayer {name}")


@pytest.mark.parametrize("fused,dtype,reason", [
    (True, "bfloat16", "the fused kernel takes CUDA and bf16/fp16, not cpu bfloat16"),
    (False, "bfloat16", "--no-fused-mlp"),
])
def test_build_fns_names_the_mlp_path(fused, dtype, reason):
    """On the CPU the composite runs, and the log's `mlp:` line says why (the flag, or the device)."""
    hp = tg.smoke_hyperparameters(fused_mlp=fused, param_dtype=dtype)
    fns = tg.build_fns(hp, torch.device("cpu"), compile_model=False)
    assert fns.mlp_path == f"torch: matmul, then ReLU² ({reason})"
