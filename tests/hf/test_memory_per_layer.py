"""``RFAConfig.memory_per_layer``: one exact-memory size per layer — each layer runs the memory
its entry names (against a model whose layers were given those sizes by hand), the setting
travels with save/load and ``set_memory``, and bad lists are refused with one line."""

import pytest
import torch

import hf_rfa
from tiny_models import tiny_model

BASE = dict(feature_map="favor+", num_features=32, window=4, sinks=2, memory=3, memory_every=4, chunk_size=8, memory_score="query_mass")


def _batch(n=30, pad=3):
    ids = torch.randint(2, 100, (2, n), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _by_hand(sizes):
    """The reference: a model converted with one memory size, each layer's spec then edited."""
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE))
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.rfa.spec = layer.self_attn.rfa.spec.replace(memory=sizes[i])
    return model


@pytest.mark.parametrize("sizes", [[2, 0], [0, 6], [5, 1]])
def test_each_layer_runs_its_own_memory(sizes):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE, memory_per_layer=sizes))
    assert [layer.self_attn.rfa.memory for layer in model.model.layers] == sizes
    ids, mask = _batch()
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        assert torch.equal(got, _by_hand(sizes)(ids, attention_mask=mask).logits)
        uniform = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE))(ids, attention_mask=mask).logits
        assert (got - uniform)[mask.bool()].abs().max() > 1e-4  # the sizes matter


def test_save_load_and_set_memory_keep_the_sizes(tmp_path):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**BASE, "memory": 0}))
    hf_rfa.set_memory(model, 3, 4, "query_mass", per_layer=[4, 1])
    assert [layer.self_attn.rfa.memory for layer in model.model.layers] == [4, 1]
    assert hf_rfa.rfa_config_of(model).memory_per_layer == [4, 1]
    ids, mask = _batch()
    with torch.no_grad():
        want = _by_hand([4, 1])(ids, attention_mask=mask).logits
        assert torch.equal(model(ids, attention_mask=mask).logits, want)
        model.save_pretrained(tmp_path)
        again = hf_rfa.from_pretrained(str(tmp_path), type(model))
        assert hf_rfa.rfa_config_of(again).memory_per_layer == [4, 1]
        assert [layer.self_attn.rfa.memory for layer in again.model.layers] == [4, 1]
        assert torch.equal(again(ids, attention_mask=mask).logits, want)
        hf_rfa.set_memory(model, 3, 4, "query_mass")  # back to one size for every layer
        assert [layer.self_attn.rfa.memory for layer in model.model.layers] == [3, 3]
        assert hf_rfa.rfa_config_of(model).memory_per_layer is None


@pytest.mark.parametrize("bad", [[], [3, -1], [3, 2.5], [True, 2], "3,2", [3, 70000]])
def test_bad_lists_are_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="memory_per_layer must be None or a non-empty list") as e:
        hf_rfa.RFAConfig(**BASE, memory_per_layer=bad)
    assert "\n" not in str(e.value)


def test_too_short_a_list_is_refused_at_conversion():
    with pytest.raises(ValueError, match="memory_per_layer has 1 entries"):
        hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE, memory_per_layer=[3]))
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE))
    with pytest.raises(ValueError, match="memory_per_layer has 1 entries"):
        hf_rfa.set_memory(model, 3, 4, "query_mass", per_layer=[3])
    with pytest.raises(ValueError, match="memory"):
        hf_rfa.convert(tiny_model("bert"), hf_rfa.RFAConfig(window=4, memory_per_layer=[0, 2]))


def test_config_round_trips_through_its_dict():
    cfg = hf_rfa.RFAConfig(**BASE, memory_per_layer=(2, 0, 7))
    again = hf_rfa.RFAConfig.from_dict(cfg.to_dict())
    assert again.memory_per_layer == [2, 0, 7] and again.memory_of(2) == 7 and again.memory_of(None) == 3
    assert hf_rfa.RFAConfig(**BASE).memory_of(5) == 3
