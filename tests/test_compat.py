"""Each private transformers / torch hook of ``hf_rfa.compat`` probed against the installed versions.

A failure here names the internal that changed: update ``hf_rfa/compat.py`` (one place) and the
version range in pyproject.toml.
"""

import inspect

import pytest
import torch
import transformers
from packaging.version import Version

from hf_rfa import compat
from tiny_models import tiny_model

TRANSFORMERS = Version(transformers.__version__)
TORCH = Version(torch.__version__.split("+")[0])


def test_versions_are_the_checked_ones():
    """transformers 5.x below 5.30 and torch >= 2.4: the ranges every hook below was checked on."""
    assert Version("5.0") <= TRANSFORMERS < Version("5.30"), f"hooks checked on transformers {compat.TRANSFORMERS_RANGE}, found {TRANSFORMERS}"
    assert TORCH >= Version("2.4"), f"hooks checked on torch {compat.TORCH_RANGE}, found {TORCH}"


def test_every_hook_is_documented_and_probed_here():
    probed = {"GenerationMixin._prepare_cache_for_generation", "DynamicCache._is_user_defined / DynamicCache.offloading",
              "PretrainedConfig._attn_implementation", "PreTrainedModel._can_set_attn_implementation",
              "inspect.getsource(Attention.forward) contains 'ALL_ATTENTION_FUNCTIONS'",
              "_BaseAutoModelClass._model_mapping._model_mapping", "PreTrainedModel.accepts_loss_kwargs",
              "torch.utils.cpp_extension._get_build_directory",
              "PreTrainedModel.post_init / _keys_to_ignore_on_load_unexpected", "PreTrainedConfig.get_config_dict"}
    assert {h.name for h in compat.HOOKS} == probed
    assert all(h.why and h.used_by and h.library in ("transformers", "torch") for h in compat.HOOKS)


def test_transformers_5_prepare_cache_for_generation_signature():
    """transformers 5.x: ``_prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, ...)``."""
    from transformers.generation.utils import GenerationMixin

    fn = GenerationMixin._prepare_cache_for_generation
    fn = getattr(fn, "__wrapped__", fn)
    params = list(inspect.signature(fn).parameters)
    assert params[:4] == ["self", "generation_config", "model_kwargs", "generation_mode"], params
    assert getattr(GenerationMixin._prepare_cache_for_generation, "_hf_rfa_hook", False)  # installed by import hf_rfa
    assert compat.wrap_prepare_cache_for_generation(lambda *a: None) is False  # idempotent


def test_transformers_5_dynamic_cache_flags():
    """transformers 5.x: a DynamicCache has ``offloading`` and, when passed by the user, ``_is_user_defined``."""
    from transformers.cache_utils import DynamicCache

    c = DynamicCache()
    assert hasattr(c, "offloading") and c.offloading is False
    assert compat.is_default_dynamic_cache(c)
    c._is_user_defined = True
    assert not compat.is_default_dynamic_cache(c)
    assert not compat.is_default_dynamic_cache(object())


def test_transformers_5_attn_implementation_and_can_set():
    """transformers 5.x: ``config._attn_implementation`` holds the selection; PreTrainedModel has
    ``_can_set_attn_implementation``."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation_of(model.config) == "sdpa"
    cfg = type(model.config)()
    compat.preset_attn_implementation(cfg, "eager")
    assert compat.attn_implementation_of(cfg) == "eager"
    assert compat.can_set_attn_implementation(type(model)) is True


def test_transformers_5_attention_forward_names_the_interface():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    assert compat.forward_uses_attention_interface(LlamaAttention)
    assert compat.forward_uses_attention_interface(GPT2Attention)
    assert not compat.forward_uses_attention_interface(LlamaMLP)


def test_transformers_5_auto_class_mapping():
    names = set(compat.auto_class_model_names(transformers.AutoModelForCausalLM))
    assert {"LlamaForCausalLM", "GPT2LMHeadModel"} <= names
    assert "BertModel" in set(compat.auto_class_model_names(transformers.AutoModel))


def test_transformers_5_trainer_reads_accepts_loss_kwargs():
    src = inspect.getsource(transformers.Trainer)
    assert "accepts_loss_kwargs" in src
    m = torch.nn.Linear(1, 1)
    compat.disable_loss_kwargs(m)
    assert m.accepts_loss_kwargs is False


def test_torch_extension_build_dir():
    d = compat.extension_build_dir("hf_rfa_compat_probe")
    assert d.name == "hf_rfa_compat_probe"


def test_transformers_5_post_init_and_unexpected_key_patterns(tmp_path):
    """post_init runs in every model's __init__; a pattern added to the instance's
    _keys_to_ignore_on_load_unexpected keeps matching keys out of the loading report."""
    import torch
    import transformers as tf

    import hf_rfa  # noqa: F401  (installs the post_init wrapper)
    from transformers import PreTrainedModel

    assert getattr(PreTrainedModel.post_init, "_hf_rfa_hook", False)
    cfg = tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model = tf.GPT2LMHeadModel(cfg)
    state = {**model.state_dict(), "transformer.h.0.attn.rfa.extra": torch.zeros(1)}
    from safetensors.torch import save_file

    model.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert "transformer.h.0.attn.rfa.extra" in info["unexpected_keys"]
    original = tf.GPT2LMHeadModel.post_init
    tf.GPT2LMHeadModel.post_init = lambda self: (original(self), compat.ignore_unexpected_keys(self, r"(^|\.)rfa\."))[0]
    try:
        _, info = tf.GPT2LMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    finally:
        del tf.GPT2LMHeadModel.post_init
    assert not info["unexpected_keys"]


def test_transformers_5_get_config_dict_is_the_reader_behind_auto_config(tmp_path):
    """transformers 5.x: ``AutoConfig`` and the config classes read config.json through
    ``PreTrainedConfig.get_config_dict`` (wrapped by import hf_rfa: a marked model type reads back)."""
    import json

    from transformers import AutoConfig, LlamaConfig, PretrainedConfig

    assert getattr(PretrainedConfig.get_config_dict.__func__, "_hf_rfa_hook", False)
    assert compat.wrap_get_config_dict(lambda cls, d: d) is False  # idempotent
    tiny_model("llama").config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "hf_rfa_llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert type(AutoConfig.from_pretrained(tmp_path)) is LlamaConfig
    assert LlamaConfig.get_config_dict(str(tmp_path))[0]["model_type"] == "llama"
