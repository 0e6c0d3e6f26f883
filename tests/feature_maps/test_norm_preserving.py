"""Hedgehog with ``norm_preserving=True`` (after STILL's norm-preserved feature map): each feature
vector has the 2-norm of its (scaled) input, its direction the softmax features'.

Oracle chain: a formula written here (softmax of ``[xW, −xW]`` per head, times ‖x‖ / its norm) =
the map's bounded form (unit ``phi``, ``log_scale = log ‖x‖``) = ``norm_preserved_reference``;
the op's causal path (window, sinks, decay, exact memory by feature error) = the quadratic twin,
forward and gradients; on a tiny converted Llama the layers' twin = the op, cached decoding = one
full forward, and save/load keeps the option.
"""

import pytest
import torch

import hf_rfa
from hf_rfa.feature_maps.learned import norm_preserved, norm_preserved_reference
from hf_rfa.ops.reference import quadratic_kernel_attention
from hf_rfa.recipes.conversion import calibration, mixing, transfer
from conftest import paired_grads, rel
from tiny_models import VOCAB, tiny_model
from tolerances import DECODE_LOGITS, GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D, M = 2, 4, 2, 57, 16, 8


def _map(dtype=torch.float32, mix=False, seed=0):
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=D, num_features=M, num_heads=H, num_kv_heads=HKV, hybrid_mix=mix, norm_preserving=True)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the identity init, a different W per head
        fm.weight_q.add_(0.5 * torch.randn(fm.weight_q.shape, generator=g))
        fm.weight_k.add_(0.5 * torch.randn(fm.weight_k.shape, generator=g))
        if mix:
            fm.mix.copy_(torch.randn(fm.mix.shape, generator=g))
    return fm.to(dtype)


def _inputs(seed, dtype=torch.float32, n=N, pad=6):
    """q, k, v whose rows have norms spread over two orders of magnitude, and a padding mask."""
    g = torch.Generator().manual_seed(seed)
    spread = lambda h: torch.randn(B, h, n, D, generator=g, dtype=dtype) * torch.exp(torch.rand(B, h, n, 1, generator=g, dtype=dtype) * 4 - 2)  # noqa: E731
    q, k, v = spread(H), spread(HKV), torch.randn(B, HKV, n, D, generator=g, dtype=dtype)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :pad] = False
    return q, k, v, mask


def _full(f):
    """The feature tensor φ = phi · exp(log_scale)."""
    return f.phi if f.log_scale is None else f.phi * torch.exp(f.log_scale).unsqueeze(-1)


def test_features_have_the_norm_of_their_input():
    fm = _map(mix=True)
    x = _inputs(0)[0] * torch.tensor([1e-3, 1.0, 30.0]).repeat_interleave(19)[:N].view(1, 1, N, 1)
    for f, heads in ((fm.unmixed_queries(x), H), (fm.forward_keys(x[:, :HKV]), HKV)):
        assert torch.allclose(_full(f).norm(dim=-1), x[:, :heads].norm(dim=-1), rtol=1e-5)
        assert (f.phi.norm(dim=-1) - 1).abs().max() < 1e-5 and (f.phi >= 0).all()  # bounded: unit rows
    plain = hf_rfa.build_feature_map("hedgehog", head_dim=D, num_features=M, num_heads=H, num_kv_heads=HKV)
    plain.load_state_dict({k: v for k, v in fm.state_dict().items() if k != "mix"})
    assert plain.forward_keys(x[:, :HKV]).log_scale is None
    assert torch.allclose(plain.forward_keys(x[:, :HKV]).phi.sum(-1), torch.ones(B, HKV, N))  # softmax: sums to 1 whatever ‖x‖
    # the hybrid's mix adds to the queries' log scale (the features keep their norm under it)
    mixed = fm.forward_queries(x)
    assert torch.allclose(mixed.log_scale, torch.log(x.norm(dim=-1)) + fm.mix.view(1, H, 1), atol=1e-5)


def test_equals_the_direct_formula():
    fm = _map(torch.float64)
    x = _inputs(1, torch.float64)[0]
    for f, w, heads in ((fm.forward_queries(x), fm.weight_q, H), (fm.forward_keys(x[:, :HKV]), fm.weight_k, HKV)):
        xs = x[:, :heads]
        p = torch.einsum("bhnd,hdm->bhnm", xs, w)
        s = torch.exp(torch.cat([p, -p], -1))
        s = s / s.sum(-1, keepdim=True)
        want = xs.norm(dim=-1, keepdim=True) * s / s.norm(dim=-1, keepdim=True)
        assert (_full(f) - want).abs().max() < 1e-12
        assert (norm_preserved_reference(s, xs) - want).abs().max() < 1e-12
    zero = norm_preserved(torch.full((3, 4), 0.25), torch.zeros(3, 5))  # a zero input: finite, ≈ 0
    assert torch.isfinite(zero.log_scale).all() and (_full(zero).abs().max() < 1e-20)


def test_option_is_validated_and_off_by_default():
    assert hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8).norm_preserving is False
    with pytest.raises(ValueError, match=r"^norm_preserving must be True or False, got 'yes'$"):
        hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8, norm_preserving="yes")
    with pytest.raises(ValueError, match=r"norm_preserving must be True or False, got 1"):
        hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, feature_map_options={"norm_preserving": 1}))
    with pytest.raises(ValueError, match="bad options for feature map 't2r'"):
        hf_rfa.build_feature_map("t2r", head_dim=8, num_features=8, norm_preserving=True)


