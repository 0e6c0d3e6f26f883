"""Loading reads only the checkpoint's own weight files and refuses broken ones."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import hf_rfa
from tiny_models import tiny_model


def _saved(tmp_path, name, seed, **save_kw):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8, seed=seed))
    model.save_pretrained(tmp_path / name, **save_kw)
    return model, tmp_path / name


def _omega(model):
    return torch.cat([t.flatten() for k, t in model.state_dict().items() if ".rfa." in k and t.is_floating_point()])


def test_stale_safetensors_next_to_a_sharded_checkpoint_is_ignored(tmp_path):
    a, path_a = _saved(tmp_path, "a", seed=0, max_shard_size="100KB")
    b, path_b = _saved(tmp_path, "b", seed=1)
    assert (path_a / "model.safetensors.index.json").is_file()
    shutil.copy(path_b / "model.safetensors", path_a / "zz-stale-copy.safetensors")  # another model's weights
    loaded = hf_rfa.from_pretrained(str(path_a), tf.AutoModelForCausalLM)
    assert torch.equal(_omega(loaded), _omega(a)) and not torch.equal(_omega(loaded), _omega(b))


def test_nan_feature_map_tensor_is_refused(tmp_path):
    _, path = _saved(tmp_path, "m", seed=0)
    sd = load_file(path / "model.safetensors")
    key = next(k for k in sd if ".rfa." in k and sd[k].is_floating_point())
    sd[key][0] = float("nan")
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        hf_rfa.from_pretrained(str(path), tf.AutoModelForCausalLM)


def test_truncated_safetensors_is_named(tmp_path):
    _, path = _saved(tmp_path, "m", seed=0)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        hf_rfa.from_pretrained(str(path), tf.AutoModelForCausalLM)


def test_missing_folder_or_unreachable_hub_id_is_named(tmp_path, monkeypatch):
    """``hf_rfa.from_pretrained`` of a folder that is not there (an absolute path, or a relative one
    that is also a valid Hub id, offline) names what it was given, not only the Hub's repo-id rules."""
    import huggingface_hub

    import hf_rfa

    missing = str(tmp_path / "nowhere")
    with pytest.raises(OSError, match=f"^'{missing}' is not a local folder, and as a Hub id it could not be loaded: "):
        hf_rfa.from_pretrained(missing)

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder for the specified revision on the local disk")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OSError, match="^'out/smollm2-rfa' is not a local folder, and as a Hub id it could not be loaded: Cannot find"):
        hf_rfa.from_pretrained("out/smollm2-rfa")
