"""Attach random feature attention to a transformers model; redraw; save/load round trip.

``convert(model, RFAConfig(...))`` finds every self-attention module that goes through
transformers' attention interface, attaches an :class:`~hf_rfa.attention.RFAAttention` child
(``module.rfa``) built for that layer, stores the config in ``model.config.rfa_config`` and
switches the model to ``attn_implementation="rfa"``. ``from_pretrained`` re-attaches before
loading the saved projections and learned parameters, so a round trip gives identical logits.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from torch import nn

from .. import compat
from .attention import ATTN_NAME, RFAAttention, register
from .rope import install_rope_hook, rotary_modules, takes_position_embeddings
from .checkpoint import _resolve_dir, check_loaded_rfa, checkpoint_files, load_rfa_state, report_unexpected_rfa_keys, verify_safetensors  # noqa: F401 (re-exported)
from ..config import CONFIG_ATTR, RFAConfig
from ..feature_maps import FeatureMap, build_feature_map, derive_seed
from ..ops.spec import AttentionSpec

logger = logging.getLogger(__name__)

#: set while hf_rfa.from_pretrained loads: the load hook (:mod:`.loading`) leaves conversion to it
_BYPASS_LOAD_HOOK: ContextVar[bool] = ContextVar("hf_rfa_bypass_load_hook", default=False)


@contextmanager
def bypass_load_hook() -> Iterator[None]:
    """``from_pretrained`` inside this block leaves conversion to the caller (no load hook)."""
    token = _BYPASS_LOAD_HOOK.set(True)
    try:
        yield
    finally:
        _BYPASS_LOAD_HOOK.reset(token)


def _uses_attention_interface(module: nn.Module) -> bool:
    return compat.forward_uses_attention_interface(type(module))


#: module-name fragments of cross-attention (kept exact: not converted)
_CROSS_NAMES = ("crossattention", "encdecattention", "encoder_attn", "cross_attn")


def _is_cross_attention(name: str, module: nn.Module) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or "Cross" in type(module).__name__ or any(c in name.lower() for c in _CROSS_NAMES)


def _sliding_window(module: nn.Module) -> str | None:
    window = getattr(module, "sliding_window") if hasattr(module, "sliding_window") else getattr(getattr(module, "config", None), "sliding_window", None)
    return f"sliding-window attention (sliding_window={window})" if window is not None else None


def _soft_capping(module: nn.Module) -> str | None:
    cap = getattr(module, "attn_logit_softcapping", None)
    return f"attention-logit soft-capping (attn_logit_softcapping={cap})" if cap is not None else None


def _learned_sinks(module: nn.Module) -> str | None:
    return "learned attention sinks (a per-head sink logit)" if isinstance(getattr(module, "sinks", None), torch.Tensor) else None


def _relative_bias(module: nn.Module) -> str | None:
    if hasattr(module, "has_relative_attention_bias") or hasattr(module, "relative_attention_bias"):
        return "a relative position bias added to the scores (T5-style)"
    return None


def _layer_type(module: nn.Module) -> str | None:
    """A layer type other than full attention in ``config.layer_types`` (Llama-4's
    ``chunked_attention``: each token sees only its own chunk of ``attention_chunk_size``)."""
    cfg, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(cfg, "layer_types", None)
    kind = types[idx] if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types) else None
    if kind in (None, "full_attention", "sliding_attention"):  # sliding: named by _sliding_window
        chunk = getattr(cfg, "attention_chunk_size", None)
        return f"chunked attention (attention_chunk_size={chunk})" if chunk is not None and types is None else None
    return f"{kind} layers (layer_types)" + (f", attention_chunk_size={cfg.attention_chunk_size}" if getattr(cfg, "attention_chunk_size", None) else "")


def _dynamic_mask(module: nn.Module) -> str | None:
    if isinstance(getattr(module, "dt_proj", None), nn.Module):
        return "dynamic mask attention (a learned per-key mask from dt_proj, Doge-style)"
    return None


#: what random feature attention does not reproduce: each check returns the reason or None
UNSUPPORTED_CHECKS = (_sliding_window, _soft_capping, _learned_sinks, _relative_bias, _layer_type, _dynamic_mask)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why converting this attention module would change its attention beyond the feature-map
    approximation (``window >= N`` would no longer be exact), or None when it can be converted."""
    return next((r for check in UNSUPPORTED_CHECKS if (r := check(module)) is not None), None)


def find_attention_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """Self-attention modules on the attention interface: ``[(name, module, layer_idx)]``.

    ``layer_idx`` is the module's own ``layer_idx`` where it has one, else its order.
    """
    found = []
    for name, module in model.named_modules():
        if isinstance(module, RFAAttention) or not _uses_attention_interface(module):
            continue
        if _is_cross_attention(name, module):
            continue
        found.append((name, module))
    out = []
    for order, (name, module) in enumerate(found):
        idx = getattr(module, "layer_idx", None)
        out.append((name, module, idx if isinstance(idx, int) else order))
    return out


