"""``hf_rfa.reconfigure``: a converted model's settings without parameters (window, sinks, memory,
...) changed after training equal converting with them; the others are refused."""

import pytest
import torch

import hf_rfa
from hf_rfa.hf.runtime import RUNTIME_FIELDS, parse_runtime_settings
from tiny_models import tiny_model

BASE = dict(feature_map="favor+", num_features=32, window=4, sinks=2, memory=0, chunk_size=8)


def _ids():
    ids = torch.randint(2, 60, (2, 30), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("changes", [dict(window=8), dict(sinks=0, window=6), dict(memory=3, memory_every=4, memory_score="feature_error"),
                                     dict(window=2, memory=2, memory_per_layer=[2, 5], memory_score="value_norm"), dict(chunk_size=4)])
def test_reconfigured_model_equals_converting_with_the_settings(changes, tmp_path):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE))
    want = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**BASE, **changes}))
    ids, mask = _ids()
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        assert hf_rfa.reconfigure(model, **changes) is model
        got = model(ids, attention_mask=mask).logits
        assert torch.equal(got, want(ids, attention_mask=mask).logits)
        if set(changes) != {"chunk_size"}:  # chunking changes no result beyond rounding
            assert not torch.allclose(got, before)
        cfg = hf_rfa.rfa_config_of(model)
        assert all(getattr(cfg, k) == v for k, v in changes.items())
        model.save_pretrained(tmp_path)
        again = hf_rfa.from_pretrained(str(tmp_path), type(model))
        assert torch.equal(again(ids, attention_mask=mask).logits, got)


def test_fields_that_shape_parameters_and_bad_values_are_refused():
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**BASE))
    with pytest.raises(ValueError, match=r"cannot change \['feature_map', 'num_features'\].*'window'"):
        hf_rfa.reconfigure(model, num_features=16, feature_map="hedgehog")
    with pytest.raises(ValueError, match="window"):
        hf_rfa.reconfigure(model, window=-1)
    with pytest.raises(ValueError, match="not converted"):
        hf_rfa.reconfigure(tiny_model("llama"), window=4)
    with pytest.raises(ValueError, match="bidirectional"):
        hf_rfa.reconfigure(hf_rfa.convert(tiny_model("bert"), hf_rfa.RFAConfig(window=4)), memory=3)
    assert hf_rfa.rfa_config_of(model).window == 4 and all(m.window == 4 for m in model.modules() if hasattr(m, "spec"))


def test_command_line_settings_are_typed():
    assert parse_runtime_settings(["window=1088", "memory_score=query_mass", "checkpoint_blocks=False", "memory_per_layer=3,5", "backend=torch"]) == {
        "window": 1088, "memory_score": "query_mass", "checkpoint_blocks": False, "memory_per_layer": [3, 5], "backend": "torch"}
    assert parse_runtime_settings(["memory_per_layer=none"]) == {"memory_per_layer": None}
    for bad, msg in [("window", "FIELD=VALUE"), ("feature_map=none", "FIELD=VALUE"), ("window=big", "window takes an integer"),
                     ("checkpoint_blocks=maybe", "true or false"), ("memory_per_layer=1,x", "comma-separated")]:
        with pytest.raises(ValueError, match=msg) as e:
            parse_runtime_settings([bad])
        assert "\n" not in str(e.value)
    assert set(RUNTIME_FIELDS) <= set(hf_rfa.RFAConfig.__dataclass_fields__)
