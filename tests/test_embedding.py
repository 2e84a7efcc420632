"""Tests of kernels/embedding.py: deterministic embedding backward (dense and accumulate modes), ids
preparation, autograd lookup.

Two references: the float64 ``index_add_`` (``embedding_backward_ref``), checked within the derived bound
below, and ``embedding_backward_ordered_ref`` (the documented fp32 summation order in plain PyTorch), which
the kernel must match bit for bit. The accumulate mode (acc[v] += float(round(sum)) for the touched rows) is
held to its specification written again here: bit for bit acc + the dense kernel's output on the touched rows,
untouched rows never written (their bits, NaN and -0.0 included, unchanged), and within the float64 bound of
acc + the float64 sum. Without a GPU the kernels run in Triton's interpreter: small shapes only (cases marked
GPU-only use the real speedrun shapes).
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.embedding import (DEFAULT_CONFIG, PIECE, TUNING_CANDIDATES, EmbeddingPrep, _embedding_fwd_op,
                               embedding, embedding_backward, embedding_backward_accumulate,
                               embedding_backward_accumulate_ref, embedding_backward_ordered_ref,
                               embedding_backward_ref, prepare_ids)
from tests.tolerances import (assert_all_written, assert_close_report, shifted_randn,
                              unit_roundoff)

HAS_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="speedrun shapes / torch.compile(inductor) / pinned memory "
                                                   "need a CUDA GPU (too slow in the Triton interpreter)")

# A configuration other than the default, for the bitwise "launch configuration does not matter" checks.
OTHER_CONFIG = dict(ROWS=4, BLOCK_C=32, UNROLL=2, num_warps=1)


def make_ids(kind, n, num_embeddings, seed=0):
    """int64 ids (n,) of one distribution; when n >= 2 they include 0 and V-1 (except 'equal': all V-1)."""
    gen = torch.Generator().manual_seed(seed)
    V = num_embeddings
    if kind == "uniform":
        ids = torch.randint(0, V, (n,), generator=gen)
    elif kind == "unique":
        middle = 1 + torch.randperm(V - 2, generator=gen)[:max(n - 2, 0)]
        ids = torch.cat([torch.tensor([0, V - 1]), middle])[:n]
        return ids[torch.randperm(n, generator=gen)]
    elif kind == "equal":
        return torch.full((n,), V - 1, dtype=torch.int64)
    elif kind == "zipf":
        ids = torch.multinomial(1.0 / torch.arange(1, V + 1, dtype=torch.float64), n, replacement=True,
                                generator=gen)
    elif kind == "long":
        # Several segments longer than PIECE (they cross tile boundaries, start inside tiles, and two of them
        # can share a tile) mixed with short ones, in shuffled positions.
        lengths = [PIECE + 6, 2 * PIECE + 3, PIECE + 1, 3, 1, 3 * PIECE]
        ids = torch.cat([torch.full((k,), (7 * i + 2) % V) for i, k in enumerate(lengths)])
        ids = torch.cat([ids, torch.randint(0, V, (max(n - ids.numel(), 0),), generator=gen)])[:n]
        ids = ids[torch.randperm(n, generator=gen)]
    else:
        raise ValueError(kind)
    if n >= 2:
        ids[0], ids[-1] = 0, V - 1
    return ids


def derived_bound(grad_out, ids, num_embeddings, out_dtype):
    """(atol, rtol) for |kernel - float64 reference|, elementwise.

    A row of n terms is summed in fp32 with n - 1 additions that can round (the first, 0 + g_0, is exact;
    splitting a long segment into k pieces gives (n - k) + (k - 1) = n - 1 roundings too), each off by at most
    u32 * (sum of |g|) (Higham, recursive summation): |s_fp32 - s| <= (n - 1) * u32 * sum|g|, up to a factor
    1 + O(n u32). The single rounding to the output dtype adds u_out * |s_fp32|. Hence
        |out - s| <= u_out * |s| + (1 + u_out) * (n - 1) * u32 * (1 + n u32) * sum|g|,
    i.e. rtol = one unit roundoff of the output (rule 2 with ulps=1) and atol = the fp32 summation term,
    taken at its largest row (nmax terms, max sum|g|) so that the helper gets a scalar. A dropped, doubled or misplaced gradient row changes a sum
    by a whole |g| ~ 2.3, far above atol (~1e-4 at the sizes tested)."""
    u32, u_out = unit_roundoff(torch.float32), unit_roundoff(out_dtype)
    n_max = int(torch.bincount(ids.reshape(-1).cpu(), minlength=num_embeddings).max()) if ids.numel() else 0
    abs_sum = embedding_backward_ref(grad_out.abs(), ids, num_embeddings).abs().max().item() if ids.numel() else 0
    atol = (1 + u_out) * max(n_max - 1, 0) * u32 * (1 + n_max * u32) * abs_sum
    return atol, u_out


def bits(t):
    """Integer view of a float tensor: torch.equal on it compares bits (-0.0 vs +0.0, NaN payloads)."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


