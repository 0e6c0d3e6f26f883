"""Regression tests of the ops: bidirectional sinks beyond Nq, float masks, Nk = 0 in the twin,
redraw and feature_map_options validation."""

from __future__ import annotations

import pytest
import torch

import hf_rfa
from hf_rfa.ops.masks import dense
from tiny_models import tiny_model


def _fm():
    return hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0)


@pytest.mark.parametrize("sinks", [1, 2, 3, 4, 5, 6, 9])
@pytest.mark.parametrize("padded", [False, True])
def test_bidirectional_sinks_beyond_nq_match_the_twin_and_softmax(sinks, padded):
    g = torch.Generator().manual_seed(sinks)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for n in (2, 6, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    if padded:
        mask[1, 4:] = False
    fm = _fm().double()
    out = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, causal=False, sinks=sinks)
    twin = hf_rfa.quadratic_kernel_attention(q, k, v, fm, attention_mask=mask, causal=False, sinks=sinks)
    assert torch.allclose(out, twin, atol=1e-10, rtol=0)
    if sinks >= 6:  # every key is a sink: exact softmax
        ref = hf_rfa.softmax_attention(q, k, v, attention_mask=mask, causal=False)
        assert torch.allclose(out, ref, atol=1e-10, rtol=0)


def test_additive_float_mask_is_refused_and_float_01_accepted():
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    additive = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")]])
    for op in (hf_rfa.random_feature_attention, hf_rfa.quadratic_kernel_attention):
        with pytest.raises(ValueError, match="additive 0/-inf"):
            op(q, k, v, _fm(), attention_mask=additive, causal=False)
    ones = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    a = hf_rfa.random_feature_attention(q, k, v, _fm(), attention_mask=ones, causal=False)
    b = hf_rfa.random_feature_attention(q, k, v, _fm(), attention_mask=ones.bool(), causal=False)
    assert torch.equal(a, b)


def test_twin_with_no_keys_gives_zeros_like_the_op():
    q, k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 0, 8), torch.randn(1, 1, 0, 8)
    out = hf_rfa.random_feature_attention(q, k, v, _fm(), causal=False)
    twin = hf_rfa.quadratic_kernel_attention(q, k, v, _fm(), causal=False)
    assert torch.equal(out, twin) and not twin.any()


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, None])
def test_redraw_step_must_be_a_non_negative_int(step):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8))
    with pytest.raises(ValueError, match="redraw step must be an int"):
        hf_rfa.redraw(model, step)
    assert hf_rfa.redraw(model, 3) == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_feature_map_options_are_refused(value):
    with pytest.raises(ValueError, match="finite"):
        hf_rfa.RFAConfig(feature_map="hedgehog", feature_map_options={"init_sigma": value})


