"""``feature_map="none"``: the window-only baseline (exact window + sinks, every other key dropped).

Twins: a masked softmax over exactly the allowed keys (causal and bidirectional, padding, GQA),
cached decoding against one full forward, and the constant-memory state.
"""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention
from conftest import rel
from tiny_models import tiny_model
from tolerances import DECODE_LOGITS, ORACLE_FP32


def _masked_softmax(q, k, v, mask, window, sinks, causal):
    """Softmax over keys in the window (causal: the last W incl. itself; bidirectional: |i-j| < W)
    or among the first S real tokens; padded keys never. ``[B,H,N,D]`` with GQA repeat."""
    b, h, n, d = q.shape
    g = h // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    rank = mask.long().cumsum(-1) - 1  # rank of each real token
    sink = mask & (rank < sinks)  # [B,N]
    near = (j <= i) & (j > i - window) if causal else (i - j).abs() < window
    allowed = (near[None] | (sink[:, None, :] & ((j <= i) if causal else torch.ones_like(near))[None])) & mask[:, None, :]
    s = (q @ kk.transpose(-1, -2)) * d**-0.5
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.softmax(s, -1).nan_to_num(0.0) @ vv
    return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("window,sinks", [(5, 0), (5, 3), (0, 2), (1, 1), (100, 0)], ids=["W5", "W5-S3", "S2", "W1-S1", "W>=N"])
def test_none_equals_masked_softmax(causal, window, sinks):
    b, h, hkv, n, d = 2, 4, 2, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, x, n, d, generator=g) for x in (h, hkv, hkv))
    mask = torch.ones(b, n, dtype=torch.bool)
    if causal:
        mask[1, :6] = False  # left padding
    else:
        mask[1, -6:] = False  # right padding
    fm = hf_rfa.build_feature_map("none", head_dim=d, num_features=1)
    out = hf_rfa.random_feature_attention(q, k, v, fm, causal=causal, attention_mask=mask, window=window, sinks=sinks, chunk_size=8)
    ref = _masked_softmax(q, k, v, mask, window, sinks, causal)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    # the far keys really are dropped: a favor+ hybrid with the same window differs
    if window < n:
        fav = hf_rfa.build_feature_map("favor+", head_dim=d, num_features=64, seed=0)
        other = hf_rfa.random_feature_attention(q, k, v, fav, causal=causal, attention_mask=mask, window=window, sinks=sinks, chunk_size=8)
        assert rel(other[real], ref[real]) > 10 * ORACLE_FP32


def test_none_needs_a_window_or_sinks():
    with pytest.raises(ValueError, match="window"):
        hf_rfa.RFAConfig(feature_map="none")
    fm = hf_rfa.build_feature_map("none", head_dim=8, num_features=1)
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="window"):
        hf_rfa.random_feature_attention(x, x, x, fm)
    assert "none" in hf_rfa.available_feature_maps()


@pytest.mark.parametrize("splits", [[37], [10], [3, 9], [1]], ids=["one-shot", "prefill10", "3+9", "token-by-token"])
def test_none_decode_matches_full_sequence_and_keeps_no_state(splits):
    b, h, hkv, n, d, window, sinks = 2, 4, 2, 37, 16, 5, 2
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, x, n, d, generator=g) for x in (h, hkv, hkv))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :5] = False
    fm = hf_rfa.build_feature_map("none", head_dim=d, num_features=1)
    ref = _masked_softmax(q, k, v, mask, window, sinks, True)
    state = DecodeState.empty((b, hkv, d, d, fm.feature_dim), sinks, torch.float32)
    outs, i, sizes = [], 0, []
    for s in splits + [1] * (n - sum(splits)):
        o, state = continue_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, mask[:, i:i + s], DecodeCall(window=window, sinks=sinks, chunk_size=8))
        outs.append(o)
        sizes.append(state.nbytes())
        i += s
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(torch.cat(outs, 2)[real], ref[real]) <= ORACLE_FP32
    assert state.linear.S.numel() == 0  # no feature state at all
    assert len(set(sizes[-10:])) == 1  # constant memory once the window is full


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_none_model_cached_decoding_matches_full_forward(family):
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(feature_map="none", window=4, sinks=2))
    ids = torch.randint(2, 100, (2, 14), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        outs, t = [], 0
        for step in (5, 4, 1, 1, 1, 1, 1):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            t += step
    assert (torch.cat(outs, 1) - full)[mask.bool()].abs().max().item() <= DECODE_LOGITS


def test_none_with_window_covering_everything_is_softmax():
    ref_model = tiny_model("llama")
    ids = torch.randint(2, 100, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = ref_model(ids).logits
        model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="none", window=64))
        out = model(ids).logits
    assert rel(out, ref) <= 1e-5


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_none_quadratic_twin_equals_op_with_gradients(causal):
    """The quadratic twin (the training path of attention transfer / LoRA) agrees with the op,
    values and gradients."""
    b, h, hkv, n, d = 2, 4, 2, 23, 8
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(b, x, n, d, generator=g, dtype=torch.float64, requires_grad=True) for x in (h, hkv, hkv))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :3] = False
    fm = hf_rfa.build_feature_map("none", head_dim=d, num_features=1)
    a = hf_rfa.random_feature_attention(q, k, v, fm, causal=causal, attention_mask=mask, window=4, sinks=2, chunk_size=8)
    r = hf_rfa.quadratic_kernel_attention(q, k, v, fm, causal=causal, attention_mask=mask, window=4, sinks=2)
    real = mask[:, None, :, None].expand_as(a)
    assert rel(a[real], r[real]) <= 1e-10
    up = torch.randn(a.shape, generator=g, dtype=torch.float64) * real
    ga = torch.autograd.grad((a * up).sum(), (q, k, v))
    gr = torch.autograd.grad((r * up).sum(), (q, k, v))
    assert all(rel(x, y) <= 1e-10 for x, y in zip(ga, gr))
