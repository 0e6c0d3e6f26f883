"""``RFAConfig.memory_distance`` on a converted Llama: the exact memory's keys read at a clamped rotary
distance, in prefill and in cached generation, through save/load and ``reconfigure``; the rotation
comes from the model's own rotary embedding."""

import pytest
import torch

import hf_rfa
from hf_rfa.hf.cache import RFACache
from hf_rfa.hf.rope import clamp_memory_distance, rotation_at
from tiny_models import tiny_model

BASE = dict(feature_map="hedgehog", num_features=16, window=4, sinks=1, memory=3, memory_every=4, chunk_size=8, feature_input="unrotated")
N, DELTA = 40, 9


def _ids():
    return torch.randint(2, 60, (2, N), generator=torch.Generator().manual_seed(5))


def _model(**changes):
    return hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**BASE, **changes})).eval()


def test_the_rotation_is_the_models_own():
    model = tiny_model("llama")
    rot = model.model.rotary_emb
    x = torch.zeros(1)
    cos, sin = rot(x, torch.arange(20)[None])
    got = rotation_at(model, 13)
    assert all(torch.equal(a, b) for a, b in zip(rotation_at((rot,), 13), got))
    assert torch.equal(got[0], cos[0, 13]) and torch.equal(got[1], sin[0, 13])
    with pytest.raises(ValueError, match="no rotary embedding"):
        rotation_at(tiny_model("bert"), 13)


def test_clamped_distances_change_only_far_queries_and_decode_equals_prefill():
    ids = _ids()
    with torch.no_grad():
        plain = _model()(ids).logits
        far_model = _model(memory_distance=DELTA)
        clamped = far_model(ids).logits
        wide = _model(memory_distance=N)(ids).logits
    assert torch.equal(wide, plain)  # no key is further than N: the true distances
    # a query t reads memory keys s <= t - W; none is more than DELTA back while t <= DELTA
    assert torch.equal(clamped[:, : DELTA + 1], plain[:, : DELTA + 1])
    assert not torch.allclose(clamped[:, -8:], plain[:, -8:], atol=1e-4)
    cache = RFACache(far_model)
    steps = []
    with torch.no_grad():
        out = far_model(ids[:, :7], cache=cache, use_cache=True)
        steps.append(out.logits)
        for i in range(7, N):
            steps.append(far_model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(steps, 1), clamped, atol=2e-5, rtol=1e-4)


def test_save_load_and_reconfigure_keep_the_clamp(tmp_path):
    ids = _ids()
    model = _model(memory_distance=DELTA)
    with torch.no_grad():
        want = model(ids).logits
        model.save_pretrained(tmp_path)
        again = hf_rfa.from_pretrained(str(tmp_path), type(model)).eval()
        assert hf_rfa.rfa_config_of(again).memory_distance == DELTA
        assert torch.equal(again(ids).logits, want)
        later = hf_rfa.reconfigure(_model(), memory_distance=DELTA)
        assert torch.equal(later(ids).logits, want)
        hf_rfa.reconfigure(later, memory_distance=0)
        assert all(m.memory_rope is None for m in later.modules() if isinstance(m, hf_rfa.hf.attention.RFAAttention))
        assert torch.equal(later(ids).logits, _model()(ids).logits)
    assert "memory_distance=9" in repr(model)


def test_rotated_feature_inputs_refuse_a_clamp():
    with pytest.raises(ValueError, match="memory_distance=9 .* needs feature_input='unrotated', got 'rotated'"):
        hf_rfa.RFAConfig(**{**BASE, "feature_input": "rotated", "memory_distance": DELTA})
    with pytest.raises(ValueError, match="memory_distance"):
        hf_rfa.RFAConfig(**{**BASE, "memory_distance": -2})


def test_the_recipe_clamps_at_the_models_positions():
    model = _model()
    limit = model.config.max_position_embeddings
    assert clamp_memory_distance(model) == limit - 1 and hf_rfa.rfa_config_of(model).memory_distance == limit - 1
    assert clamp_memory_distance(model) == 0  # already set: left as it is
    ids = torch.randint(2, 60, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, _model()(ids).logits)  # within the positions nothing changes
    for changes in (dict(memory=0), dict(feature_input="rotated")):
        assert clamp_memory_distance(_model(**changes)) == 0