def _rope(n, d, seed=0):
    ang = torch.rand(1, n, d // 2, generator=torch.Generator().manual_seed(seed)) * 6
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


@pytest.mark.parametrize("name", ["rff", "favor+"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_huge_finite_key_gives_finite_outputs_and_spares_earlier_rows(name, causal):
    fm = hf_rfa.build_feature_map(name, head_dim=8, num_features=8, seed=0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    for big in (3e19, 1e30):
        k2 = k.clone()
        k2[0, 0, 5, 0] = big
        out = hf_rfa.random_feature_attention(q, k2, v, fm, causal=causal)
        assert torch.isfinite(out).all()
        if causal:
            assert torch.equal(out[..., :5, :], hf_rfa.random_feature_attention(q, k, v, fm, causal=True)[..., :5, :])


def test_fp16_unrotation_of_a_large_finite_key_stays_finite():
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8, seed=0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g).half() for _ in range(3))
    k[0, 0, 5] = 6e4
    cos, sin = _rope(10, 8)
    out = hf_rfa.random_feature_attention(q, k, v, fm, causal=False, feature_rope=(cos.half(), sin.half()))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bad", ["zeros", "nan"])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_cos_sin_are_checked(bad, causal):
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8, seed=0)
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    cos, sin = _rope(10, 8)
    cos = torch.zeros_like(cos) if bad == "zeros" else cos.clone().index_fill_(1, torch.tensor([3]), float("nan"))
    sin = torch.zeros_like(sin) if bad == "zeros" else sin
    with pytest.raises(ValueError, match="cos/sin must be finite"):
        hf_rfa.random_feature_attention(q, k, v, fm, causal=causal, feature_rope=(cos, sin))


def test_fp16_rfa_gradients_saturate_instead_of_overflowing():
    """Where the normaliser floor is hit the true gradient leaves float16's range (float32 shows
    > 65504): it saturates at ±65504 (it was inf). In this regime the float16 gradient is noise
    around the floor, so only finiteness is asserted."""
    saturated = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        fm = hf_rfa.build_feature_map("rfa", head_dim=8, num_features=1, seed=seed)
        base = [torch.randn(1, 2, 32, 8, generator=g) * 3 for _ in range(3)]
        half = [t.half().requires_grad_() for t in base]
        hf_rfa.random_feature_attention(*half, fm, causal=True).float().sum().backward()
        for h in half:
            assert torch.isfinite(h.grad).all()
            saturated += int((h.grad.float().abs() == 65504).sum())
    assert saturated > 0  # the case really occurs


# ---- layouts with a size-1 dimension (one kv head, one sequence, one new token) ----------------------
_POSITIVE_AND_TRIG = ["favor+", "positive", "favor++", "rff", "rfa"]


def _one_head_layouts(name: str, seed: int, m: int):
    """q, k, v of one kv head in transformers' layout (``[B, N, heads, D]`` transposed: a size-1
    head dimension whose stride is not a fresh tensor's) and a copy of each with fresh strides."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 9, heads, 8, generator=g) for heads in (2, 1, 1))
    views = tuple(t.transpose(1, 2) for t in (q, k, v))
    fresh = tuple(t.clone(memory_format=torch.contiguous_format) for t in views)
    assert views[1].is_contiguous() and views[1].stride() != fresh[1].stride()  # the case under test
    return hf_rfa.build_feature_map(name, head_dim=8, num_features=m, seed=seed), views, fresh


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("name", _POSITIVE_AND_TRIG)
def test_the_result_does_not_depend_on_the_stride_of_a_size_one_dimension(name, native):
    """The same values in two layouts give the same bits (the matmul kernels choose their blocking
    from the strides, so a stride of a size-1 dimension used to change the last bits)."""
    before = hf_rfa.ops.backends.native.native_enabled()
    hf_rfa.ops.set_native(native)
    try:
        for seed in range(4):
            for m in (1, 4):
                fm, views, fresh = _one_head_layouts(name, seed, m)
                for kw in (dict(causal=True), dict(causal=True, window=3), dict(causal=False)):
                    with torch.no_grad():
                        assert torch.equal(hf_rfa.random_feature_attention(*views, fm, **kw), hf_rfa.random_feature_attention(*fresh, fm, **kw)), (seed, m, kw)
    finally:
        hf_rfa.ops.set_native(before)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("name", _POSITIVE_AND_TRIG)
def test_earlier_rows_bit_identical_when_later_keys_turn_non_finite_in_transformers_layout(name, native):
    """A non-finite later key used to send the call through a fresh copy (other strides, other
    summation order) while the finite call kept the transposed view: earlier rows then differed
    in their last bits."""
    before = hf_rfa.ops.backends.native.native_enabled()
    hf_rfa.ops.set_native(native)
    try:
        for seed in range(4):
            for m in (1, 4):
                fm, (q, k, v), _ = _one_head_layouts(name, seed, m)
                kb = k.transpose(1, 2).clone()  # [B, N, 1, D], in the same layout as k
                kb[:, 6:] = float("nan")
                with torch.no_grad():
                    out = hf_rfa.random_feature_attention(q, k, v, fm, causal=True)
                    bad = hf_rfa.random_feature_attention(q, kb.transpose(1, 2), v, fm, causal=True)
                assert torch.equal(out[..., :6, :], bad[..., :6, :]), (seed, m)
                assert torch.isnan(bad[..., 6:, :]).all()
    finally:
        hf_rfa.ops.set_native(before)


def test_dense_gives_the_canonical_strides_without_a_copy_when_contiguous():
    x = torch.randn(2, 5, 1, 8).transpose(1, 2)  # contiguous, but dimension 1 has stride 8
    y = dense(x)
    assert y.stride() == torch.empty(2, 1, 5, 8).stride() and y.data_ptr() == x.data_ptr() and torch.equal(x, y)
    z = dense(torch.randn(2, 5, 3, 8).transpose(1, 2))  # not contiguous: a copy
    assert z.stride() == torch.empty(2, 3, 5, 8).stride()


@pytest.mark.parametrize("name", _POSITIVE_AND_TRIG)
def test_decoding_other_batch_rows_bit_identical_when_one_turns_non_finite_in_transformers_layout(name):
    """continue_attention: a non-finite key of batch row 1 leaves batch row 0 bit-identical, in
    transformers' layout too (the finite steps used to read the transposed views, the others a
    fresh copy: another summation order)."""
    from hf_rfa.ops.decode import DecodeState, continue_attention
    from hf_rfa.ops.decode.continuation import DecodeCall

    for seed in range(2):
        for m in (1, 4):
            for window, sinks in ((0, 0), (2, 1)):
                fm = hf_rfa.build_feature_map(name, head_dim=8, num_features=m, seed=seed)
                rows = []
                for poisoned in (False, True):
                    state, g, got = DecodeState.empty((2, 1, 8, 8, fm.feature_dim), sinks, torch.float32), torch.Generator().manual_seed(seed), []
                    for n in (5, 1, 1, 3):
                        q, k, v = (torch.randn(2, n, heads, 8, generator=g) for heads in (2, 1, 1))
                        if poisoned and n == 1:
                            k[1] = float("nan")
                        with torch.no_grad():
                            out, state = continue_attention(state, *(t.transpose(1, 2) for t in (q, k, v)), fm, None, DecodeCall(window=window, sinks=sinks))
                        got.append(out)
                    rows.append(got)
                assert all(torch.equal(a[0], b[0]) for a, b in zip(*rows)), (seed, m, window)
                assert all(torch.isnan(b[1]).all() for b in rows[1][1:])
