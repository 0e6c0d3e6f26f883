"""Converted models with an exact global memory (``RFAConfig(memory=M)``): cached decoding with
``RFACache`` equals one full forward, generate() equals recomputation, save/load keeps it, and
bidirectional models are refused."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryState
from tiny_models import tiny_model
from tolerances import DECODE_LOGITS

SETTINGS = {
    "none": dict(feature_map="none", window=4, sinks=2, memory=3, memory_every=4),
    "favor+": dict(feature_map="favor+", num_features=32, window=4, sinks=2, memory=3, memory_every=4, chunk_size=8),
    "hedgehog": dict(feature_map="hedgehog", num_features=16, window=3, sinks=0, memory=2, memory_every=5, chunk_size=4),
    "favor+feature_error": dict(feature_map="favor+", num_features=32, window=4, sinks=2, memory=3, memory_every=4, chunk_size=8, memory_score="feature_error"),
    "favor+query_mass": dict(feature_map="favor+", num_features=32, window=4, sinks=2, memory=3, memory_every=4, chunk_size=8, memory_score="query_mass"),
    "none+query_mass+per_layer": dict(feature_map="none", window=4, sinks=2, memory=3, memory_every=4, memory_score="query_mass", memory_per_layer=[3, 5]),
    "hedgehog+feature_error+per_layer": dict(feature_map="hedgehog", num_features=16, window=3, sinks=0, memory=2, memory_every=5, chunk_size=4,
                                              memory_score="feature_error", memory_per_layer=[1, 6]),
}


def _batch(n=26, pad=5):
    """Many repeated tokens: equal value vectors (ties of ‖v‖) that the prefill and decoding
    compute with differently shaped matmuls (last-bit differences)."""
    ids = torch.randint(2, 12, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_cached_decoding_matches_full_forward(family, setting):
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(**SETTINGS[setting]))
    ids, mask = _batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        plain = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(**{**SETTINGS[setting], "memory": 0, "memory_per_layer": None}))(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        outs, t, sizes = [], 0, []
        for step in (7, 5) + (1,) * (ids.shape[1] - 12):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            sizes.append(cache.nbytes())
            t += step
    assert all(isinstance(layer.state, MemoryState) for layer in cache.layers)
    assert (torch.cat(outs, 1) - full)[mask.bool()].abs().max().item() <= DECODE_LOGITS
    assert (plain - full)[mask.bool()].abs().max().item() > 10 * DECODE_LOGITS  # the memory is used
    cfg = SETTINGS[setting]
    assert max(sizes[cfg["window"] + cfg["memory_every"]:]) == max(sizes)  # bounded


def test_generate_matches_recompute_and_save_load(tmp_path):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["favor+"]))
    ids, mask = _batch(n=14, pad=3)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_cache=False)
        assert isinstance(out.cache, hf_rfa.RFACache)
        assert torch.equal(out.sequences, ref)
        beams = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)  # reorders the MemoryState
        assert torch.equal(beams, model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, use_cache=False))
        model.save_pretrained(tmp_path)
        again = hf_rfa.from_pretrained(str(tmp_path), type(model))
        assert again.model.layers[0].self_attn.rfa.memory == 3
        assert torch.equal(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_memory_score_survives_save_load(tmp_path):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["favor+feature_error"]))
    ids, mask = _batch(n=30, pad=3)
    model.save_pretrained(tmp_path)
    again = hf_rfa.from_pretrained(str(tmp_path), type(model))
    assert again.model.layers[0].self_attn.rfa.memory_score == "feature_error"
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
        by_norm = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**SETTINGS["favor+feature_error"], "memory_score": "value_norm"}))
        assert not torch.equal(by_norm(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_set_memory_equals_converting_with_it(tmp_path):
    """hf_rfa.set_memory switches the memory of a converted model (no parameters change): the
    result equals converting with those settings; config, save/load follow; bad input refused."""
    cfg = dict(SETTINGS["favor+"], memory=0)
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**cfg))
    want = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**cfg, "memory": 3, "memory_score": "feature_error"}))
    ids, mask = _batch(n=30, pad=3)
    hf_rfa.set_memory(model, 3, 4, "feature_error")
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, want(ids, attention_mask=mask).logits)
        assert hf_rfa.rfa_config_of(model).memory_score == "feature_error"
        model.save_pretrained(tmp_path)
        again = hf_rfa.from_pretrained(str(tmp_path), type(model))
        assert torch.equal(again(ids, attention_mask=mask).logits, want(ids, attention_mask=mask).logits)
        hf_rfa.set_memory(model, 0)
        plain = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**cfg))
        assert torch.equal(model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="memory_score must be one of"):
        hf_rfa.set_memory(model, 3, 4, "norm")
    with pytest.raises(ValueError, match="not converted"):
        hf_rfa.set_memory(tiny_model("llama"), 3)
    with pytest.raises(ValueError, match="bidirectional"):
        hf_rfa.set_memory(hf_rfa.convert(tiny_model("bert"), hf_rfa.RFAConfig(window=4)), 3)


def test_bidirectional_model_with_memory_is_refused():
    with pytest.raises(ValueError, match="memory"):
        hf_rfa.convert(tiny_model("bert"), hf_rfa.RFAConfig(window=4, memory=8))


def test_recipes_run_the_layer_with_its_memory():
    """Layer errors / LoRA (``rfa_output``, the op) and attention transfer (``transfer_output``, the
    twin up to ``TWIN_MAX_KEYS`` keys) both answer the memory keys exactly."""
    from hf_rfa.recipes.conversion.calibration import Captured, rfa_output
    from hf_rfa.recipes.conversion.transfer import transfer_output

    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["favor+"]))
    rfa = model.model.layers[0].self_attn.rfa
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :6] = False
    cap = Captured(q, k, v, q, mask, True, None)
    a, b = rfa_output(rfa, cap), transfer_output(rfa, cap)
    real = mask[:, None, :, None].expand_as(a)
    assert ((a - b)[real].norm() / b[real].norm()).item() <= 1e-5
    rfa.memory = 0
    assert ((rfa_output(rfa, cap) - b)[real].norm() / b[real].norm()).item() > 1e-3
