"""``RFAConfig(feature_input="unrotated")``: the feature part of a rotary model reads q/k before
the rotary embedding. :func:`hf_rfa.hf.rope.unrotate` inverts transformers' rotation; the
converted model's cached decoding equals one full forward, generate() equals recomputation,
save/load keeps the setting, captured feature inputs do not depend on absolute position,
attention transfer and LoRA run on them, and models without rotary embeddings are refused."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_rfa
from hf_rfa.hf.rope import unrotate
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import calibration, transfer
from tiny_models import VOCAB, tiny_model
from tolerances import DECODE_LOGITS

SETTING = dict(feature_map="hedgehog", num_features=16, window=3, sinks=1, decay=5.0, chunk_size=4,
               feature_map_options={"hybrid_mix": True}, feature_input="unrotated")


def _batch(n=26, pad=5):
    ids = torch.randint(2, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _model(**over):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**SETTING, **over}))
    with torch.no_grad():  # as if transferred: the feature part carries real weight
        for layer in model.model.layers:
            layer.self_attn.rfa.feature_map.mix.fill_(2.0)
    return model


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_unrotate_inverts_the_rotary_embedding(rot_dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 11, 16, generator=g, dtype=torch.float64)
    ang = torch.rand(2, 11, rot_dim // 2, generator=g, dtype=torch.float64) * 50
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos() * 1.3, emb.sin() * 1.3  # a scaled rotation (YaRN-style attention factor)
    xr = x[..., :rot_dim]
    rot, _ = apply_rotary_pos_emb(xr, xr, cos, sin)
    rot = torch.cat([rot, x[..., rot_dim:]], -1)
    assert (unrotate(rot, cos, sin) - x).abs().max() < 1e-12
    assert (rot - x).abs().max() > 0.1


FAVOR = dict(feature_map="favor+", num_features=32, window=4, sinks=2, decay=3.0, chunk_size=8, feature_input="unrotated")


@pytest.mark.parametrize("over", [{}, FAVOR], ids=["hedgehog", "favor+"])
def test_cached_decoding_and_generate_match_the_full_forward(over):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**FAVOR)) if over else _model()
    ids, mask = _batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        rotated = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**FAVOR, "feature_input": "rotated"})) if over else _model(feature_input="rotated")
        rotated.load_state_dict(model.state_dict())
        if over:  # the setting is used (a tiny model's logits barely move with a learned map's init)
            assert (rotated(ids, attention_mask=mask).logits - full)[mask.bool()].abs().max() > 10 * DECODE_LOGITS
        cache = hf_rfa.RFACache(model)
        outs, t = [], 0
        for step in (7, 5) + (1,) * (ids.shape[1] - 12):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            t += step
        assert (torch.cat(outs, 1) - full)[mask.bool()].abs().max().item() <= DECODE_LOGITS
        short_ids, short_mask = _batch(n=14, pad=3)
        out = model.generate(short_ids, attention_mask=short_mask, max_new_tokens=10, do_sample=False)
        assert torch.equal(out, model.generate(short_ids, attention_mask=short_mask, max_new_tokens=10, do_sample=False, use_cache=False))


def test_save_load_keeps_the_setting(tmp_path):
    model = _model()
    ids, mask = _batch(n=12, pad=2)
    model.save_pretrained(tmp_path)
    again = hf_rfa.from_pretrained(str(tmp_path), type(model))
    assert hf_rfa.RFAConfig.from_dict(again.config.rfa_config).feature_input == "unrotated"
    assert again.model.layers[0].self_attn.rfa.feature_input == "unrotated"
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_captured_feature_inputs_do_not_depend_on_position():
    model = _model()
    ids, _ = _batch(n=20)
    at0 = calibration.capture(model, ids)
    at500 = calibration.capture(model, ids, position_ids=torch.arange(500, 520).expand(2, 20))
    for idx in at0:
        assert (at0[idx].fq - at500[idx].fq).abs().max() < 1e-4
        assert (at0[idx].fk - at500[idx].fk).abs().max() < 1e-4
        assert (at0[idx].q - at500[idx].q).abs().max() > 1e-2  # the rotated ones do
    assert (at0[0].fq - at0[0].q).abs().max() > 1e-2


def test_transfer_twin_and_op_agree_and_transfer_and_lora_run():
    model = _model()
    ids = torch.randint(2, VOCAB, (32 * 6,), generator=torch.Generator().manual_seed(1))
    caps = calibration.capture(model, ids[:32][None])
    for idx, rfa in calibration.rfa_layers(model).items():
        with torch.no_grad():
            twin = transfer.transfer_output(rfa, caps[idx], twin_max_keys=10**6)
            op = transfer.transfer_output(rfa, caps[idx], twin_max_keys=0)
        assert (twin - op).abs().max() < 1e-5
    fm = model.model.layers[0].self_attn.rfa.feature_map
    before = [p.detach().clone() for p in fm.parameters()]
    res = transfer.attention_transfer(model, evaluation.shuffled_batches(ids, 32, 1, seed=0), tokens=32 * 3, lr=3e-2, progress=False)
    assert res.steps == 3
    assert any((p - b).abs().max() > 1e-4 for p, b in zip(fm.parameters(), before))
    trained, stats = transfer.lora_finetune(model, evaluation.shuffled_batches(ids, 32, 1, seed=1), 64, progress=False)
    assert stats.tokens >= 64
    with torch.no_grad():
        assert torch.isfinite(trained(ids[:32][None]).logits).all()


def test_models_without_rotary_embeddings_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="feature_input='unrotated' needs rotary"):
        hf_rfa.convert(tiny_model("gpt2"), hf_rfa.RFAConfig(window=4, feature_input="unrotated"))
    with pytest.raises(ValueError, match="feature_input must be one of"):
        hf_rfa.RFAConfig(feature_input="pre-rope")


@pytest.mark.parametrize("score", ["value_norm", "feature_error"])
def test_unrotated_features_with_an_exact_memory(score):
    """memory > 0 with un-rotated features and the decay (the main recipe + a memory): cached
    decoding = one full forward; the memory and the un-rotated features both change the result."""
    over = dict(memory=2, memory_every=4, memory_score=score)
    model = _model(**over)
    ids, mask = _batch(n=40)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        outs, t = [], 0
        for step in _steps(ids.shape[1]):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            t += step
        rotated = _model(**over, feature_input="rotated")(ids, attention_mask=mask).logits
        no_memory = _model()(ids, attention_mask=mask).logits
    m = mask.bool()
    assert (torch.cat(outs, 1) - full)[m].abs().max().item() <= DECODE_LOGITS
    st = cache.layers[0].state
    held = st.mem_ok & (st.mem_pos > 0)  # position 0 is not rotated
    # positions counted from 0 in the padded row too (no position_ids): the cache cannot recompute the
    # model's rotations from the real tokens, so the memory keeps copies of its keys un-rotated
    assert not cache.rope_table.ok
    assert held.any() and not torch.allclose(st.mem_kf[held], st.mem_k[held])
    assert not torch.equal(rotated, full)  # (the far keys weigh little in a tiny random model; the ops' twins test the values)
    assert (no_memory - full)[m].abs().max().item() > 10 * DECODE_LOGITS


# --- cached decoding keeps the rotated window only; the rotations once per cache ---------------
def _steps(n):
    return (7, 5, 3) + (1,) * (n - 15)


@pytest.mark.parametrize("window", [3, 40])  # 40 > the 26 tokens: the window never fills
def test_cached_decoding_float64_equals_the_full_forward(window):
    """float64: prefill, chunks, single tokens (left-padded batch) == one full forward to 1e-10;
    reset() and decoding again gives the same logits."""
    model = _model(window=window).double()
    ids, mask = _batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        runs = []
        for _ in range(2):
            outs, t = [], 0
            for step in _steps(ids.shape[1]):
                outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
                t += step
            runs.append(torch.cat(outs, 1))
            assert all(layer.state.win_kf is None for layer in cache.layers)
            assert len(cache.rope_ring) == min(window, ids.shape[1])
            cache.reset()
            assert len(cache.rope_ring) == 0 and cache.rope_ring.end == 0
    real = mask.bool()
    assert (runs[0] - full)[real].abs().max().item() <= 1e-10 * full.abs().max().item()
    assert torch.equal(runs[0], runs[1])


def test_beam_search_and_left_padded_batch_generation():
    """Beam search (the shared ring follows the beams) equals recomputation; a left-padded batch
    generates what each row generates alone."""
    model = _model()
    ids, mask = _batch(n=14, pad=3)
    with torch.no_grad():
        for beams in (2, 3):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=beams, do_sample=False, return_dict_in_generate=True)
            assert isinstance(out.cache, hf_rfa.RFACache)
            assert torch.equal(out.sequences, model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=beams, do_sample=False, use_cache=False))
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        for row, pad in ((0, 0), (1, 3)):
            alone = model.generate(ids[row:row + 1, pad:], attention_mask=mask[row:row + 1, pad:], max_new_tokens=10, do_sample=False)
            assert torch.equal(batched[row, -10:], alone[0, -10:])


def _prefilled(feature_input, n=80):
    """The shipped recipe's shape of state (Hedgehog m=64 → 128 features, window 64, 4 sinks, decay)."""
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(
        feature_map="hedgehog", num_features=64, window=64, sinks=4, decay=128.0, chunk_size=16,
        feature_map_options={"hybrid_mix": True}, feature_input=feature_input))
    ids = torch.randint(2, VOCAB, (2, n), generator=torch.Generator().manual_seed(3))
    cache = hf_rfa.RFACache(model)
    with torch.no_grad():
        model(ids[:, :n - 2], cache=cache, use_cache=True)
        for t in (n - 2, n - 1):  # and two decoding steps
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
    return model, cache


