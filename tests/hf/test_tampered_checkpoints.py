"""A converted folder whose rfa_config or RFA tensors were edited is refused by every loader
(hf_rfa.from_pretrained, the stock loader with hf_rfa imported, the folder's remote code), with a
one-line ValueError — never loaded with the saved projections ignored."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_rfa
from tiny_models import tiny_model

LOADERS = {
    "hf_rfa": lambda d: hf_rfa.from_pretrained(str(d)),
    "auto": lambda d: AutoModelForCausalLM.from_pretrained(d),
    "remote": lambda d: AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True),
}


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if k == "rfa_config":
            cfg[k] = v
        else:
            cfg["rfa_config"][k] = v
    path.write_text(json.dumps(cfg))


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    sd = load_file(path)
    edit(sd)
    save_file(sd, path, metadata={"format": "pt"})


def _nan_omega(sd):
    key = next(k for k in sd if k.endswith(".rfa.feature_map.omega") or (".rfa." in k and "omega" in k))
    sd[key] = sd[key].clone()
    sd[key].view(-1)[0] = float("nan")


def _extra_tensor(sd):
    sd["model.layers.0.self_attn.rfa.feature_map.stray"] = torch.zeros(3)


TAMPERS = {
    "feature_map_changed": (lambda d: _edit_config(d, feature_map="elu"), r"RFA tensors|rfa_config"),
    "layers_changed": (lambda d: _edit_config(d, layers=[0]), r"RFA tensors|rfa_config"),
    "num_features_changed": (lambda d: _edit_config(d, num_features=8), r"shape|RFA tensors"),
    "extra_rfa_tensor": (lambda d: _edit_weights(d, _extra_tensor), r"RFA tensors"),
    "nan_omega": (lambda d: _edit_weights(d, _nan_omega), r"NaN"),
    "rfa_config_list": (lambda d: _edit_config(d, rfa_config=["favor+", 16]), r"rfa_config must be a dict"),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=16))
    folder = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("tamper", list(TAMPERS))
def test_tampered_checkpoint_is_refused_with_one_line(saved, tmp_path, tamper, loader):
    import shutil

    folder = tmp_path / "t"
    shutil.copytree(saved, folder)
    edit, match = TAMPERS[tamper]
    edit(folder)
    with pytest.raises(ValueError, match=match) as info:
        LOADERS[loader](folder)
    assert "\n" not in str(info.value)


def test_untampered_copy_loads_in_every_loader(saved):
    for load in LOADERS.values():
        assert hf_rfa.rfa_config_of(load(saved)).feature_map == "favor+"


def test_rfa_config_must_be_a_dict():
    with pytest.raises(ValueError, match="rfa_config must be a dict"):
        hf_rfa.RFAConfig.from_dict(["favor+"])
