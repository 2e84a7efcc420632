"""Tests of kernels/embedding.py: deterministic embedding backward, ids preparation, autograd lookup.

Two references: the float64 ``index_add_`` (``embedding_backward_ref``), checked within the derived bound
below, and ``embedding_backward_ordered_ref`` (the documented fp32 summation order in plain PyTorch), which
the kernel must match bit for bit. Without a GPU the kernels run in Triton's interpreter: small shapes only
(cases marked GPU-only use the real speedrun shapes).
"""
import pytest
import torch
import torch.nn.functional as F

from kernels.embedding import (DEFAULT_CONFIG, PIECE, TUNING_CANDIDATES, EmbeddingPrep, embedding,
                               embedding_backward, embedding_backward_ordered_ref, embedding_backward_ref,
                               prepare_ids)
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


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_embedding_compiles_fullgraph_cpu_backends(backend, device):
    """fullgraph=True proves the custom ops trace without graph breaks; aot_eager also runs their fakes."""
    torch._dynamo.reset()
    C, V = 16, 33
    ids = make_ids("uniform", 40, V).reshape(4, 10).to(device)
    weight = shifted_randn(V, C, device=device).requires_grad_()
    prep = prepare_ids(ids.cpu(), V).to(device)
    fn = torch.compile(lambda i, w, p: (embedding(i, w, p) * 2).sum(-1), fullgraph=True, backend=backend)
    out = fn(ids, weight, prep)
    assert torch.equal(out, (F.embedding(ids, weight) * 2).sum(-1))
    out.backward(torch.ones_like(out))
    assert torch.equal(weight.grad, embedding_backward(torch.full((4, 10, C), 2.0, device=device), ids, V))


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