def ordered_expected(grad_out, ids, num_embeddings, out_dtype):
    return embedding_backward_ordered_ref(grad_out, ids, num_embeddings).to(out_dtype)


# The output has the gradient's dtype.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]

# (N, C, V, kind): N = 0, 1 and sizes that are multiples of no block, and one aligned case; C odd and a power
# of two.
CPU_CASES = [
    (0, 64, 20, "uniform"),
    (1, 64, 20, "uniform"),
    (37, 767, 21, "uniform"),
    (75, 64, 200, "unique"),
    (133, 64, 150, "zipf"),
    (PIECE * 4 + 13, 64, 30, "equal"),
    (PIECE * 9 + 5, 67, 50, "long"),
    (PIECE * 4, 128, 128, "uniform"),  # N, C and V multiples of the pieces and tiles: no partial block
]
GPU_CASES = [
    (49152, 768, 50304, "uniform"),
    (49152, 768, 50304, "zipf"),
    (49152, 768, 50304, "equal"),
    (16384, 768, 50304, "zipf"),
    (1151, 767, 50304, "long"),
]
CASES = CPU_CASES + [pytest.param(*c, marks=gpu_only) for c in GPU_CASES]


def case_id(c):
    c = c.values if hasattr(c, "values") else c
    return f"N{c[0]}-C{c[1]}-V{c[2]}-{c[3]}"


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled floating tensors: an output element (or scratch partial) the kernels
    never write shows up as NaN."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("odtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("N,C,V,kind", CASES, ids=[case_id(c) for c in CASES])
def test_embedding_backward(N, C, V, kind, odtype, device, nan_empty):
    ids = make_ids(kind, N, V).to(device)
    g = shifted_randn(N, C, dtype=odtype, device=device)
    prep = prepare_ids(ids.cpu(), V).to(device)
    out = embedding_backward(g, ids, V, prep=prep)
    assert out.shape == (V, C) and out.dtype == odtype
    assert_all_written(out)
    # bit for bit the documented summation order, untouched rows exactly zero included
    expected = ordered_expected(g, ids, V, odtype)
    if not torch.equal(bits(out.cpu()), bits(expected)):
        assert_close_report(out, expected, atol=0.0, name="kernel vs ordered reference (bitwise)")
        raise AssertionError("kernel differs from the ordered reference only in the sign of zeros")
    atol, rtol = derived_bound(g, ids, V, odtype)
    ref = embedding_backward_ref(g, ids, V).to(out.device)
    # A sum beyond the output dtype's range must round to +-inf (fp16: 49152 equal ids sum to ~-1.1e5), exactly
    # where the float64 value itself rounds to inf; the other elements are judged against float64.
    overflow = ref.to(odtype).isinf()
    assert torch.equal(out.isinf(), overflow), "infinities where the float64 sum does not overflow (or missing)"
    assert torch.equal(out[overflow], ref.to(odtype)[overflow]), "overflow to the wrong sign"
    assert_close_report(out.masked_fill(overflow, 0), ref.masked_fill(overflow, 0), atol=atol, rtol=rtol,
                        name="vs float64")


# ----------------------------------------------------------------------------------------------- accumulate mode
def touched_rows(ids, num_embeddings):
    """(V,) bool: the rows some id names (written out here, not taken from the module)."""
    t = torch.zeros(num_embeddings, dtype=torch.bool)
    t[ids.reshape(-1).cpu().long()] = True
    return t


