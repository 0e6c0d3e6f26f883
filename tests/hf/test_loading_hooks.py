"""Stock loaders with hf_rfa imported: converted folders load converted, nothing runs softmax in silence."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_rfa
from hf_rfa.hf.loading import ADAPTER_RFA_CONFIG
from tiny_models import batch, tiny_model

CFG = hf_rfa.RFAConfig(feature_map="favor+", num_features=32, seed=3)


def _logits(model, family="llama"):
    ids, mask = batch(family)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_rfa_on_unconverted_checkpoint_raises(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"hf_rfa\.convert"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="rfa")


def test_set_attn_implementation_rfa_without_convert_raises():
    model = tiny_model("llama")
    model.set_attn_implementation("rfa")
    with pytest.raises(ValueError, match=r"hf_rfa\.convert"):
        _logits(model)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_plain_from_pretrained_of_converted_folder_loads_converted(tmp_path, family):
    model = hf_rfa.convert(tiny_model(family), CFG)
    softmax = _logits(tiny_model(family), family)
    want = _logits(model, family)
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert hf_rfa.rfa_config_of(loaded) == CFG
    assert not info["unexpected_keys"], info["unexpected_keys"]
    got = _logits(loaded, family)
    assert torch.equal(got, want)
    assert (got - softmax).abs().max() > 1e-4  # really not softmax


def test_hf_rfa_from_pretrained_unchanged(tmp_path):
    model = hf_rfa.convert(tiny_model("llama"), CFG)
    model.save_pretrained(tmp_path)
    assert torch.equal(_logits(hf_rfa.from_pretrained(str(tmp_path))), _logits(model))


def _trained_adapter(tmp_path):
    from hf_rfa.recipes.training.peft_utils import lora_config
    from hf_rfa.recipes.training.modeling import save_final
    from peft import get_peft_model

    base_dir = tmp_path / "base"
    tiny_model("llama").save_pretrained(base_dir)
    model = hf_rfa.convert(AutoModelForCausalLM.from_pretrained(base_dir), CFG)
    model = get_peft_model(model, lora_config(model, r=4, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # stands in for training: LoRA B and the rfa copies move
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    want = _logits(model)
    save_final(model, None, str(tmp_path / "final"))
    return tmp_path / "final" / "adapter", want


def test_stock_auto_peft_loader_converts_base(tmp_path):
    from peft import AutoPeftModelForCausalLM

    adapter, want = _trained_adapter(tmp_path)
    assert (adapter / ADAPTER_RFA_CONFIG).is_file()
    loaded = AutoPeftModelForCausalLM.from_pretrained(adapter)
    assert torch.allclose(_logits(loaded), want, atol=1e-6, rtol=0)


def test_stock_auto_peft_loader_without_rfa_config_raises(tmp_path):
    from peft import AutoPeftModelForCausalLM

    adapter, _ = _trained_adapter(tmp_path)
    (adapter / ADAPTER_RFA_CONFIG).unlink()
    with pytest.raises(ValueError, match="rfa"):
        AutoPeftModelForCausalLM.from_pretrained(adapter)


def test_peft_own_save_pretrained_writes_the_rfa_files(tmp_path):
    """PEFT's save_pretrained of an adapter on a converted model saves rfa_config.json and the RFA tensors."""
    from peft import LoraConfig, get_peft_model

    from hf_rfa.hf.loading import ADAPTER_RFA_STATE

    model = get_peft_model(hf_rfa.convert(tiny_model("llama"), CFG), LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path)
    assert hf_rfa.RFAConfig.from_dict(__import__("json").loads((tmp_path / ADAPTER_RFA_CONFIG).read_text())) == CFG
    assert (tmp_path / ADAPTER_RFA_STATE).is_file()


def test_adapter_on_a_base_converted_otherwise_is_refused(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    get_peft_model(hf_rfa.convert(tiny_model("llama"), CFG), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path)
    other = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=16, seed=3))
    with pytest.raises(ValueError, match="num_features"):
        PeftModel.from_pretrained(other, tmp_path)