def _head_sizes(model: nn.Module, module: nn.Module) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim) of an attention module."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(cfg, "num_attention_heads", None)
    if heads is None:
        raise ValueError(f"cannot tell the number of attention heads of {type(model).__name__} from its config")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None)
    if head_dim is None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return int(heads), int(kv), int(head_dim)


def build_layer(config: RFAConfig, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> RFAAttention:
    """The :class:`RFAAttention` of one layer: its feature map seeded from ``(seed, layer)``."""
    options = dict(config.feature_map_options)
    if config.feature_map == "rfa":
        options["gate"] = config.gate
    options.setdefault("num_heads", num_heads)
    options.setdefault("num_kv_heads", num_kv_heads)
    fm = build_feature_map(
        config.feature_map, head_dim=head_dim, num_features=config.num_features,
        seed=derive_seed(config.seed, "layer", layer_idx), **options,
    )
    if config.decay > 0:
        fm.enable_decay(config.decay)
    return RFAAttention(fm, AttentionSpec.from_config(config, layer_idx), layer_idx=layer_idx)


def convert(model: nn.Module, config: RFAConfig | None = None, **overrides: Any) -> nn.Module:
    """Replace softmax attention of ``model`` by random feature attention, in place; returns it.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention uses the attention interface.
        config: an :class:`RFAConfig` (default ``RFAConfig()``); ``**overrides`` edit its fields.
    Raises:
        TypeError: ``config`` is not an :class:`RFAConfig` (a preset name: ``RFAConfig.from_preset(name)``).
        ValueError: the model has no attention on transformers' attention interface (names its
            class), ``config.layers`` names layers the model does not have, or a layer to convert
            uses something the feature attention drops (a sliding window, logit soft-capping,
            learned sinks, a relative position bias: :func:`unsupported_reason` names it).
            Cross-attention is never converted (it stays exact).
    """
    register()
    if config is not None and not isinstance(config, RFAConfig):
        hint = f"hf_rfa.RFAConfig.from_preset({config!r})" if isinstance(config, str) else "hf_rfa.RFAConfig(...)"
        raise TypeError(f"config must be an RFAConfig, got {type(config).__name__} {config!r}: pass {hint}")
    if config is None:
        config = RFAConfig(**overrides)
    elif overrides:
        config = RFAConfig.from_dict({**config.to_dict(), **overrides})
    if not hasattr(model, "config"):
        raise ValueError(f"{type(model).__name__} is not a transformers model (no .config)")
    modules = find_attention_modules(model)
    if not modules or compat.can_set_attn_implementation(type(model)) is False:
        raise ValueError(
            f"{type(model).__name__}: no self-attention module goes through transformers' attention "
            "interface (ALL_ATTENTION_FUNCTIONS.get_interface), so its attention cannot be swapped; "
            "supported are models such as BERT, GPT-2, Llama, Mistral, Qwen2, Gemma"
        )
    present = {idx for _, _, idx in modules}
    if config.layers is not None and not set(config.layers) <= present:
        raise ValueError(f"layers {sorted(set(config.layers) - present)} not in the model (it has layers {sorted(present)})")
    # every layer counts: the ones left unconverted run hf_rfa's plain softmax (exact_attention)
    refused = [(name, idx, r) for name, module, idx in modules if (r := unsupported_reason(module))]
    if refused:
        name, idx, reason = refused[0]
        raise ValueError(
            f"{type(model).__name__}: layer {idx} ({name}) uses {reason}, which hf_rfa's attention does not "
            f"reproduce ({len(refused)} such layer(s)); refusing to convert rather than change the model's attention silently"
        )
    _check_memory_per_layer(config, [idx for _, _, idx in modules if config.converts_layer(idx)])
    if config.any_memory or config.decay > 0:
        bidir = [idx for _, module, idx in modules if config.converts_layer(idx) and getattr(module, "is_causal", True) is False]
        if bidir and config.any_memory:
            raise ValueError(f"memory={config.memory}: the exact memory needs causal attention, but layer(s) {bidir} of {type(model).__name__} are bidirectional (use memory=0)")
        if bidir:
            raise ValueError(f"decay={config.decay:g}: a decay of the feature state needs causal attention, but layer(s) {bidir} of {type(model).__name__} are bidirectional (use decay=0)")
    if config.feature_input == "unrotated":
        plain = [idx for _, module, idx in modules if config.converts_layer(idx) and not takes_position_embeddings(module)]
        if plain:
            raise ValueError(
                f"feature_input='unrotated' needs rotary position embeddings, but the attention of layer(s) {plain} of "
                f"{type(model).__name__} takes no position_embeddings (no rotary embedding to undo); use feature_input='rotated'"
            )
    for _name, module in model.named_modules():  # cross-attention and unselected layers: exact on purpose
        if _uses_attention_interface(module):
            module._hf_rfa_converted = True
    converted = 0
    for _name, module, idx in modules:
        if hasattr(module, "rfa"):
            del module.rfa
        if not config.converts_layer(idx):
            continue
        heads, kv, head_dim = _head_sizes(model, module)
        ref = next(module.parameters(), None)
        layer = build_layer(config, idx, heads, kv, head_dim)
        if ref is not None:
            layer = layer.to(device=ref.device)
        module.rfa = layer
        if config.feature_input == "unrotated":
            install_rope_hook(module)
        converted += 1
    setattr(model.config, CONFIG_ATTR, config.to_dict())
    _attach_memory_rope(model, config)
    model.set_attn_implementation(ATTN_NAME)
    logger.info("converted %d of %d attention layers of %s to %s", converted, len(modules), type(model).__name__, config.feature_map)
    return model


def _check_memory_per_layer(config: RFAConfig, converted: list[int]) -> None:
    """ValueError unless ``config.memory_per_layer`` (when given) has an entry for every converted layer."""
    per = config.memory_per_layer
    if per is not None and converted and max(converted) >= len(per):
        raise ValueError(f"memory_per_layer has {len(per)} entries but the model converts layers up to {max(converted)}: give one size per layer")


def _attach_memory_rope(model: nn.Module, config: RFAConfig) -> None:
    """Give every converted layer the model's rotary embedding, which its ``memory_rope`` reads at
    ``memory_distance`` when first needed and an ``RFACache`` recomputes its memory keys'
    rotations with (the weights may still be on the meta device here)."""
    rotary = rotary_modules(model)  # (also what an RFACache recomputes its memory keys' rotations with)
    if config.memory_distance > 0 and not rotary:
        raise ValueError(f"memory_distance={config.memory_distance}: {type(model).__name__} has no rotary embedding module (*RotaryEmbedding) to rotate by")
    for module in model.modules():
        if isinstance(module, RFAAttention):
            module.rotary = rotary


def rfa_config_of(model: nn.Module) -> RFAConfig | None:
    """The :class:`RFAConfig` stored in ``model.config`` (None if not converted)."""
    cfg = getattr(model, "config", None)
    d = getattr(cfg, CONFIG_ATTR, None)
    return RFAConfig.from_dict(d) if d else None


def feature_maps(model: nn.Module) -> Iterator[FeatureMap]:
    """Every feature map in the model (including copies made by PEFT's ``modules_to_save``)."""
    for m in model.modules():
        if isinstance(m, FeatureMap):
            yield m


@torch.no_grad()
def redraw(model: nn.Module, step: int) -> int:
    """Redraw the projections of every feature map from ``(seed, layer, step)``; returns the count.

    Maps with trained projections (``learnable=True``) are left as they are (not counted).
    ``step``: an int >= 0 (ValueError otherwise: a bool, a float, a string, a negative step)."""
    from ..ops.masks import check_int

    check_int("redraw step", step, 0, 2**63 - 1)
    n = 0
    for fm in feature_maps(model):
        if getattr(fm, "learnable", False):
            continue
        fm.redraw(step)
        n += 1
    return n


def from_pretrained(name_or_path: str | os.PathLike, model_class: type[nn.Module] | None = None, **kwargs: Any) -> nn.Module:
    """Load a checkpoint saved from a converted model (local folder or Hub id).

    Reads ``rfa_config`` from its config, loads the base weights with ``model_class`` (default:
    the class named in ``config.architectures``), re-attaches the RFA modules, then loads the
    saved projections and learned parameters — logits are identical to the saved model's.
    """
    from transformers import AutoConfig

    register()
    hub_kwargs = {k: kwargs[k] for k in ("revision", "token", "cache_dir") if k in kwargs}
    path = _resolve_dir(os.fspath(name_or_path), **hub_kwargs)
    cfg = AutoConfig.from_pretrained(path)
    d = getattr(cfg, CONFIG_ATTR, None)
    if not d:
        raise ValueError(f"{name_or_path} has no '{CONFIG_ATTR}' in its config.json: not a converted hf_rfa checkpoint (use hf_rfa.convert)")
    rfa_cfg = RFAConfig.from_dict(d)
    if model_class is None:
        import transformers

        arch = (cfg.architectures or [None])[0]
        model_class = getattr(transformers, arch, None) if arch else None
        if model_class is None:
            raise ValueError(f"cannot tell the model class of {name_or_path}; pass model_class=")
    verify_safetensors(path)
    with bypass_load_hook():  # the rfa.* keys are ignored on load (post_init hook); loaded below
        model = model_class.from_pretrained(path, attn_implementation=ATTN_NAME, **kwargs)
    convert(model, rfa_cfg)
    load_rfa_state(model, path)
    return model
