"""The transformers side: the ``"rfa"`` attention function, its mask function, the per-layer module.

Registered on import of ``hf_rfa``::

    AttentionInterface.register("rfa", rfa_attention_forward)
    AttentionMaskInterface.register("rfa", rfa_mask)

The mask function hands the attention the 2-D padding mask ``[B, Nk]`` (never an N×N mask, and
never ``None`` when the batch is padded — without it transformers silently drops padding).
Converted self-attention modules carry an :class:`RFAAttention` child ``module.rfa``; modules
without one (layers not selected, cross-attention) run exact softmax attention.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..feature_maps import FeatureMap
from ..ops import attend
from ..ops.spec import AttentionSpec
from .rope import ROPE_ATTR, checked_rope, rotation_at, unrotate

logger = logging.getLogger(__name__)

ATTN_NAME = "rfa"
#: attention kwarg that overrides the layer's ``backend`` for one call (the recipes' training
#: attention sets ``"auto"`` for a layer whose backend runs without autograd only)
BACKEND_KWARG = "rfa_backend"


def _spec_field(name: str) -> property:
    """``RFAAttention.<name>``: the field of its spec; setting it replaces the spec (validated again)."""

    def set_field(self, value) -> None:
        self.spec = self.spec.replace(**{name: value})

    return property(lambda self: getattr(self.spec, name), set_field, doc=f"``spec.{name}`` (setting it replaces the spec, validated again)")


class RFAAttention(nn.Module):
    """Per-layer random feature attention: a feature map plus the hybrid settings.

    Holds projections as buffers and learned parameters as parameters (saved with the model
    under ``<attention module>.rfa.feature_map.*``). Called by :func:`rfa_attention_forward`;
    PEFT's ``modules_to_save`` may wrap it, which is why the attention function *calls* it.
    """

    def __init__(self, feature_map: FeatureMap, spec: AttentionSpec | None = None, layer_idx: int = 0, **settings) -> None:
        """``spec``: the layer's :class:`~hf_rfa.ops.spec.AttentionSpec` (``AttentionSpec.from_config``
        of the model's ``RFAConfig``), or its fields as keywords (``window=4, sinks=1``, ...), not both."""
        super().__init__()
        if spec is not None and settings:
            raise ValueError(f"give the settings as spec= or as keywords, not both (got spec and {sorted(settings)})")
        if spec is not None and not isinstance(spec, AttentionSpec):
            raise ValueError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
        self.feature_map = feature_map
        self.spec = spec if spec is not None else AttentionSpec(**settings)
        self.layer_idx = int(layer_idx)
        #: the model's rotary embedding module(s), a plain tuple (not submodules; set by ``hf_rfa.convert``)
        self.rotary: tuple = ()
        self._memory_rope: tuple = (None, None)  # (key, (cos, sin))

    window = _spec_field("window")
    sinks = _spec_field("sinks")
    chunk_size = _spec_field("chunk_size")
    checkpoint_blocks = _spec_field("checkpoint_blocks")
    backend = _spec_field("backend")
    memory = _spec_field("memory")
    memory_every = _spec_field("memory_every")
    memory_score = _spec_field("memory_score")
    feature_input = _spec_field("feature_input")
    memory_distance = _spec_field("memory_distance")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        causal: bool,
        scale: float | None,
        **kwargs,
    ) -> torch.Tensor:
        """q ``[B, H, Nq, D]``, k/v ``[B, Hkv, Nk, D]``, mask ``[B, Nk]`` → ``[B, H, Nq, Dv]``.

        ``feature_input="unrotated"``: ``kwargs["rfa_rope"]`` is the forward's ``(cos, sin)``; the
        feature part reads q/k with it undone (:mod:`hf_rfa.hf.rope`). With an ``RFACache`` the
        cache layer gets the un-rotated queries and ``(cos, sin)`` and un-rotates the keys it needs
        itself (its state keeps the rotated window only). ``kwargs[BACKEND_KWARG]``: a backend for
        this call instead of the layer's. Under autocast q/k/v go to the autocast dtype first
        (:func:`autocast_inputs`)."""
        query, key, value = autocast_inputs(query, key, value)
        backend = kwargs.get(BACKEND_KWARG) or self.backend
        rope = None
        cache = kwargs.get("rfa_cache_layer")
        if self.feature_input == "unrotated":
            if cache is not None:
                cos, sin = checked_rope(kwargs.get("rfa_rope"), query, key)
                return cache.attend(self, query, key, value, attention_mask, causal, scale, feature_q=unrotate(query, cos, sin), rope=(cos, sin))
            rope = checked_rope(kwargs.get("rfa_rope"), query, key)  # undone inside the op (block by block in training)
        if cache is not None:
            return cache.attend(self, query, key, value, attention_mask, causal, scale)
        spec = self.spec if backend == self.spec.backend else self.spec.replace(backend=backend)
        return attend(query, key, value, self.feature_map, spec, causal=causal, attention_mask=attention_mask, scale=scale, feature_rope=rope, memory_rope=self.memory_rope)

    @property
    def memory_rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, sin)`` ``[Dr]`` of position ``memory_distance`` from the model's rotary embedding
        (None when 0 or without one), computed when first needed and again when the rotary
        embedding's buffers change (a move to another device, weights loaded from the meta device)."""
        if self.memory_distance == 0 or not self.rotary:
            return None
        key = (self.memory_distance, tuple((id(b), b.device) for m in self.rotary for b in m.buffers()))
        if self._memory_rope[0] != key:
            self._memory_rope = (key, rotation_at(self.rotary, self.memory_distance))
        return self._memory_rope[1]

    def extra_repr(self) -> str:
        mem = f", memory={self.memory}, memory_every={self.memory_every}, memory_score={self.memory_score}" if self.memory else ""
        mem += f", memory_distance={self.memory_distance}" if self.memory and self.memory_distance else ""
        fin = ", feature_input=unrotated" if self.feature_input == "unrotated" else ""
        return f"layer_idx={self.layer_idx}, window={self.window}, sinks={self.sinks}, chunk_size={self.chunk_size}, backend={self.backend}{mem}{fin}"


def autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under ``torch.autocast``: q, k, v in the autocast dtype, as SDPA takes them (autocast casts
    SDPA's floating inputs, except float64); otherwise unchanged. A Llama's rotary embedding leaves
    q/k in float32 (its cos/sin are float32) while v comes from a bf16 linear; the op computes its
    features, states and sums in float32 either way, but what it saves for backward — q, k, v —
    then takes the bytes of SDPA's saved inputs instead of twice theirs for q/k."""
    dev = xs[0].device.type
    if not torch.is_autocast_enabled(dev):
        return xs
    dt = torch.get_autocast_dtype(dev)
    return tuple(x.to(dt) if x.is_floating_point() and x.dtype != torch.float64 else x for x in xs)


def _padding_mask(attention_mask: torch.Tensor | None, nk: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -nk:].bool()
    raise ValueError(
        "attn_implementation='rfa' needs a 2-D padding mask [batch, keys]; got a "
        f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)} (custom 4-D masks, "
        "packed sequences and block masks cannot be expressed in linear attention)"
    )


def exact_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask2d: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Softmax attention (SDPA) from a 2-D padding mask, for layers that are not converted."""
    b, h, nq, _ = query.shape
    nk = key.shape[2]
    allowed = None
    if causal:
        t = torch.arange(nk - nq, nk, device=query.device).view(-1, 1)
        allowed = (torch.arange(nk, device=query.device).view(1, -1) <= t).view(1, 1, nq, nk)
    if mask2d is not None:
        pad = mask2d.view(b, 1, 1, nk)
        allowed = pad if allowed is None else allowed & pad
    if allowed is not None:
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # fully padded rows: avoid NaN
    if key.shape[1] != h:
        rep = h // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scale)


def rfa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature → ``(out [B, Nq, H, D], None)``."""
    causal = kwargs.pop("is_causal", None)
    if causal is None:
        causal = bool(getattr(module, "is_causal", False))
    mask2d = _padding_mask(attention_mask, key.shape[2])
    rfa = getattr(module, "rfa", None)
    if rfa is None and not getattr(module, "_hf_rfa_converted", False):
        raise ValueError(
            f"attn_implementation='rfa' on {type(module).__name__} of a model that hf_rfa.convert never converted "
            "would run plain softmax: call hf_rfa.convert(model, hf_rfa.RFAConfig(...)) (or load a converted "
            "folder with from_pretrained)"
        )
    if rfa is None:
        out = exact_attention(query, key, value, mask2d, causal, scaling, dropout)
    else:
        if hasattr(module, ROPE_ATTR):  # feature_input='unrotated': this forward's rotary embedding
            kwargs["rfa_rope"] = getattr(module, ROPE_ATTR)
        out = rfa(query, key, value, mask2d, causal, scaling, **kwargs)
    return out.transpose(1, 2).contiguous(), None


def rfa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function for ``"rfa"``: the 2-D padding mask ``[B, kv_length]`` (bool) or None."""
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:].bool()


def register() -> None:
    """Register ``"rfa"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, rfa_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, rfa_mask)
