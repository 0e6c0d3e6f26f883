"""Settings of a converted model that involve no parameters, changed in place: :func:`reconfigure`
(the window, the sinks, the exact memory, chunking, backend: :data:`RUNTIME_FIELDS`),
:func:`set_memory` (the memory's four fields), and :func:`parse_runtime_settings` (``--rfa
FIELD=VALUE`` on command lines)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .attention import RFAAttention
from .convert import _attach_memory_rope, _check_memory_per_layer, find_attention_modules, rfa_config_of
from ..config import CONFIG_ATTR, RFAConfig
from ..ops.spec import AttentionSpec

logger = logging.getLogger(__name__)


#: ``RFAConfig`` fields that set how a converted layer attends without touching its parameters:
#: :func:`reconfigure` changes them on a trained model (the feature maps, decay and weights stay)
RUNTIME_FIELDS = ("window", "sinks", "memory", "memory_every", "memory_score", "memory_per_layer", "memory_distance", "chunk_size", "checkpoint_blocks", "backend")


def reconfigure(model: nn.Module, **changes: Any) -> nn.Module:
    """Change a converted model's attention settings that involve no parameters, in place; returns it.

    ``changes``: :data:`RUNTIME_FIELDS` only (the window, the sinks, the exact memory, chunking and
    backend) — the trained feature maps, decay rates and weights stay, so e.g. a model trained with a
    window of 64 and a memory of 256 can be evaluated with a memory of 1,024::

        hf_rfa.reconfigure(model, memory=1024)
        hf_rfa.reconfigure(model, window=1088, memory=0)

    The new settings are validated as :class:`RFAConfig` fields (``ValueError`` naming the field),
    written to every converted layer (PEFT's ``modules_to_save`` copies too) and to
    ``model.config.rfa_config``, so they travel with ``save_pretrained``. A field that shapes the
    parameters (``feature_map``, ``num_features``, ...), a model that was not converted, and a memory
    on bidirectional layers are refused with ``ValueError``."""
    old = rfa_config_of(model)
    if old is None:
        raise ValueError(f"{type(model).__name__} is not converted (no rfa_config): call hf_rfa.convert first")
    bad = sorted(k for k in changes if k not in RUNTIME_FIELDS)
    if bad:
        raise ValueError(f"cannot change {bad} of a converted model (they shape its parameters or are not RFAConfig fields); "
                         f"the settings that can change are {list(RUNTIME_FIELDS)}")
    config = RFAConfig.from_dict({**old.to_dict(), **changes})
    layers = [(idx, module) for _, module, idx in find_attention_modules(model) if hasattr(module, "rfa")]
    _check_memory_per_layer(config, [idx for idx, _ in layers])
    bidir = [idx for idx, module in layers if getattr(module, "is_causal", True) is False]
    if bidir and config.any_memory:
        raise ValueError(f"memory={config.memory}: the exact memory needs causal attention, but layer(s) {bidir} of {type(model).__name__} are bidirectional (use memory=0)")
    touched = {f for f in changes if f in AttentionSpec.__dataclass_fields__} | ({"memory"} if "memory_per_layer" in changes else set())
    for module in model.modules():  # PEFT's modules_to_save copies too
        if isinstance(module, RFAAttention):
            new = AttentionSpec.from_config(config, module.layer_idx)
            module.spec = module.spec.replace(**{f: getattr(new, f) for f in touched})
    setattr(model.config, CONFIG_ATTR, config.to_dict())
    _attach_memory_rope(model, config)
    logger.debug("%s reconfigured: %s", type(model).__name__, {k: getattr(config, k) for k in changes})
    return model


def parse_runtime_settings(items: list[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` strings (command lines: ``--rfa window=1088 memory=0``) as :func:`reconfigure`'s
    keywords, typed: integers; ``checkpoint_blocks`` true/false; ``memory_per_layer`` comma-separated
    integers or ``none``; ``memory_score`` and ``backend`` as given (validated by :func:`reconfigure`)."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or name not in RUNTIME_FIELDS:
            raise ValueError(f"--rfa takes FIELD=VALUE with FIELD one of {list(RUNTIME_FIELDS)}, got {item!r}")
        try:
            if name in ("memory_score", "backend"):
                out[name] = value
            elif name == "checkpoint_blocks":
                out[name] = {"true": True, "false": False}[value.lower()]
            elif name == "memory_per_layer":
                out[name] = None if value.lower() in ("", "none") else [int(v) for v in value.split(",")]
            else:
                out[name] = int(value)
        except (ValueError, KeyError):
            kind = {"checkpoint_blocks": "true or false", "memory_per_layer": "comma-separated integers or none"}.get(name, "an integer")
            raise ValueError(f"--rfa {name} takes {kind}, got {value!r}") from None
    return out


def set_memory(model: nn.Module, memory: int, memory_every: int = 64, memory_score: str = "value_norm", per_layer: list[int] | None = None) -> nn.Module:
    """Switch a converted model's exact global memory on, off (``memory=0``) or to other settings,
    in place (no parameters are involved: the trained feature maps and weights stay); returns it.

    :func:`reconfigure` with the memory's four fields: validated as :class:`RFAConfig` fields
    (``ValueError`` naming the field), written to every converted layer and to
    ``model.config.rfa_config`` (so they travel with ``save_pretrained``). A model that was not
    converted, or has bidirectional converted layers (the memory needs causal attention), is refused
    with ``ValueError``. E.g. a model trained without memory, then given one for long-range recall::

        hf_rfa.set_memory(model, 128, memory_score="feature_error")

    ``per_layer``: one memory size per layer (``RFAConfig.memory_per_layer``; it overrides
    ``memory`` layer by layer), e.g. budgets in proportion to each layer's attention beyond the window.
    """
    reconfigure(model, memory=memory, memory_every=memory_every, memory_score=memory_score, memory_per_layer=per_layer)
    logger.info("exact memory of %s: %d keys per kv head, re-chosen every %d positions, ranked by %s", type(model).__name__, memory, memory_every, memory_score)
    return model


__all__ = ["RUNTIME_FIELDS", "parse_runtime_settings", "reconfigure", "set_memory"]