def make_acc(V, C, layout, touched, device, seed=0):
    """(buffer, acc, inside): an fp32 (V, C) accumulator prefilled with shifted random values, where untouched
    rows hold NaN (every third) and -0.0 (every third, from the second): a kernel that writes an untouched row
    at all, even with acc + 0.0, changes its bits. layout "contiguous", or "strided": a view at an offset into
    a wider buffer (row stride C + 5), as the optimizer's padded or stacked accumulators; inside marks acc's
    elements of the buffer (the others must stay as they are)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols, r0, c0 = (V, C, 0, 0) if layout == "contiguous" else (V + 3, C + 5, 1, 2)
    buf = shifted_randn(rows, cols, generator=gen)
    inside = torch.zeros(rows, cols, dtype=torch.bool)
    inside[r0:r0 + V, c0:c0 + C] = True
    acc = buf[r0:r0 + V, c0:c0 + C]
    untouched = torch.nonzero(~touched).reshape(-1)
    acc[untouched[0::3]] = float("nan")
    acc[untouched[1::3]] = -0.0
    buf = buf.to(device)
    return buf, buf[r0:r0 + V, c0:c0 + C], inside


def check_accumulated(acc, acc0, buf, buf0, inside, g, ids, V):
    """The accumulate mode's specification, on the result acc of acc0 (buf0: the whole buffer before)."""
    touched = touched_rows(ids, V)
    acc, acc0 = acc.cpu(), acc0.cpu()
    # untouched rows never written: their bits (NaN payloads, -0.0) unchanged; nothing outside the view written
    assert torch.equal(bits(acc[~touched]), bits(acc0[~touched])), "an untouched row was written"
    assert torch.equal(bits(buf.cpu()[~inside]), bits(buf0.cpu()[~inside])), "written outside acc's view"
    # touched rows bit for bit acc + the dense kernel's output: acc.add_(embedding_backward(...)) on them
    expected = acc0 + embedding_backward(g, ids, V).cpu().float()
    if not torch.equal(bits(acc[touched]), bits(expected[touched])):
        assert_close_report(acc[touched], expected[touched], atol=0.0, name="accumulate vs acc + dense (bitwise)")
        raise AssertionError("accumulate vs acc + dense: only the sign of zeros differs")
    # and bit for bit the module's reference of the mode, every row
    ref = embedding_backward_accumulate_ref(g, ids, acc0)
    assert torch.equal(bits(acc), bits(ref)), "accumulate vs embedding_backward_accumulate_ref (bitwise)"


