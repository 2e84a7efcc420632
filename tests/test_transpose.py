"""Tests for kernels/transpose.py: bitwise equality with torch for every dtype, shape and layout.

Copies are compared bit for bit (through integer views, so NaN payloads and negative zero count too). Adds are
compared bit for bit with the exact sum rounded once to the output dtype (round to nearest even): the
fp32-add-then-round-once semantics, which is also what ``dst.add_(src.T)`` computes. The test computes the
exact sum in float64; for the test's inputs (magnitudes within 2^10 of each other) the fp32 sum of two
fp16/fp32 values is exact or correctly rounded, so the two agree.

bf16 adds run on the GPU only: the Triton interpreter (3.9) rounds fp32 -> bf16 toward zero instead of to
nearest even, so it cannot reproduce the GPU's (and torch's) bits. bf16 copies are bit moves and run
everywhere.
"""
import pytest
import torch

from kernels.transpose import (ADD_DTYPES, COPY_DTYPES, TUNING_CANDIDATES, transpose_add, transpose_add_ref,
                               transpose_copy, transpose_copy_ref)
from tests.tolerances import assert_all_written, shifted_randn

HAS_CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (too big or bf16 rounding under the interpreter)")

RAW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
DTYPE_IDS = {torch.float8_e5m2: "e5m2", torch.float8_e4m3fn: "e4m3", torch.bfloat16: "bf16", torch.float16: "fp16",
             torch.float32: "fp32"}

# (128, 256) is a multiple of every transpose tile (64x64 for 4-byte, 128x128 for 1- and 2-byte types): the
# kernel's unmasked EVEN path, which the speedrun's 768x50304 takes on the GPU. The others are masked.
SMALL_SHAPES = [(1, 1), (1, 37), (37, 1), (100, 257), (767, 767), (128, 256)]
# For the strided-layout tests: (256, 512) is also a multiple of the "run" tiles (16 x 512 bytes) used when
# both sides are contiguous along the same dimension, for 2- and 4-byte types.
STRIDE_SHAPES = [(100, 257), (256, 512)]
SPEEDRUN_SHAPES = [(768, 50304), (50304, 768)]
# How a (rows, cols) operand is laid out in memory: every kernel launch reads the strides it is given.
LAYOUTS = ["contiguous", "transposed", "strided"]


def raw(t):
    return t.view(RAW[t.element_size()])


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(raw(a), raw(b))


def random_values(shape, dtype, device, gen, scale=1.0):
    """Shifted Gaussian values rounded to dtype (through fp32)."""
    x = shifted_randn(*shape, generator=gen) * scale
    return x.to(dtype).to(device)


def make_operand(values, layout):
    """A tensor equal to ``values`` (2-D) with the requested memory layout.

    transposed: a .T view of a contiguous tensor (the other dimension is the fast one);
    strided:    a [::2, 1::3]-style slice of a larger buffer filled with a sentinel, so neither stride is 1.
    Returns (tensor, base), base being the whole allocation (to check nothing outside was written).
    """
    rows, cols = values.shape
    if layout == "contiguous":
        t = values.clone()
        return t, t
    if layout == "transposed":
        base = values.T.contiguous()
        return base.T, base
    base = torch.empty(2 * rows, 3 * cols + 1, dtype=values.dtype, device=values.device)
    raw(base).fill_(0x55)  # a sentinel bit pattern
    t = base[::2, 1::3]
    assert t.shape == values.shape and not t.is_contiguous()
    t.copy_(values)
    return t, base


def gen():
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------------------------------
# transpose_copy