KW = dict(window=5, sinks=2, memory=3, memory_every=8, memory_score="feature_error")


@pytest.mark.parametrize("kw", [dict(window=5, sinks=2), KW], ids=["W5-S2", "W5-S2-M3-feature_error"])
@pytest.mark.parametrize("decay", [0.0, 6.0])
def test_causal_op_equals_twin(kw, decay):
    q, k, v, mask = _inputs(2)
    fm = _map(mix=True)
    if decay:
        fm.enable_decay(decay)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    plain = hf_rfa.build_feature_map("hedgehog", head_dim=D, num_features=M, num_heads=H, num_kv_heads=HKV, hybrid_mix=True)
    plain.load_state_dict(fm.state_dict(), strict=False)
    if decay:
        plain.enable_decay(decay)
    other = quadratic_kernel_attention(q, k, v, plain, True, mask, **kw)
    assert rel(other[real], ref[real]) > 1e-2  # the norms change the attention


def test_gradients_equal_twin():
    q, k, v, mask = _inputs(3)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    fm = _map(mix=True)
    fm.enable_decay(6.0)
    params = [p for p in fm.parameters() if p.requires_grad]
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **KW)
    pairs = paired_grads(out, ref, mask, (q, k, v, *params), 9)
    for x, y in pairs:
        assert rel(x, y) <= GRAD_FP32


SETTING = dict(feature_map="hedgehog", num_features=16, window=3, sinks=1, decay=5.0, chunk_size=4, memory=2, memory_every=4,
               memory_score="feature_error", feature_input="unrotated", feature_map_options={"hybrid_mix": True, "norm_preserving": True})


def _model(**options):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**SETTING, "feature_map_options": {"hybrid_mix": True, **options}}))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # as if transferred: learned W and a feature part with real weight
        for layer in model.model.layers:
            fm = layer.self_attn.rfa.feature_map
            fm.mix.fill_(1.0)
            for w in (fm.weight_q, fm.weight_k):
                w.add_(0.5 * torch.randn(w.shape, generator=g))
    return model


def _batch(n=30, pad=4):
    ids = torch.randint(2, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def test_tiny_model_twin_op_and_cached_decoding():
    model = _model(norm_preserving=True)
    ids, mask = _batch()
    caps = calibration.capture(model, ids, attention_mask=mask)
    for idx, rfa in calibration.rfa_layers(model).items():
        assert rfa.feature_map.norm_preserving
        with torch.no_grad():
            twin = transfer.transfer_output(rfa, caps[idx], twin_max_keys=10**6)
            op = transfer.transfer_output(rfa, caps[idx], twin_max_keys=0)
        real = mask.bool()[:, None, :, None].expand_as(twin)
        assert rel(op[real], twin[real]) <= ORACLE_FP32
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        outs, t = [], 0
        for step in (9, 6) + (1,) * (ids.shape[1] - 15):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            t += step
    assert (torch.cat(outs, 1) - full)[mask.bool()].abs().max().item() <= DECODE_LOGITS


def test_init_mixing_counts_the_norms():
    """The closed-form mix matches the softmax mass beyond the window with the norm-preserving
    features themselves (their log scales included), not their unit directions."""
    model = _model(norm_preserving=True)
    ids, mask = _batch(n=24, pad=0)
    caps = calibration.capture(model, ids)
    assert mixing.init_mixing(model, caps) == 2
    rfa = calibration.rfa_layers(model)[1]
    fm, cap = rfa.feature_map, caps[1]
    scale = (cap.q.shape[-1] ** -0.5 if cap.scale is None else cap.scale) ** 0.5
    g = cap.q.shape[1] // cap.k.shape[1]
    phi_q = norm_preserved_reference(fm.unmixed_queries(cap.fq * scale).phi, cap.fq * scale)
    phi_k = norm_preserved_reference(fm.forward_keys(cap.fk * scale).phi, cap.fk * scale).repeat_interleave(g, 1)
    n = ids.shape[1]
    t, s = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    far = (s <= t - rfa.window) & (s >= rfa.sinks)  # causal, beyond the window, not a sink
    decay = torch.exp(-fm.decay_log_rate.detach().exp().repeat_interleave(g).view(1, -1, 1, 1) * (t - s).clamp_min(0))
    scores = (cap.q * scale) @ (cap.k * scale).repeat_interleave(g, 1).transpose(-1, -2)
    target = torch.logsumexp(scores.masked_fill(~far, -1e30), -1)
    feat = torch.log(((phi_q @ phi_k.transpose(-1, -2)) * decay * far).sum(-1))
    rows = far.any(-1)
    want = (target - feat)[:, :, rows].mean((0, 2))
    assert torch.allclose(fm.mix.detach(), want, atol=1e-4)


def test_save_load_keeps_the_option(tmp_path):
    model = _model(norm_preserving=True)
    ids, mask = _batch(n=14, pad=2)
    model.save_pretrained(tmp_path)
    again = hf_rfa.from_pretrained(str(tmp_path), type(model))
    assert hf_rfa.RFAConfig.from_dict(again.config.rfa_config).feature_map_options == {"hybrid_mix": True, "norm_preserving": True}
    assert all(layer.self_attn.rfa.feature_map.norm_preserving for layer in again.model.layers)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        assert torch.equal(again(ids, attention_mask=mask).logits, want)
        plain = _model()  # the same weights without the option: other logits
        plain.load_state_dict(model.state_dict())
        assert (plain(ids, attention_mask=mask).logits - want)[mask.bool()].abs().max() > 10 * DECODE_LOGITS