@pytest.mark.parametrize("odtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("N,C,V,kind", CASES, ids=[case_id(c) for c in CASES])
def test_embedding_backward_accumulate(N, C, V, kind, odtype, device, nan_empty):
    ids = make_ids(kind, N, V).to(device)
    g = shifted_randn(N, C, dtype=odtype, device=device)
    prep = prepare_ids(ids.cpu(), V).to(device)
    touched = touched_rows(ids, V)
    buf, acc, inside = make_acc(V, C, "strided", touched, device)
    buf0, acc0 = buf.clone(), acc.clone()
    out = embedding_backward_accumulate(g, ids, acc, prep=prep)
    assert out is acc
    check_accumulated(acc, acc0, buf, buf0, inside, g, ids, V)
    # float64: acc0 + s within |round(s32) - s| (derived_bound) plus the fp32 add's rounding u32 |acc0 + r|
    s = embedding_backward_ref(g, ids, V)[touched]
    a0 = acc0.cpu().double()[touched]
    atol, rtol = derived_bound(g, ids, V, odtype)
    err = atol + rtol * s.abs()
    bound = err + unit_roundoff(torch.float32) * (a0.abs() + s.abs() + err)
    got = acc.cpu()[touched]
    overflow = s.to(odtype).isinf()   # a sum beyond the weight dtype's range rounds to inf (fp16, GPU shapes)
    assert torch.equal(got.isinf(), overflow) and torch.equal(got[overflow], s.to(odtype).float()[overflow])
    assert_close_report(got.masked_fill(overflow, 0), (a0 + s).masked_fill(overflow, 0),
                        atol=bound.masked_fill(overflow, 0), name="accumulate vs float64")


# The accumulator's layout, the ids' dtype, the prep given or made by the launcher, and the launch configuration:
# every pair of their values in some case (five cases cover all 24 pairs of the four two-way choices; each case
# costs one or two seconds in the interpreter, the 16 of the full product took 20 s).
ACCUMULATE_CASES = [
    ("contiguous", torch.int64, False, None),
    ("contiguous", torch.int32, True, OTHER_CONFIG),
    ("strided", torch.int64, True, OTHER_CONFIG),
    ("strided", torch.int32, False, OTHER_CONFIG),
    ("strided", torch.int32, True, None),
]


@pytest.mark.parametrize("layout,id_dtype,use_prep,config", ACCUMULATE_CASES,
                         ids=[f"{a}-{str(b)[6:]}-{'prep' if c else 'noprep'}-{'other_config' if d else 'default'}"
                              for a, b, c, d in ACCUMULATE_CASES])
def test_accumulate_layouts_ids_prep_config(layout, id_dtype, use_prep, config, device, nan_empty):
    N, C, V = PIECE * 5 + 3, 40, 37
    ids = make_ids("long", N, V).reshape(17, 19).to(device=device, dtype=id_dtype)
    g = shifted_randn(17, 19, C, dtype=torch.bfloat16, device=device)
    buf, acc, inside = make_acc(V, C, layout, touched_rows(ids, V), device, seed=1)
    buf0, acc0 = buf.clone(), acc.clone()
    prep = prepare_ids(ids.cpu(), V).to(device) if use_prep else None
    embedding_backward_accumulate(g, ids, acc, prep=prep, config=config)
    check_accumulated(acc, acc0, buf, buf0, inside, g, ids, V)


def test_accumulate_micro_steps_equal_dense_gradients_added(device):
    """The optimizer's use: an accumulator that starts at +0.0 and takes several micro-steps' gradients (one
    id repeated N times, Zipf ids, uniform ids) ends bitwise equal, every row, to zeros + dense_1 + dense_2 + ...;
    no row ever holds -0.0 (the module docstring's argument), so the untouched rows' acc + 0.0 changes nothing."""
    C, V = 24, 70
    acc = torch.zeros(V, C, device=device)
    expected = torch.zeros(V, C)
    for i, (kind, N) in enumerate([("equal", 3 * PIECE + 1), ("zipf", 150), ("uniform", 40)]):
        ids = make_ids(kind, N, V, seed=i).to(device)
        g = shifted_randn(N, C, dtype=torch.bfloat16, device=device, mean=2.3 * (-1) ** i)
        embedding_backward_accumulate(g, ids, acc)
        expected.add_(embedding_backward(g, ids, V).cpu())
    assert torch.equal(bits(acc.cpu()), bits(expected))
    assert not (bits(acc.cpu()) == bits(torch.tensor(-0.0))).any()


def test_accumulate_leaves_negative_zero_that_acc_plus_zero_would_clear(device):
    """The one value where the dense path (acc + 0.0 on an untouched row) and the accumulate mode (no write)
    differ: -0.0 becomes +0.0 there and stays -0.0 here. Documented, never met by the optimizer (see above)."""
    C, V = 8, 6
    ids = torch.tensor([1, 4, 4], device=device)
    g = shifted_randn(3, C, device=device)
    acc = torch.full((V, C), -0.0, device=device)
    dense = acc + embedding_backward(g, ids, V)
    embedding_backward_accumulate(g, ids, acc)
    untouched = torch.tensor([0, 2, 3, 5])
    assert (bits(acc.cpu()[untouched]) == bits(torch.tensor(-0.0))).all()
    assert (bits(dense.cpu()[untouched]) == 0).all()
    assert torch.equal(acc[[1, 4]], dense[[1, 4]])


@pytest.mark.parametrize("kind", ["long", "zipf"])
def test_bitwise_repeatable_and_config_independent(kind, device):
    N, C, V = PIECE * 9 + 5, 40, 50
    ids = make_ids(kind, N, V).to(device)
    g = shifted_randn(N, C, dtype=torch.bfloat16, device=device)
    prep = prepare_ids(ids.cpu(), V).to(device)
    runs = [embedding_backward(g, ids, V, prep=prep) for _ in range(3)]
    runs.append(embedding_backward(g, ids, V, prep=prep, config=OTHER_CONFIG))
    runs.append(embedding_backward(g, ids, V, prep=prep, config=TUNING_CANDIDATES[-1]))
    for i, r in enumerate(runs[1:], 1):
        assert torch.equal(bits(r), bits(runs[0])), f"run {i} differs from run 0"


@gpu_only
def test_speedrun_shape_config_independent(device):
    N, C, V = 49152, 768, 50304
    for kind in ("uniform", "zipf", "equal"):
        ids = make_ids(kind, N, V).to(device)
        g = shifted_randn(N, C, dtype=torch.bfloat16, device=device)
        prep = prepare_ids(ids.cpu(), V).to(device)
        first = embedding_backward(g, ids, V, prep=prep)
        for cfg in [DEFAULT_CONFIG] * 2 + TUNING_CANDIDATES:
            assert torch.equal(embedding_backward(g, ids, V, prep=prep, config=cfg), first), (kind, cfg)


def test_prepare_ids(device):
    V = 30
    ids = make_ids("zipf", 5 * 23, V).reshape(5, 23).to(torch.int32)
    prep = prepare_ids(ids, V)
    assert isinstance(prep, EmbeddingPrep) and prep.n == 115 and prep.num_embeddings == V
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    assert prep.order.dtype == prep.sorted_ids.dtype == prep.row_ptr.dtype == torch.int32
    assert torch.equal(prep.order.long(), order)
    assert torch.equal(prep.sorted_ids.long(), flat[order])
    counts = torch.bincount(flat, minlength=V)
    assert torch.equal(prep.row_ptr.long(), torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    moved = prep.to(device)
    assert moved.order.device.type == torch.device(device).type and moved.n == prep.n


def test_prep_on_cpu_equals_no_prep(device):
    N, C, V = PIECE * 5 + 3, 48, 40
    ids = make_ids("long", N, V).reshape(17, 19)
    g = shifted_randn(*ids.shape, C, dtype=torch.bfloat16, device=device)
    with_prep = embedding_backward(g, ids.to(device), V, prep=prepare_ids(ids, V).to(device, non_blocking=True))
    without = embedding_backward(g, ids.to(device), V)
    assert torch.equal(with_prep, without)


@gpu_only
def test_pinned_prep_non_blocking(device):
    N, C, V = 49152, 768, 50304
    ids = make_ids("zipf", N, V)
    prep = prepare_ids(ids, V).pin_memory()
    assert prep.order.is_pinned() and prep.row_ptr.is_pinned() and prep.sorted_ids.is_pinned()
    g = shifted_randn(N, C, dtype=torch.bfloat16, device=device)
    got = embedding_backward(g, ids.to(device), V, prep=prep.to(device, non_blocking=True))
    assert torch.equal(got.cpu(), ordered_expected(g, ids, V, torch.bfloat16))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_batched_ids_and_noncontiguous_grad(id_dtype, device):
    B, T, C, V = 3, 29, 40, 25
    ids = make_ids("zipf", B * T, V).reshape(B, T).to(device=device, dtype=id_dtype)
    wide = shifted_randn(B, T, 2 * C, dtype=torch.float32, device=device)
    g = wide[..., ::2]                                                  # channel stride 2
    assert not g.is_contiguous()
    got = embedding_backward(g, ids, V)
    assert torch.equal(got, embedding_backward(g.contiguous(), ids, V))
    assert torch.equal(got.cpu(), embedding_backward_ordered_ref(g, ids, V))
    gt = shifted_randn(T, B, C, dtype=torch.float32, device=device).transpose(0, 1)   # row stride permuted
    assert torch.equal(embedding_backward(gt, ids, V), embedding_backward(gt.contiguous(), ids, V))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_prep", [False, True], ids=["noprep", "prep"])
def test_embedding_autograd(use_prep, wdtype, device):
    B, T, C, V = 2, 37, 24, 45
    ids = make_ids("zipf", B * T, V).reshape(B, T).to(device)
    weight = shifted_randn(V, C, dtype=wdtype, device=device).requires_grad_()
    prep = prepare_ids(ids.cpu(), V).to(device) if use_prep else None
    y = embedding(ids, weight, prep)
    assert torch.equal(y, F.embedding(ids, weight))
    g1 = shifted_randn(B, T, C, dtype=wdtype, device=device)
    y.backward(g1)
    e1 = embedding_backward(g1, ids, V)
    assert torch.equal(weight.grad, e1)
    # a second backward accumulates into .grad the usual autograd way (an add in the weight's dtype)
    g2 = shifted_randn(B, T, C, dtype=wdtype, device=device, mean=1.0)
    embedding(ids, weight, prep).backward(g2)
    assert torch.equal(weight.grad, e1 + embedding_backward(g2, ids, V))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("use_prep", [False, True], ids=["noprep", "prep"])
def test_embedding_autograd_accumulate(use_prep, wdtype, device):
    """embedding(..., acc=acc): the backward adds into acc (bitwise acc + the dense gradient) and gives the weight
    none: .grad stays None (a post-accumulate-grad hook on it, if autograd runs it, sees None), micro-step after
    micro-step."""
    B, T, C, V = 2, 37, 24, 45
    ids = make_ids("zipf", B * T, V).reshape(B, T).to(device)
    weight = shifted_randn(V, C, dtype=wdtype, device=device).requires_grad_()
    seen = []
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    prep = prepare_ids(ids.cpu(), V).to(device) if use_prep else None
    buf = shifted_randn(V + 2, C + 3, device=device)
    acc = buf[1:V + 1, :C]                                      # a strided view, as the optimizer's padded rows
    expected = acc.clone()
    for step in range(2):
        y = embedding(ids, weight, prep, acc=acc)
        assert torch.equal(y, F.embedding(ids, weight))
        g = shifted_randn(B, T, C, dtype=wdtype, device=device, mean=1.0 - 2.3 * step)
        y.backward(g)
        assert weight.grad is None
        expected = expected + embedding_backward(g, ids, V).float()   # untouched rows: + 0.0, no -0.0 in acc
        assert torch.equal(bits(acc), bits(expected)), f"micro-step {step}"
    assert all(grad is None for grad in seen)  # train_gpt's hooks find no gradient to fold


def test_embedding_autograd_accumulate_views_of_one_buffer(device):
    """The value-embedding layout: tables that are views of one parameter (.view(n, V, C).unbind(0)) with
    accumulators that are views of one buffer. Each lookup's backward changes the buffer that the next one's
    acc views (a saved tensor would fail autograd's in-place check); the weight gets no gradient at all, and the
    buffer ends bitwise equal to the stacked dense gradient added to it."""
    n, V, C, N = 3, 29, 16, 90
    ids = make_ids("zipf", N, V).to(device)
    prep = prepare_ids(ids.cpu(), V).to(device)
    w = shifted_randn(n * V, C, dtype=torch.bfloat16, device=device)
    gs = [shifted_randn(N, C, dtype=torch.bfloat16, device=device, mean=m) for m in (-2.3, 0.4, 1.7)]

    def run(weight, accs):
        ys = [embedding(ids, t, prep, acc=a) for t, a in zip(weight.view(n, V, C).unbind(0), accs)]
        torch.autograd.backward(ys, gs)

    dense_w = w.clone().requires_grad_()
    run(dense_w, [None] * n)
    buf = shifted_randn(n * V, C, device=device)
    expected = buf + dense_w.grad.float()
    acc_w = w.clone().requires_grad_()
    run(acc_w, buf.view(n, V, C).unbind(0))
    assert acc_w.grad is None
    assert torch.equal(bits(buf), bits(expected))


@pytest.mark.parametrize("accumulate", [False, True], ids=["dense", "accumulate"])
def test_eager_lookup_skips_custom_op_dispatch(accumulate, device):
    """Eagerly, embedding() and its backward reach the kernels without torch.library's custom-op dispatch (host
    time on every call), and give the bits of the custom ops, which torch.compile traces (called here directly,
    as a compiled graph calls them)."""
    C, V, N = 16, 33, 40
    ids = make_ids("zipf", N, V).to(device)
    prep = prepare_ids(ids.cpu(), V).to(device)
    g = shifted_randn(N, C, dtype=torch.bfloat16, device=device)
    w0 = shifted_randn(V, C, dtype=torch.bfloat16, device=device)
    acc0 = shifted_randn(V, C, device=device)

    def run(lookup):
        w = w0.clone().requires_grad_()
        acc = acc0.clone() if accumulate else None
        y = lookup(ids, w, prep, acc)
        y.backward(g)
        return y, acc if accumulate else w.grad

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y, out = run(lambda i, w, p, a: embedding(i, w, p, acc=a))
    dispatched = sorted({e.name for e in prof.events() if e.name.startswith("speedrun::")})
    assert dispatched == [], f"eager lookup went through the custom ops {dispatched}"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y_op, out_op = run(lambda i, w, p, a: _embedding_fwd_op(i, w, p.order, p.sorted_ids, p.row_ptr, a))
    assert "speedrun::embedding_fwd" in {e.name for e in prof.events()}  # the profiler does see a custom op
    assert torch.equal(bits(y), bits(y_op))
    assert torch.equal(bits(out), bits(out_op))
    if accumulate:
        assert torch.equal(bits(out), bits(acc0 + embedding_backward(g, ids, V).float()))


@pytest.mark.parametrize("accumulate", [False, True], ids=["dense", "accumulate"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_embedding_compiles_fullgraph_cpu_backends(backend, accumulate, device):
    """fullgraph=True proves the custom ops trace without graph breaks; aot_eager also runs their fakes. With an
    accumulator the mutating backward op traces too: acc changes in place and the weight gets no gradient."""
    torch._dynamo.reset()
    C, V = 16, 33
    ids = make_ids("uniform", 40, V).reshape(4, 10).to(device)
    weight = shifted_randn(V, C, device=device).requires_grad_()
    acc = shifted_randn(V, C, device=device) if accumulate else None
    acc0 = acc.clone() if accumulate else None
    prep = prepare_ids(ids.cpu(), V).to(device)
    fn = torch.compile(lambda i, w, p, a: (embedding(i, w, p, acc=a) * 2).sum(-1), fullgraph=True, backend=backend)
    out = fn(ids, weight, prep, acc)
    assert torch.equal(out, (F.embedding(ids, weight) * 2).sum(-1))
    out.backward(torch.ones_like(out))
    dense = embedding_backward(torch.full((4, 10, C), 2.0, device=device), ids, V)
    if accumulate:
        assert weight.grad is None
        assert torch.equal(bits(acc), bits(acc0 + dense))
    else:
        assert torch.equal(weight.grad, dense)


@gpu_only
@pytest.mark.parametrize("use_prep", [False, True], ids=["noprep", "prep"])
def test_embedding_compiles_fullgraph_inductor(use_prep, device):
    torch._dynamo.reset()
    N, C, V = 4096, 768, 50304
    ids = make_ids("zipf", N, V).reshape(4, N // 4).to(device)
    weight = shifted_randn(V, C, dtype=torch.bfloat16, device=device).requires_grad_()
    prep = prepare_ids(ids.cpu(), V).to(device) if use_prep else None
    g = shifted_randn(4, N // 4, C, dtype=torch.bfloat16, device=device)
    fn = torch.compile(lambda i, w, p: embedding(i, w, p) * 1.0, fullgraph=True)
    y = fn(ids, weight, prep)
    assert torch.equal(y, F.embedding(ids, weight))
    y.backward(g)
    assert torch.equal(weight.grad, embedding_backward(g, ids, V))


@gpu_only
def test_embedding_accumulate_compiles_fullgraph_inductor(device):
    torch._dynamo.reset()
    N, C, V = 4096, 768, 50304
    ids = make_ids("zipf", N, V).reshape(4, N // 4).to(device)
    weight = shifted_randn(V, C, dtype=torch.bfloat16, device=device).requires_grad_()
    prep = prepare_ids(ids.cpu(), V).to(device)
    acc = shifted_randn(V, C, device=device)
    acc0 = acc.clone()
    g = shifted_randn(4, N // 4, C, dtype=torch.bfloat16, device=device)
    fn = torch.compile(lambda i, w, p, a: embedding(i, w, p, acc=a) * 1.0, fullgraph=True)
    fn(ids, weight, prep, acc).backward(g)
    assert weight.grad is None
    assert torch.equal(bits(acc), bits(acc0 + embedding_backward(g, ids, V).float()))


# ----------------------------------------------------------------------------------------------- errors
def test_prepare_ids_errors():
    V = 10
    with pytest.raises(TypeError, match="int32 or int64"):
        prepare_ids(torch.zeros(4), V)
    with pytest.raises(ValueError, match=r"found id -1, expected 0 <= id < 10"):
        prepare_ids(torch.tensor([0, -1, 3]), V)
    with pytest.raises(ValueError, match=r"found id 10, expected 0 <= id < 10"):
        prepare_ids(torch.tensor([0, 10, 3], dtype=torch.int32), V)
    with pytest.raises(ValueError, match="num_embeddings must be in"):
        prepare_ids(torch.tensor([0]), 0)
    with pytest.raises(TypeError, match="num_embeddings must be an int"):
        prepare_ids(torch.tensor([0]), 3.0)


def _args(device, N=6, C=8, V=10, dtype=torch.float32):
    ids = torch.arange(N, device=device) % V
    return torch.ones(N, C, dtype=dtype, device=device), ids, V


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda g, i, V: dict(ids=i.float()), TypeError, "int32 or int64"),
    (lambda g, i, V: dict(ids=torch.tensor([0, 1, 2, 3, 4, 12], device=i.device)), ValueError,
     r"found id 12, expected 0 <= id < 10"),
    (lambda g, i, V: dict(grad_out=g[:-1]), ValueError, "grad_out must have shape ids.shape"),
    (lambda g, i, V: dict(grad_out=g[None]), ValueError, "grad_out must have shape ids.shape"),
    (lambda g, i, V: dict(grad_out=g.double()), TypeError, "grad_out must be float32, bfloat16 or float16"),
    (lambda g, i, V: dict(grad_out=g.to(torch.int32)), TypeError, "grad_out must be float32"),
    (lambda g, i, V: dict(ids=i.to("meta")), ValueError, "ids is on meta but grad_out is on"),
    (lambda g, i, V: dict(prep=prepare_ids(i.cpu(), V + 1).to(g.device)), ValueError,
     "prep was made for num_embeddings=11, but num_embeddings is 10"),
    (lambda g, i, V: dict(prep=prepare_ids(i[:-1].cpu(), V).to(g.device)), ValueError,
     "prep was made for N=5 ids, but ids has 6 elements"),
    (lambda g, i, V: dict(prep=prepare_ids(i.cpu(), V).to("meta")), ValueError, "prep.order is on meta"),
    (lambda g, i, V: dict(prep=(1, 2, 3)), TypeError, "prep must be an EmbeddingPrep"),
    (lambda g, i, V: dict(config=dict(ROWS=3, BLOCK_C=32, UNROLL=2, num_warps=1)), ValueError,
     "power of two"),
    (lambda g, i, V: dict(config=dict(ROWS=4)), ValueError, "config must have exactly the keys"),
    (lambda g, i, V: dict(num_embeddings=-3), ValueError, "num_embeddings must be in"),
])
def test_embedding_backward_errors(mutate, exc, match, device):
    g, ids, V = _args(device)
    kwargs = dict(grad_out=g, ids=ids, num_embeddings=V)
    kwargs.update(mutate(g, ids, V))
    with pytest.raises(exc, match=match):
        embedding_backward(**kwargs)


def test_embedding_errors(device):
    V, C = 10, 4
    w = torch.zeros(V, C, device=device)
    ids = torch.arange(6, device=device)
    with pytest.raises(TypeError, match="int32 or int64"):
        embedding(ids.float(), w)
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        embedding(ids, w[0])
    with pytest.raises(ValueError, match="ids is on meta"):
        embedding(ids.to("meta"), w)
    with pytest.raises(ValueError, match="prep was made for num_embeddings=11"):
        embedding(ids, w, prepare_ids(ids.cpu(), V + 1).to(device))
    with pytest.raises(ValueError, match="prep was made for N=5"):
        embedding(ids, w, prepare_ids(ids[:5].cpu(), V).to(device))
    with pytest.raises(ValueError, match=r"acc must be a float32 tensor of weight's shape \(10, 4\)"):
        embedding(ids, w, acc=torch.zeros(V, C, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match=r"acc must be a float32 tensor of weight's shape"):
        embedding(ids, w, acc=torch.zeros(V + 1, C, device=device))
    with pytest.raises(ValueError, match="acc is on meta"):
        embedding(ids, w, acc=torch.zeros(V, C, device="meta"))


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda g, i, a: dict(acc=a.to(torch.bfloat16)), TypeError, "acc must be a 2-D float32 tensor"),
    (lambda g, i, a: dict(acc=a[0]), TypeError, "acc must be a 2-D float32 tensor"),
    (lambda g, i, a: dict(acc=a.tolist()), TypeError, "acc must be a 2-D float32 tensor"),
    (lambda g, i, a: dict(acc=a[:, :-1]), ValueError, r"acc must have C = 8 columns"),
    (lambda g, i, a: dict(acc=a.to("meta")), ValueError, "acc is on meta but grad_out is on"),
    (lambda g, i, a: dict(acc=torch.zeros(8, 10, device=g.device).T), ValueError, "unit channel stride"),
    (lambda g, i, a: dict(acc=torch.zeros(1, 8, device=g.device).expand(10, 8)), ValueError,
     "non-overlapping rows"),
    (lambda g, i, a: dict(acc=a[:5]), ValueError, r"found id 5, expected 0 <= id < 5"),
    (lambda g, i, a: dict(prep=prepare_ids(i.cpu(), 11).to(g.device)), ValueError,
     "prep was made for num_embeddings=11, but num_embeddings is 10"),
    (lambda g, i, a: dict(grad_out=g[:-1]), ValueError, "grad_out must have shape ids.shape"),
    (lambda g, i, a: dict(grad_out=g.double()), TypeError, "grad_out must be float32, bfloat16 or float16"),
])
def test_embedding_backward_accumulate_errors(mutate, exc, match, device):
    g, ids, V = _args(device)
    acc = torch.zeros(V, g.shape[1], device=device)
    kwargs = dict(grad_out=g, ids=ids, acc=acc)
    kwargs.update(mutate(g, ids, acc))
    with pytest.raises(exc, match=match):
        embedding_backward_accumulate(**kwargs)
    assert not acc.any()