def test_unrotated_state_bytes_equal_the_rotated_recipe_plus_one_shared_ring():
    """The defect this fixes: with feature_input='unrotated' every layer kept a copy of its window's
    un-rotated keys (DecodeState.win_kf, W·D more numbers per kv head). Now each layer's state is
    byte for byte the rotated recipe's, and the cache adds the rotations of the last W positions
    once (not per layer)."""
    model, cache = _prefilled("unrotated")
    _, rotated = _prefilled("rotated")
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    for layer, ref in zip(cache.layers, rotated.layers):
        assert layer.state.win_kf is None
        assert layer.state.win_k.shape[2] == 64
        assert {n: t.shape for n, t in layer.state.tensors().items()} == {n: t.shape for n, t in ref.state.tensors().items()}
        assert layer.nbytes() == ref.nbytes()
    assert rotated.ring_nbytes() == 0
    ring = cache.rope_ring
    rows = ring.cos.shape[0]
    assert ring.cos.shape == (rows, 64, head_dim) and rows in (1, 2)
    assert cache.ring_nbytes() == 2 * rows * 64 * head_dim * 4  # cos and sin, float32, once for all layers
    assert cache.nbytes() == rotated.nbytes() + cache.ring_nbytes()
    assert len(cache.layers) == 2  # (so a per-layer ring would have shown up as twice the bytes)


