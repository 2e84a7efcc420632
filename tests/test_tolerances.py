"""The tolerance helpers must reject what they are meant to reject (a check that cannot fail is no check)."""
import pytest
import torch

from tolerances import (assert_all_written, assert_close_report, assert_elementwise, assert_matches_torch,
                        max_abs_err, nan_like, shifted_randn)


def test_rule1_accepts_torch_level_error_and_rejects_a_bug():
    g = torch.Generator().manual_seed(0)
    a = shifted_randn(64, 96, generator=g).to(torch.bfloat16)
    ref = a.double() @ a.double().T
    lowp = a @ a.T
    assert_matches_torch(lowp, ref, lowp)  # torch's own result passes its own bound
    wrong = lowp.clone()
    wrong[3, 5] += 0.25 * ref.abs().max().to(wrong.dtype)  # one wrong element, a quarter of the scale
    with pytest.raises(AssertionError, match=r"(?s)exceeds bound.*max abs err .* at \[3, 5\]"):
        assert_matches_torch(wrong, ref, lowp)


def test_rule2_ulps():
    ref = torch.linspace(-3, 3, 101, dtype=torch.float64)
    assert_elementwise(ref.to(torch.bfloat16), ref)  # one rounding is within 2 ulps
    off = ref.to(torch.bfloat16) * (1 + 2.0 ** -5)
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_elementwise(off, ref)


def test_nan_and_shape_mismatches_are_reported():
    ref = torch.zeros(4, dtype=torch.float64)
    out = torch.zeros(4)
    out[2] = float("nan")
    assert max_abs_err(out, ref) == float("inf")
    with pytest.raises(AssertionError, match="NaN mismatch"):
        assert_close_report(out, ref, atol=1.0)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close_report(torch.zeros(3), ref, atol=1.0)


def test_poison_prefill_detects_unwritten_elements():
    out = nan_like(torch.empty(3, 5))
    out[:, :4] = 1.0
    with pytest.raises(AssertionError, match=r"3 of 15 elements still NaN.*first at \[0, 4\]"):
        assert_all_written(out)
    out[:, 4] = 0.0
    assert_all_written(out)


def test_rule1_scale_sets_the_floor():
    """The floor is one unit roundoff of ``scale``: an error that only a magnitude-scaled floor allows."""
    ref = torch.tensor([1.0, -1.0], dtype=torch.float64)  # small result of a cancelling sum
    exact = ref.float()  # torch "happens to be exact": the floor is all that is left
    off = exact + torch.tensor([3e-6, 0.0])  # ~50 ulps of |ref|, < 1 ulp of a magnitude of 100
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_matches_torch(off, ref, exact)
    assert_matches_torch(off, ref, exact, scale=100.0)


def test_rule1_torch_overflow_does_not_accept_anything():
    """torch overflowing to inf must not make the bound infinite: the kernel must overflow the same way
    (or give the same NaN), and the finite elements are still held to the bound."""
    ref = torch.tensor([1.0, 2.0, 7e4, -3.0], dtype=torch.float64)
    lowp = ref.half()  # 7e4 > fp16 max 65504: torch's result is inf there
    assert torch.isinf(lowp[2])
    assert_matches_torch(lowp.clone(), ref, lowp)  # same pattern, finite part exact
    nan_out = lowp.clone()
    nan_out[2] = float("nan")
    with pytest.raises(AssertionError, match="inf/NaN patterns differ"):
        assert_matches_torch(nan_out, ref, lowp)
    finite_out = lowp.clone()
    finite_out[2] = 6e4
    with pytest.raises(AssertionError, match="inf/NaN patterns differ"):
        assert_matches_torch(finite_out, ref, lowp)
    wrong_sign = lowp.clone()
    wrong_sign[2] = -float("inf")
    with pytest.raises(AssertionError, match="inf/NaN patterns differ"):
        assert_matches_torch(wrong_sign, ref, lowp)
    nan_elsewhere = lowp.clone()
    nan_elsewhere[0] = float("nan")
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_matches_torch(nan_elsewhere, ref, lowp)
    off_elsewhere = lowp.clone()
    off_elsewhere[3] = -2.0
    with pytest.raises(AssertionError, match="exceeds bound"):
        assert_matches_torch(off_elsewhere, ref, lowp)


def test_rule1_torch_nan_must_be_matched():
    ref = torch.tensor([1.0, 2.0], dtype=torch.float64)
    lowp = torch.tensor([1.0, float("nan")])
    assert_matches_torch(torch.tensor([1.0, float("nan")]), ref, lowp)
    with pytest.raises(AssertionError, match="inf/NaN patterns differ"):
        assert_matches_torch(torch.tensor([1.0, 2.0]), ref, lowp)
