"""kernels.accumulate: acc += fp32(grad) against a float64 specification, bit for bit.

Spec: the float64 sum of the two values rounded once to fp32. For values within 2^29 of each other's magnitude
(all the tests draw) the float64 sum is exact, so its rounding to fp32 is the correctly rounded fp32 sum, the one
rounding the kernel's fp32 addition makes: kernel and spec agree bit for bit, NaN and inf included.
"""
import pytest
import torch

from tolerances import assert_close_report

from kernels.accumulate import DEFAULT_CONFIG, TUNING_CANDIDATES, accumulate_, accumulate_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def spec(acc, grad):
    """The float64 sum rounded to fp32 (module docstring)."""
    return (acc.double() + grad.double()).float()


def shifted(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (-2.3 + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)) * scale


def assert_bits(got, want, name):
    """Equal values, NaN where NaN (reported by the verbose helper when they differ)."""
    same = torch.equal(got.view(torch.int32), want.view(torch.int32)) or (
        torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()))
    if not same:
        assert_close_report(got.double(), want.double(), atol=0, name=name)
        raise AssertionError(f"{name}: differs from the spec")


# The speedrun's gradient shapes, scaled down for the interpreter, and odd ones: (5, 123, 123) is no multiple of
# any block, 1151 rows, a single element, a 0-d tensor.
SHAPES = [(768, 96), (4, 64, 64), (5, 123, 123), (1151,), (1,), ()]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_accumulate_matches_the_spec(shape, dtype, device):
    acc = shifted(shape, 1, 3.0).float().to(device)
    grad = shifted(shape, 2).to(dtype).to(device)
    want = spec(acc.cpu(), grad.cpu())
    out = accumulate_(acc, grad)
    assert out is acc
    assert_bits(acc.cpu(), want, f"accumulate {shape} {dtype}")
    ref = accumulate_ref(shifted(shape, 1, 3.0).float().to(device), grad)
    assert_bits(ref.cpu(), want, f"accumulate_ref {shape} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_accumulate_into_views_leaves_the_rest_untouched(dtype, device):
    """acc as the first rows of a padded buffer (the optimizer's acc[:rows]) and as a column slice (row stride
    above its width), grad contiguous and as a column slice of a wider buffer: the view gets the spec's sums, and
    every element of the buffers outside it keeps its NaN."""
    rows, pad, N = 37, 3, 45
    buf = torch.full((rows + pad, N + 6), float("nan"), device=device)
    gbuf = torch.full((rows, N + 5), float("nan"), dtype=dtype, device=device)
    gbuf[:, 2:N + 2] = shifted((rows, N), 4).to(dtype).to(device)
    for acc_view, grad in ((lambda b: b[:rows, :N], gbuf[:, 2:N + 2]),
                           (lambda b: b[:rows, 3:N + 3], gbuf[:, 2:N + 2].contiguous()),
                           (lambda b: b.view(-1)[:rows * N].view(rows, N), gbuf[:, 2:N + 2])):
        buf.fill_(float("nan"))
        acc = acc_view(buf)
        acc.copy_(shifted((rows, N), 3, 2.0).float())
        before = buf.clone()
        want = spec(acc.cpu(), grad.cpu())
        accumulate_(acc, grad)
        assert_bits(acc.cpu(), want, f"accumulate into a view, {dtype}")
        outside = torch.ones_like(buf, dtype=torch.bool)
        acc_view(outside).fill_(False)
        assert_bits(buf[outside].cpu(), before[outside].cpu(), "elements outside acc's view")
        assert gbuf[:, :2].isnan().all() and gbuf[:, N + 2:].isnan().all(), "grad's buffer was written"


def test_accumulate_propagates_nan_and_inf(device):
    """NaN and +-inf in either operand: the fp32 addition's results (inf + -inf is NaN), as the spec gives them."""
    acc = torch.tensor([1.0, float("nan"), float("inf"), 2.0, float("-inf"), 3.0, 0.0], device=device)
    grad = torch.tensor([float("nan"), 1.0, float("-inf"), float("inf"), 1.0, -3.0, -0.0],
                        dtype=torch.bfloat16, device=device)
    want = spec(acc.cpu(), grad.cpu())
    accumulate_(acc, grad)
    assert_bits(acc.cpu(), want, "nan/inf")
    assert acc[1].isnan() and acc[2].isnan() and acc[3] == float("inf") and acc[4] == float("-inf")


@pytest.mark.parametrize("config", TUNING_CANDIDATES + [(16, 1)], ids=str)
def test_every_launch_configuration_gives_the_spec(config, device):
    """Each tuning candidate (and a tiny block: many programs, a masked tail) writes the same bits."""
    shape = (3, 1001)
    acc = shifted(shape, 5, 4.0).float().to(device)
    grad = shifted(shape, 6).to(torch.bfloat16).to(device)
    want = spec(acc.cpu(), grad.cpu())
    accumulate_(acc, grad, config=config)
    assert_bits(acc.cpu(), want, f"config {config}")
    assert DEFAULT_CONFIG in TUNING_CANDIDATES


def test_accumulate_refuses_bad_arguments(device):
    acc = torch.zeros(4, 6, device=device)
    grad = torch.zeros(4, 6, dtype=torch.bfloat16, device=device)
    cases = [
        (acc.bfloat16(), grad, "acc must be float32"),
        (acc, grad.to(torch.int32), "grad must be one of"),
        (acc, grad[:3], "differ in shape"),
        (acc, torch.zeros(6, 4, dtype=torch.bfloat16, device=device).T, "last dim must have stride 1"),
        (torch.zeros(8, 4, 6, device=device).transpose(0, 1), torch.zeros(4, 8, 6, dtype=torch.bfloat16,
                                                                            device=device), "leading dims"),
        (acc, acc, "must not overlap"),
    ]
    for a, g, message in cases:
        with pytest.raises(ValueError, match=message):
            accumulate_(a, g)
