"""PEFT helpers: LoRA on the stock target names with the feature maps trained and saved too."""

from __future__ import annotations

import logging
import warnings

from torch import nn

logger = logging.getLogger(__name__)

#: LoRA targets per ``config.model_type`` (attention projections under their stock names)
LORA_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "phi3": ["qkv_proj", "o_proj"],
    "gpt2": ["attn.c_attn", "attn.c_proj"],
    "bert": ["query", "key", "value", "attention.output.dense"],
    "roberta": ["query", "key", "value", "attention.output.dense"],
}
#: model types whose projections are transformers' Conv1D (weights stored transposed)
FAN_IN_FAN_OUT = {"gpt2"}


def lora_targets(model: nn.Module) -> list[str]:
    """Stock LoRA target names of the model's attention; ValueError for unknown architectures."""
    mt = getattr(model.config, "model_type", None)
    if mt not in LORA_TARGETS:
        raise ValueError(f"no default LoRA targets for model_type={mt!r}; known: {sorted(LORA_TARGETS)}; pass target_modules=")
    return list(LORA_TARGETS[mt])


def lora_config(
    model: nn.Module,
    r: int = 8,
    alpha: int | None = None,
    dropout: float = 0.0,
    target_modules: list[str] | None = None,
    train_feature_maps: bool = True,
    task_type: str | None = None,
    modules_to_save: list[str] | None = None,
):
    """A ``peft.LoraConfig`` for a converted model.

    Targets the stock attention projections of the architecture (``LORA_TARGETS``; GPT-2's
    Conv1D with ``fan_in_fan_out=True``) and puts the ``rfa`` modules in ``modules_to_save`` so
    learned feature maps are trained and saved with the adapter (random projections travel too).
    """
    from peft import LoraConfig

    if r <= 0:
        raise ValueError(f"r must be a positive int, got {r}")
    targets = target_modules or lora_targets(model)
    save = list(modules_to_save or [])
    if train_feature_maps:
        save.append("rfa")
    return LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=targets,
        fan_in_fan_out=getattr(model.config, "model_type", None) in FAN_IN_FAN_OUT,
        modules_to_save=save or None,
        task_type=task_type,
    )


def wrap_with_lora(model: nn.Module, config) -> nn.Module:
    """PEFT's ``get_peft_model(model, config)``, without the FutureWarning it sets off on
    transformers >= 5.25: PEFT reads ``model.is_gradient_checkpointing``, which transformers now
    names ``is_activation_checkpointing``; nothing a user can act on, so every LoRA stage printed it."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)
