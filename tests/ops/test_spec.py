"""``AttentionSpec``: one frozen set of a layer's settings, validated once, built from ``RFAConfig``,
and the op on a spec (``attend``) equal to the op on keywords (``random_feature_attention``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_rfa
from hf_rfa.hf.attention import RFAAttention
from hf_rfa.ops import AttentionSpec, attend
from tiny_models import tiny_model


def test_spec_is_frozen_and_validated_field_by_field():
    spec = AttentionSpec(window=4, sinks=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.window = 8
    for bad, match in (
        (dict(window=-1), "window"),
        (dict(sinks=-2), "sinks"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(memory=-1), "memory"),
        (dict(memory_every=0), "memory_every"),
        (dict(checkpoint_blocks=1), "checkpoint_blocks"),
        (dict(backend="cuda-magic"), "backend"),
        (dict(memory_score="largest"), "memory_score"),
        (dict(feature_input="sideways"), "feature_input"),
        (dict(window=2.0), "window"),
    ):
        with pytest.raises(ValueError, match=match):
            AttentionSpec(**bad)
    with pytest.raises(ValueError, match="sinks"):
        spec.replace(sinks=-1)  # a copy is validated again
    assert spec.replace(sinks=3) == AttentionSpec(window=4, sinks=3) != spec


def test_spec_from_config_carries_every_field():
    cfg = hf_rfa.RFAConfig(window=16, sinks=4, chunk_size=32, checkpoint_blocks=False, backend="torch", memory=8, memory_every=16, memory_score="feature_error", feature_input="unrotated")
    spec = AttentionSpec.from_config(cfg)
    assert spec.to_dict() == {f.name: getattr(cfg, f.name) for f in dataclasses.fields(AttentionSpec)}
    assert AttentionSpec.from_config(hf_rfa.RFAConfig()) == AttentionSpec()


def test_call_checks_name_the_bad_combination():
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0)
    q = torch.randn(1, 2, 12, 8)
    with pytest.raises(ValueError, match="memory > 0 needs causal"):
        attend(q, q, q, fm, AttentionSpec(memory=4), causal=False)
    with pytest.raises(ValueError, match="bidirectional window needs Nq == Nk"):
        attend(q[:, :, :5], q, q, fm, AttentionSpec(window=3), causal=False)
    none = hf_rfa.build_feature_map("none", head_dim=8, num_features=16, seed=0)
    with pytest.raises(ValueError, match="window > 0 or sinks > 0"):
        attend(q, q, q, none, AttentionSpec())
    with pytest.raises(ValueError, match="spec must be an AttentionSpec"):
        attend(q, q, q, fm, {"window": 4})


@pytest.mark.parametrize("causal,kw", [(True, dict(window=5, sinks=2)), (True, dict(window=5, sinks=2, memory=4, memory_every=8)), (False, dict(window=0))], ids=["hybrid", "memory", "bidirectional"])
def test_attend_on_a_spec_is_the_keyword_op(causal, kw):
    """Same outputs and gradients, bit for bit (one code path behind both)."""
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=16, seed=1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :5] = False
    results = []
    for form in ("keywords", "spec"):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        if form == "keywords":
            out = hf_rfa.random_feature_attention(*x, fm, causal=causal, attention_mask=mask, **kw)
        else:
            out = attend(*x, fm, AttentionSpec(**kw), causal=causal, attention_mask=mask)
        out.pow(2).sum().backward()
        results.append([out.detach(), *(t.grad for t in x)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_layer_holds_one_spec_and_its_fields_follow_it():
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0)
    layer = RFAAttention(fm, window=2, sinks=1)
    assert layer.spec == AttentionSpec(window=2, sinks=1) and layer.window == 2
    layer.memory = 4  # setting a field replaces the spec, validated again
    assert layer.spec == AttentionSpec(window=2, sinks=1, memory=4)
    with pytest.raises(ValueError, match="memory_every"):
        layer.memory_every = 0
    assert layer.spec.memory_every == 64
    spec = AttentionSpec(window=8)
    assert RFAAttention(fm, spec, layer_idx=3).spec is spec
    with pytest.raises(ValueError, match="not both"):
        RFAAttention(fm, spec, window=2)


def test_converted_layers_carry_the_configs_spec():
    cfg = hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16, window=4, sinks=1, chunk_size=16)
    model = hf_rfa.convert(tiny_model("llama"), cfg)
    specs = {m.spec for m in model.modules() if isinstance(m, RFAAttention)}
    assert specs == {AttentionSpec.from_config(cfg)}