def test_rope_ring_refuses_to_run_out_of_step():
    from hf_rfa.hf.cache import RopeRing

    ring = RopeRing(keep=2, users=2)
    cos = sin = torch.ones(1, 3, 4)
    c, _ = ring.local(0, 3, 0, cos, sin)
    assert c.shape == (1, 3, 4) and len(ring) == 2
    assert ring.local(0, 3, 0, cos, sin)[0].shape == (1, 3, 4)  # the second layer of the forward
    c, _ = ring.local(3, 1, 2, cos[:, :1] * 2, sin[:, :1])
    assert c.shape == (1, 3, 4) and torch.equal(c[0, :, 0], torch.tensor([1.0, 1.0, 2.0]))
    with pytest.raises(RuntimeError, match="keeps a window of 3"):
        ring.local(3, 1, 3, cos[:, :1], sin[:, :1])
    with pytest.raises(RuntimeError, match="out of step"):
        ring.local(7, 1, 0, cos[:, :1], sin[:, :1])
    c, _ = ring.local(4, 1, 2, torch.ones(2, 1, 4), torch.ones(2, 1, 4))  # per-row positions: a batch-1 ring broadcasts
    assert c.shape == (2, 3, 4) and ring.cos.shape == (2, 2, 4)
    with pytest.raises(ValueError, match="does not continue the cache's batch"):
        ring.local(5, 1, 0, torch.ones(3, 1, 4), torch.ones(3, 1, 4))
    ring.map_batch(lambda t: t[[1]])
    assert ring.cos.shape == (1, 2, 4) and ring.local(5, 1, 2, torch.ones(1, 1, 4), torch.ones(1, 1, 4))[0].shape == (1, 3, 4)
