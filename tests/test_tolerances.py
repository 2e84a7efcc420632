"""The tolerance helpers must reject what they are meant to reject (a check that cannot fail is no check)."""
import pytest
import torch

from tolerances import (E5M2_FP32_ULPS, assert_all_written, assert_close_report, assert_elementwise, assert_fp8_gemm,
                        assert_matches_torch, assert_rounded_e5m2, assert_sum_in_any_order,
                        assert_two_sums_in_any_order, fp8_gemm_accumulation_error, gamma, max_abs_err, nan_like,
                        shifted_randn, ulp_e5m2)


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


def test_ulp_e5m2():
    a = torch.tensor([0.0, 2.0 ** -16, 2.0 ** -14, 1.0, 1.75, 2.0, 57344.0, 61440.0], dtype=torch.float64)
    want = [2.0 ** -16, 2.0 ** -16, 2.0 ** -16, 0.25, 0.25, 0.5, 8192.0, 8192.0]
    assert ulp_e5m2(a).tolist() == want


def test_rule3_accepts_rne_and_rejects_truncation():
    """torch's conversion (round to nearest even) of values clamped to e5m2's range (saturation) passes over its
    whole range; truncating the same fp32 values (error up to one ulp) fails."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 5, (4096,), generator=g)
    assert_rounded_e5m2(ref.float().clamp(-57344, 57344).to(torch.float8_e5m2), ref, ref.abs())
    normal = ref[ref.abs() >= 2.0 ** -14].float()
    truncated = ((normal.view(torch.int32) >> 21) << 21).view(torch.float32)   # exact in e5m2
    with pytest.raises(AssertionError, match="not the saturated e5m2 rounding of a value"):
        assert_rounded_e5m2(truncated.to(torch.float8_e5m2), normal.double(), normal.double().abs())


def test_rule3_fp32_allowance_and_saturation():
    """A value just below a midpoint may round either way when the fp32 allowance reaches across it (not when
    the terms are zero); 61440 and above must saturate to 57344 of the right sign, inf (torch's conversion) fails;
    NaN only where the reference is NaN."""
    below_mid = torch.tensor([1.125 - 2.0 ** -18], dtype=torch.float64)            # RNE: 1.0
    up = torch.tensor([1.25]).to(torch.float8_e5m2)                                  # the other neighbour
    assert 2.0 ** -18 < E5M2_FP32_ULPS * 2.0 ** -24 * 1.125
    assert_rounded_e5m2(up, below_mid, below_mid.abs())
    with pytest.raises(AssertionError, match="not the saturated e5m2 rounding"):
        assert_rounded_e5m2(up, below_mid, torch.zeros_like(below_mid))
    ref = torch.tensor([57344.0, 61000.0, 61440.0, -70000.0, 1e9, float("inf")], dtype=torch.float64)
    saturated = ref.clamp(-57344, 57344).float().to(torch.float8_e5m2)
    assert saturated.float().tolist() == [57344.0, 57344.0, 57344.0, -57344.0, 57344.0, 57344.0]
    assert_rounded_e5m2(saturated, ref, ref.abs())
    rne = ref.float().to(torch.float8_e5m2)                                            # inf from 61440 on
    assert rne.float().tolist() == [57344.0, 57344.0, float("inf"), -float("inf"), float("inf"), float("inf")]
    with pytest.raises(AssertionError, match="not the saturated e5m2 rounding"):
        assert_rounded_e5m2(rne, ref, ref.abs())
    with pytest.raises(AssertionError, match="not the saturated e5m2 rounding"):
        assert_rounded_e5m2((-saturated[2:].float()).to(torch.float8_e5m2), ref[2:], ref[2:].abs())  # wrong sign
    with pytest.raises(AssertionError, match="not the saturated e5m2 rounding"):      # 49152: not saturated
        assert_rounded_e5m2(torch.tensor([49152.0]).to(torch.float8_e5m2), ref[4:5], ref[4:5].abs())
    nan_ref = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    assert_rounded_e5m2(torch.tensor([1.0, float("nan")]).to(torch.float8_e5m2), nan_ref, torch.ones(2))
    with pytest.raises(AssertionError, match="NaN mismatch"):
        assert_rounded_e5m2(torch.tensor([float("nan"), 2.0]).to(torch.float8_e5m2), nan_ref, torch.ones(2))


def test_rule4_accepts_any_summation_order_and_rejects_a_lost_term():
    """16 fp32 terms that nearly cancel (the gradient rows of 8 micro-steps and their transposed embedding): the
    sums in order, reversed and as a pairwise tree (a ring all-reduce) all pass; a sum missing one term or
    counting one twice fails, as does a value where every term is zero (a padding row)."""
    g = torch.Generator().manual_seed(0)
    base = shifted_randn(16, 300, generator=g, mean=0.0, std=1.0)
    terms = [t for t in base - base.mean(0)]  # the sum nearly cancels: judged at the terms' scale

    def fold(ts):
        acc = torch.zeros_like(ts[0])
        for t in ts:
            acc = acc + t
        return acc

    def tree(ts):
        return ts[0] if len(ts) == 1 else tree(ts[:len(ts) // 2]) + tree(ts[len(ts) // 2:])

    for order in (fold(terms), fold(terms[::-1]), tree(terms), tree(terms[5:] + terms[:5])):
        assert_sum_in_any_order(order, terms)
    assert_two_sums_in_any_order(fold(terms), tree(terms), 16, torch.stack(terms).abs().sum(0))
    with pytest.raises(AssertionError, match="by more than gamma_15"):
        assert_sum_in_any_order(fold(terms[:-1]), terms)
    with pytest.raises(AssertionError, match="by more than gamma_15"):
        assert_sum_in_any_order(fold(terms + terms[3:4]), terms)
    padded = [torch.cat([t, torch.zeros(2)]) for t in terms]
    off = torch.cat([fold(terms), torch.tensor([0.0, 1e-30])])
    with pytest.raises(AssertionError, match=r"1 of 302 elements .* worst at \[301\]"):
        assert_sum_in_any_order(off, padded)
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_two_sums_in_any_order(1.0, 1.0 + 16 * gamma(7), 8, 1.0)


def test_rule5_fp8_gemm_accepts_one_rounding_and_truncated_accumulation_rejects_a_scale():
    """An FP8 product (e5m2 @ e4m3^T, K = 208) rounded once to bf16 passes with either accumulation; a value
    truncated to 14 significant bits every 32 products (a tensor-core accumulator) passes the tensor-core bound;
    the same product scaled by 1 + 2^-5 (a wrong scale) fails both."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(48, 208, generator=g).to(torch.float8_e5m2).double()
    b = (torch.randn(32, 208, generator=g) * 4).to(torch.float8_e4m3fn).double()
    ref, terms = a @ b.T, a.abs() @ b.abs().T
    for acc in ("fp32", "tensor_core"):
        assert_fp8_gemm(ref.to(torch.bfloat16), ref, terms, 208, acc)
        with pytest.raises(AssertionError, match=f"{acc} accumulation error over K = 208"):
            assert_fp8_gemm((ref * (1 + 2.0 ** -5)).to(torch.bfloat16), ref, terms, 208, acc)

    def trunc14(v):  # toward zero, 13 fraction bits
        m, e = torch.frexp(v)
        return torch.ldexp(torch.trunc(torch.ldexp(m, torch.full_like(e, 14))), e - 14)

    acc = torch.zeros_like(ref)
    for k in range(0, 208, 32):
        acc = trunc14(acc + a[:, k:k + 32] @ b[:, k:k + 32].T)
    assert (acc - ref).abs().max() > 208 * 2.0 ** -24 * terms.max()  # more than fp32 accumulation would allow
    assert_fp8_gemm(acc.to(torch.bfloat16), ref, terms, 208, "tensor_core")
    assert fp8_gemm_accumulation_error(208, "tensor_core") == 7 * 2.0 ** -11 + 208 * 2.0 ** -24