@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("shape", SMALL_SHAPES + [pytest.param(s, marks=gpu_only) for s in SPEEDRUN_SHAPES],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_copy_matches_torch(dtype, shape, device):
    M, N = shape
    src = random_values((M, N), dtype, device, gen())
    dst = torch.empty(N, M, dtype=dtype, device=device)
    dst.copy_(torch.full((N, M), float("nan")).to(dtype))  # NaN prefill: an unwritten element stays NaN
    out = transpose_copy(src, dst)
    assert out is dst
    assert_all_written(dst)
    assert bits_equal(dst, src.T.contiguous())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("shape", STRIDE_SHAPES + [(33, 65)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_copy_any_strides(dtype, src_layout, dst_layout, shape, device):
    M, N = shape
    g = gen()
    src, _ = make_operand(random_values((M, N), dtype, device, g), src_layout)
    dst, dst_base = make_operand(random_values((N, M), dtype, device, g), dst_layout)
    expected_base = dst_base.clone()
    expected_view = expected_base.as_strided(dst.shape, dst.stride(),
                                             dst.storage_offset() - dst_base.storage_offset())
    transpose_copy_ref(src, expected_view)
    transpose_copy(src, dst)
    assert bits_equal(dst, src.T.contiguous())
    # Nothing outside the dst view was touched (the sentinel between strided elements survives).
    assert bits_equal(dst_base, expected_base)


def test_copy_preserves_every_bit_pattern(device):
    """All 65536 16-bit encodings (NaNs, infinities, negative zero, subnormals), all 256 8-bit ones and fp32 NaN
    payloads are moved unchanged."""
    codes = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).reshape(256, 256).to(device)
    for dtype in (torch.bfloat16, torch.float16):
        src = codes.view(dtype)
        dst = torch.zeros(256, 256, dtype=torch.int16, device=device).view(dtype)
        transpose_copy(src, dst)
        assert bits_equal(dst, src.T.contiguous())
    bytes_ = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).repeat(3, 1).to(device)
    for dtype in (torch.float8_e5m2, torch.float8_e4m3fn):  # all 256 byte codes, each in 3 rows
        src = bytes_.view(dtype)
        dst = torch.zeros(256, 3, dtype=torch.int8, device=device).view(dtype)
        transpose_copy(src, dst)
        assert bits_equal(dst, src.T.contiguous())
    payloads = torch.tensor([0x7FC00001, 0x7F800001, -0x00400001, -0x80000000, 0x00000001, 0x7F7FFFFF],
                            dtype=torch.int32).reshape(2, 3).to(device)
    src = payloads.view(torch.float32)
    dst = torch.zeros(3, 2, device=device)
    transpose_copy(src, dst)
    assert bits_equal(dst, src.T.contiguous())


@pytest.mark.parametrize("config", TUNING_CANDIDATES, ids=lambda c: f"{c[0]}x{c[1]}w{c[2]}")
def test_copy_every_tuning_candidate(config, device):
    M, N = (768, 50304) if HAS_CUDA else (100, 257)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    src = random_values((M, N), dtype, device, gen())
    dst = torch.full((N, M), float("nan"), device=device).to(dtype)
    transpose_copy(src, dst, config=config)
    assert bits_equal(dst, src.T.contiguous())


@gpu_only
def test_copy_beyond_2_31_elements():
    """A 49152 x 50304 bf16 tensor has 2.47e9 elements: offsets must be 64-bit."""
    M, N = 49152, 50304
    free, _ = torch.cuda.mem_get_info()
    if free < 11 * 2 ** 30:
        pytest.skip(f"needs 11 GB of free GPU memory, {free / 2 ** 30:.1f} GB free")
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(-2 ** 15, 2 ** 15, (M, N), dtype=torch.int16, device="cuda", generator=g).view(torch.bfloat16)
    dst = torch.empty(N, M, dtype=torch.int16, device="cuda")
    dst.fill_(0x2AAA)
    dst = dst.view(torch.bfloat16)
    transpose_copy(src, dst)
    # Compare in column blocks of src so the check itself needs only ~200 MB more.
    step = 4096
    for start in range(0, N, step):
        assert torch.equal(raw(dst[start:start + step]), raw(src[:, start:start + step]).T), f"rows {start}.."
    del src, dst
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------
# transpose_add

def add_dtype_params():
    return [pytest.param(d, marks=gpu_only) if d == torch.bfloat16 else d for d in ADD_DTYPES]


def expected_add(src, dst):
    """The specification: the exact sum (float64) rounded once to dst's dtype."""
    exact = dst.to("cpu", torch.float64) + src.T.to("cpu", torch.float64)
    return exact.to(dst.dtype).to(dst.device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=lambda d: DTYPE_IDS[d])
def test_add_ties_round_to_even(dtype, device):
    """Sums that fall exactly halfway between two representable values round to the even one, in the
    reference and in both kernel paths (a 1x1 masked tile and a 64x64 unmasked one)."""
    big = 2.0 ** 11 if dtype == torch.float16 else 2.0 ** 24  # the ulp at big is 2: big + 1 is a tie
    pairs = [(big, 1.0, big), (big + 2, 1.0, big + 4), (-big, -1.0, -big), (big, 0.5, big), (big, 3.0, big + 4)]
    for shape in [(1, 1), (64, 64)]:
        for d, s_, want in pairs:
            src = torch.full(shape, s_, dtype=dtype, device=device)
            dst = torch.full(shape[::-1], d, dtype=dtype, device=device)
            want_t = torch.full(shape[::-1], want, dtype=dtype)
            assert bits_equal(transpose_add_ref(src.cpu(), dst.cpu().clone()), want_t), (d, s_, want)
            assert bits_equal(expected_add(src, dst).cpu(), want_t), (d, s_, want)
            transpose_add(src, dst, config=(64, 64, 4))
            assert bits_equal(dst.cpu(), want_t), (shape, d, s_, want, dst.flatten()[0].item())


@pytest.mark.parametrize("dtype", add_dtype_params(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("shape", SMALL_SHAPES + [pytest.param(s, marks=gpu_only) for s in SPEEDRUN_SHAPES],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_add_matches_fp32_add_then_round(dtype, shape, device):
    M, N = shape
    g = gen()
    # Different scales on the two sides, so the sum needs rounding in nearly every element.
    src = random_values((M, N), dtype, device, g)
    dst = random_values((N, M), dtype, device, g, scale=7.3)
    expected = expected_add(src, dst)
    assert not bits_equal(dst, expected)  # the add changes dst
    assert bits_equal(transpose_add_ref(src.cpu(), dst.cpu().clone()), expected.cpu())
    out = transpose_add(src, dst)
    assert out is dst
    assert bits_equal(dst, expected)


@gpu_only
@pytest.mark.parametrize("dtype", ADD_DTYPES, ids=lambda d: DTYPE_IDS[d])
def test_add_equals_torch_add_(dtype):
    """On the GPU the same bits as PyTorch's own dst.add_(src.T)."""
    src = random_values((768, 50304), dtype, "cuda", gen())
    dst = random_values((50304, 768), dtype, "cuda", gen(), scale=7.3)
    expected = dst.clone().add_(src.T)
    transpose_add(src, dst)
    assert bits_equal(dst, expected)


@pytest.mark.parametrize("dtype", add_dtype_params(), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("shape", STRIDE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_add_any_strides(dtype, src_layout, dst_layout, shape, device):
    M, N = shape
    g = gen()
    src, _ = make_operand(random_values((M, N), dtype, device, g), src_layout)
    dst, dst_base = make_operand(random_values((N, M), dtype, device, g, scale=7.3), dst_layout)
    expected = expected_add(src, dst)
    expected_base = dst_base.clone()
    transpose_add(src, dst)
    assert bits_equal(dst, expected)
    # Restore the view's expected values into a copy of the base: everything else must be untouched.
    expected_base.as_strided(dst.shape, dst.stride(), dst.storage_offset() - dst_base.storage_offset()).copy_(expected)
    assert bits_equal(dst_base, expected_base)


@pytest.mark.parametrize("config", TUNING_CANDIDATES, ids=lambda c: f"{c[0]}x{c[1]}w{c[2]}")
def test_add_every_tuning_candidate(config, device):
    M, N = (768, 50304) if HAS_CUDA else (100, 257)
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    src = random_values((M, N), dtype, device, gen())
    dst = random_values((N, M), dtype, device, gen(), scale=7.3)
    expected = expected_add(src, dst)
    transpose_add(src, dst, config=config)
    assert bits_equal(dst, expected)


def test_empty_is_a_no_op(device):
    src = torch.empty(0, 5, device=device)
    dst = torch.empty(5, 0, device=device)
    assert transpose_copy(src, dst) is dst
    assert transpose_add(src, dst) is dst


# ----------------------------------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("fn", [transpose_copy, transpose_add], ids=["copy", "add"])
def test_errors(fn, device):
    f32 = dict(device=device, dtype=torch.float32)
    with pytest.raises(ValueError, match="must be 2-D"):
        fn(torch.zeros(2, 3, 4, **f32), torch.zeros(4, 3, 2, **f32))
    with pytest.raises(ValueError, match=r"shape mismatch: src \(3, 5\), dst \(3, 5\).*must have src.T's shape"):
        fn(torch.zeros(3, 5, **f32), torch.zeros(3, 5, **f32))
    with pytest.raises(TypeError, match="dtype mismatch"):
        fn(torch.zeros(3, 5, **f32), torch.zeros(5, 3, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="unsupported dtype"):
        fn(torch.zeros(3, 5, device=device, dtype=torch.int32), torch.zeros(5, 3, device=device, dtype=torch.int32))
    base = torch.zeros(20, 10, **f32)
    with pytest.raises(ValueError, match="in-place transpose is not supported"):
        fn(base[:10], base[:10])
    with pytest.raises(ValueError, match="overlap"):
        fn(base[:5], base[3:13, :5])
    with pytest.raises(ValueError, match="zero stride"):
        fn(torch.zeros(3, 5, **f32), torch.zeros(1, 3, **f32).expand(5, 3))


def test_separate_slices_of_one_buffer_are_allowed(device):
    base = random_values((20, 10), torch.float32, device, gen())
    src, dst = base[:5], base[10:20, :5]
    expected = src.T.clone()
    transpose_copy(src, dst)
    assert bits_equal(dst, expected)


def test_fp8_add_and_other_byte_types_are_rejected(device):
    """transpose_copy moves float8 bytes; adding them has no meaning here, and other 1-byte types are refused."""
    src = torch.zeros(3, 5, device=device).to(torch.float8_e4m3fn)
    dst = torch.zeros(5, 3, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="unsupported dtype"):
        transpose_add(src, dst)
    with pytest.raises(TypeError, match="unsupported dtype"):
        transpose_copy(torch.zeros(3, 5, dtype=torch.uint8, device=device),
                       torch.zeros(5, 3, dtype=torch.uint8, device=device))


@gpu_only
def test_different_devices():
    with pytest.raises(ValueError, match="one device"):
        transpose_copy(torch.zeros(3, 5, device="cuda"), torch.zeros(5, 3))


def test_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        transpose_copy(torch.zeros(3, 5), torch.zeros(5, 3))
