"""Undoing the rotary position embedding, for feature maps that read position-free q/k.

Models with rotary embeddings (Llama, Mistral, Qwen2, ...) rotate q and k by their absolute
positions before the attention function sees them. ``RFAConfig(feature_input="unrotated")``
lets the feature part read q/k *before* that rotation (a map learned on rotated q/k only knows
the positions it was trained at). The attention module's forward receives ``position_embeddings
= (cos, sin)``; a forward pre-hook (:func:`install_rope_hook`) keeps them on the module for the
attention function, which hands them to the op (``random_feature_attention(feature_rope=(cos,
sin))``; the op undoes the rotation with :func:`unrotate`, block by block in training so that no
un-rotated copy is kept for backward). Cached decoding
(``hf_rfa.hf.cache``) keeps only the rotated window and un-rotates it again where needed, with the
rotations of the last ``W`` positions kept once per cache (``RopeRing``).

Convention: transformers' ``apply_rotary_pos_emb`` with ``rotate_half`` (the two halves of the
first ``Dr = cos.shape[-1]`` dims form the rotated pairs; dims beyond ``Dr`` are not rotated).
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

from ..ops.rotary import unrotate

logger = logging.getLogger(__name__)

#: attribute of the attention module holding the last forward's ``(cos, sin)`` (or None)
ROPE_ATTR = "_hf_rfa_rope"


def takes_position_embeddings(module: nn.Module) -> bool:
    """True when ``module.forward`` has a ``position_embeddings`` argument (rotary models)."""
    try:
        return "position_embeddings" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _keep_rope(module: nn.Module, args: tuple, kwargs: dict) -> None:
    pe = kwargs.get("position_embeddings")
    if pe is None and len(args) > 1 and isinstance(args[1], (tuple, list)):
        pe = args[1]  # forward(hidden_states, position_embeddings, ...) called positionally
    setattr(module, ROPE_ATTR, tuple(pe) if pe is not None else None)


def install_rope_hook(module: nn.Module) -> None:
    """Keep each forward's ``position_embeddings`` on ``module`` (idempotent)."""
    if getattr(module, "_hf_rfa_rope_hook", None) is None:
        module._hf_rfa_rope_hook = module.register_forward_pre_hook(_keep_rope, with_kwargs=True)
    setattr(module, ROPE_ATTR, None)


def rotary_modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """``model``'s rotary embedding modules (class name ending in ``RotaryEmbedding``, called as
    ``forward(x, position_ids)``)."""
    return tuple(m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding"))


def rotation_at(model: nn.Module | tuple, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[Dr]`` (float32, on the module's device) of ``position`` from ``model``'s
    rotary embedding (:func:`rotary_modules`, or those modules given as a tuple). ValueError when
    there is none, or several that disagree at ``position``."""
    mods = rotary_modules(model) if isinstance(model, nn.Module) else tuple(model)
    found = []
    for module in mods:
        ref = next(iter(module.buffers()), None)
        x = torch.zeros(1, dtype=torch.float32, device=ref.device if ref is not None else "cpu")
        with torch.no_grad():
            cos, sin = module(x, torch.tensor([[int(position)]], device=x.device))
        found.append((cos.reshape(-1, cos.shape[-1])[0].float(), sin.reshape(-1, sin.shape[-1])[0].float()))
    name = type(model).__name__ if isinstance(model, nn.Module) else "the model"
    if not found:
        raise ValueError(f"memory_distance={position}: {name} has no rotary embedding module (*RotaryEmbedding) to rotate by")
    if any(c.shape != found[0][0].shape or not (torch.equal(c, found[0][0]) and torch.equal(s, found[0][1])) for c, s in found[1:]):
        raise ValueError(f"memory_distance={position}: {name}'s {len(found)} rotary embeddings differ at that position; one is supported")
    return found[0]


def clamp_memory_distance(model: nn.Module) -> int:
    """Set a converted model's ``memory_distance`` to its ``max_position_embeddings`` − 1 where that
    applies (an exact memory, the feature part on un-rotated q/k, a rotary embedding, no clamp set
    yet): past its trained positions the memory's keys are read at the farthest distance it was
    trained on, and within them nothing changes. Returns the distance set (0: none)."""
    from .convert import rfa_config_of  # (convert imports this module)
    from .runtime import reconfigure

    cfg, limit = rfa_config_of(model), getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if cfg is None or not cfg.any_memory or cfg.feature_input != "unrotated" or cfg.memory_distance or not isinstance(limit, int) or limit < 2:
        return 0
    if not rotary_modules(model):
        return 0
    reconfigure(model, memory_distance=limit - 1)
    logger.info("memory keys farther back than %d positions (max_position_embeddings - 1) are read as if that far", limit - 1)
    return limit - 1


def checked_rope(pe: tuple[torch.Tensor, torch.Tensor] | None, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pe = (cos, sin)`` of this forward (the module's :data:`ROPE_ATTR`), checked against the
    attention call's query/key ``[B, H, N, D]``.

    Raises ValueError when ``pe`` is None (the module's forward got no ``position_embeddings``)
    or does not cover the query/key positions (e.g. a cache that hands back every past key)."""
    if pe is None:
        raise ValueError(
            "feature_input='unrotated': the attention module's forward got no position_embeddings, so the rotary "
            "embedding cannot be undone; convert with feature_input='rotated'"
        )
    cos, sin = pe
    n = cos.shape[-2]
    if query.shape[2] != n or key.shape[2] != n:
        raise ValueError(
            f"feature_input='unrotated': position_embeddings cover {n} positions but the attention got {query.shape[2]} "
            f"queries and {key.shape[2]} keys (use hf_rfa's RFACache for generation, not a cache that returns every past key)"
        )
    if cos.shape[-1] > query.shape[-1] or cos.shape[-1] % 2:
        raise ValueError(f"feature_input='unrotated': rotary dim {cos.shape[-1]} does not fit head dim {query.shape[-1]}")
    return cos, sin


def unrotated_qk(pe: tuple[torch.Tensor, torch.Tensor] | None, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query, key)`` of an attention call with the rotary embedding ``pe = (cos, sin)`` of this
    forward (the module's :data:`ROPE_ATTR`) undone (ValueError as :func:`checked_rope`)."""
    cos, sin = checked_rope(pe, query, key)
    return unrotate(query, cos, sin), unrotate(key, cos, sin)


__all__ = ["ROPE_ATTR", "checked_rope", "clamp_memory_distance", "rotary_modules", "rotation_at", "install_rope_hook", "takes_position_embeddings", "unrotate", "unrotated_qk"]
