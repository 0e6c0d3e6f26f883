"""Constant-memory generation: a recurrent-state cache for ``generate()``.

:class:`RFACache` is a transformers ``Cache`` whose converted layers (:class:`RFACacheLayer`) keep
only the state of causal random feature attention — ``S = Σ φ(k)vᵀ``, ``z = Σ φ(k)`` (decayed
for gated RFA), the last ``W`` keys/values of a hybrid window and the keys/values of the ``S``
sink tokens (``ops.decode.DecodeState``; with ``RFAConfig.memory`` also the at most ``memory``
exact memory keys/values per kv head and the ≤ ``memory_every`` keys awaiting the next refresh,
``ops.memory.MemoryState``) — never the growing K/V. Layers that were not converted
(``RFAConfig.layers``) keep a stock ``DynamicLayer``.

How it plugs in (transformers 5.24):

- The attention module calls ``cache.update(k, v, layer_idx, kwargs=attn_kwargs)`` before the
  attention function. :meth:`RFACacheLayer.update` counts the tokens, returns only the new K/V
  and puts itself into ``attn_kwargs["rfa_cache_layer"]``; the attention classes pass that dict
  on, and ``RFAAttention.forward`` then calls :meth:`RFACacheLayer.attend`.
- ``get_seq_length()`` is the number of positions seen (padding included), exactly as for a
  ``DynamicCache``, so GPT-2 absolute positions and Llama RoPE are unchanged.
- ``get_mask_sizes(q)`` is ``(seen + q, 0)``: the 2-D padding mask generate() grows covers every
  position, ``rfa_mask`` slices its last ``seen + q`` columns and the attention function its last
  ``q`` (the new tokens). The padding flags of the kept window and sinks live in the state.
- ``generate()`` picks it automatically: importing ``hf_rfa`` wraps
  ``GenerationMixin._prepare_cache_for_generation`` (:func:`install_generate_hook`). After the
  stock method ran, if the model is converted (``config.rfa_config`` set and
  ``attn_implementation == "rfa"``) and the stock method just built its default ``DynamicCache``
  (no user cache, ``use_cache`` not False, no ``cache_implementation``, not an assistant model,
  generation mode greedy/sample/beam search/beam sample), that cache is replaced by an
  :class:`RFACache`. Pass ``cache_implementation="dynamic"`` to keep the full K/V cache,
  ``cache=hf_rfa.RFACache(model)`` (or the deprecated ``past_key_values=``) to pass one
  explicitly, and ``use_cache=False`` to recompute everything each step.

``feature_input="unrotated"`` (the feature part reads q/k before the rotary embedding): a layer's
state is exactly the one of the rotated recipe — the window keeps the rotated keys only, and the
keys of the local block (kept window + new tokens) are un-rotated again where the feature part
needs them (``continue_attention``'s ``feature_key_fn``). The rotations this needs, ``(cos, sin)`` of
the last ``W`` positions, are the same in every layer: the cache keeps them once, in one
:class:`RopeRing` shared by all layers (``2·W·Dr`` numbers per batch row, or for the whole batch
when the positions are the same in every row), counted once in ``nbytes()``.

Beam search is supported (``reorder_cache``, ``batch_select_indices``,
``batch_repeat_interleave``); ``crop`` is not (a recurrent state cannot be rolled back), so
assisted/speculative decoding (and other modes that crop) keeps the stock cache. A plain
``model(..., use_cache=True)`` outside generate() still builds transformers' ``DynamicCache``
(correct, but it grows): pass ``cache=hf_rfa.RFACache(model)`` there.
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .. import compat
from ..config import CONFIG_ATTR, RFAConfig
from ..ops.decode import DecodeCall, DecodeState, continue_attention
from ..ops.masks import validate_qkv
from ..ops.memory import MemoryCall, MemoryState, continue_memory_attention
from .rope import unrotate

logger = logging.getLogger(__name__)

#: key under which a cache layer hands itself to the attention function (see attention.py)
KWARG = "rfa_cache_layer"
#: generation modes that get an RFACache by default (the others may roll a cache back: crop)
DEFAULT_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample"})


class RopeRing:
    """The rotary embedding ``(cos, sin)`` of the last ``keep`` positions, one for all layers of a cache.

    ``feature_input="unrotated"``: each layer derives the un-rotated keys of its local block
    (``Wc ≤ keep`` kept positions + the ``n`` new ones) from its rotated keys; the rotations of
    those positions are identical in every layer, so they are kept here once. ``cos``/``sin`` are
    ``[Bc, Lr, Dr]`` (``Lr ≤ keep``; ``Bc`` is 1 when every row has the same positions, else the
    batch). In each forward the first layer that reaches the new length appends the forward's
    rotations (:meth:`local`); the later layers of that forward read the same local block; the
    ring then keeps the last ``keep`` positions only. ``users`` is the number of layers sharing it
    (the transient local block is dropped once all of them read it).
    """

    def __init__(self, keep: int, users: int = 1) -> None:
        self.keep = int(keep)
        self.users = int(users)
        self.reset()

    def reset(self) -> None:
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.end = 0  # positions covered: [end - Lr, end)
        self._block: tuple | None = None  # (p0, n, cos, sin, reads) of the current forward

    def __len__(self) -> int:
        return 0 if self.cos is None else self.cos.shape[1]

    def local(self, p0: int, n: int, wc: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotations ``[Bc, wc + n, Dr]`` of positions ``p0 - wc … p0 + n - 1``: the layer's kept
        window (``wc`` positions) and the forward's new tokens, whose ``cos``/``sin`` ``[B or 1, n, Dr]``
        come from the attention module (the same in every layer)."""
        blk = self._block
        if blk is None or blk[0] != p0 or blk[1] != n:
            if self.end != p0:
                raise RuntimeError(
                    f"RFACache rotary ring out of step: it covers positions up to {self.end}, a layer continues at {p0} "
                    "(feature_input='unrotated' needs every layer of the cache to see every forward)"
                )
            if tuple(cos.shape[:2]) != tuple(sin.shape[:2]) or cos.shape[1] != n:
                raise ValueError(f"the rotary embedding covers {cos.shape[1]} positions, the forward has {n} new tokens")
            if self.cos is None:
                bc, bs = cos, sin
            else:
                if self.cos.shape[-1] != cos.shape[-1]:
                    raise ValueError(f"rotary dim changed between forwards: {self.cos.shape[-1]} then {cos.shape[-1]}")
                rows = max(self.cos.shape[0], cos.shape[0])
                if {self.cos.shape[0], cos.shape[0]} - {1, rows}:
                    raise ValueError(f"rotary embedding of batch {cos.shape[0]} does not continue the cache's batch {self.cos.shape[0]}")
                bc = torch.cat([self.cos.to(cos.dtype).expand(rows, -1, -1), cos.expand(rows, -1, -1)], dim=1)
                bs = torch.cat([self.sin.to(sin.dtype).expand(rows, -1, -1), sin.expand(rows, -1, -1)], dim=1)
            blk = self._block = [p0, n, bc, bs, 0]
            keep = min(self.keep, bc.shape[1])
            self.cos, self.sin = bc[:, bc.shape[1] - keep:].clone(), bs[:, bs.shape[1] - keep:].clone()
            self.end = p0 + n
        bc, bs = blk[2], blk[3]
        if wc + n > bc.shape[1]:
            raise RuntimeError(f"RFACache rotary ring keeps {bc.shape[1] - n} past positions but a layer keeps a window of {wc} (ring keep={self.keep})")
        blk[4] += 1
        if blk[4] >= self.users:  # every layer of this forward has read it
            self._block = None
        return bc[:, bc.shape[1] - wc - n:], bs[:, bs.shape[1] - wc - n:]

    def map_batch(self, fn) -> None:
        """Beam search / batch selection: ``fn`` on the batch axis (a ring shared by all rows stays)."""
        self._block = None
        if self.cos is not None and self.cos.shape[0] > 1:
            self.cos, self.sin = fn(self.cos), fn(self.sin)

    def nbytes(self) -> int:
        return 0 if self.cos is None else 2 * self.cos.numel() * self.cos.element_size()


class RFACacheLayer(CacheLayerMixin):
    """One converted layer's cache: a :class:`~hf_rfa.ops.decode.DecodeState`, constant size.

    ``keys``/``values`` stay ``None``: nothing grows with the context.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, ring: RopeRing | None = None, **kwargs) -> None:
        super().__init__()
        self.state: DecodeState | MemoryState | None = None
        self.cumulative_length = 0
        self._pending = False
        #: the rotations of the last W positions, shared by the layers of an RFACache (one of
        #: its own when None and a layer un-rotates); not part of this layer's nbytes()
        self.ring = ring

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Count ``key_states [B, Hkv, n, D]`` and return them unchanged (the new tokens only).

        ``kwargs["kwargs"]`` is the attention kwargs dict of the calling module: this layer puts
        itself there so that the attention function can :meth:`attend` with the state.
        """
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            raise ValueError(
                "RFACacheLayer.update needs the attention kwargs dict (cache.update(k, v, layer_idx, kwargs=...)); "
                "this model's attention does not pass it, so it cannot use hf_rfa.RFACache"
            )
        if self._pending:
            raise RuntimeError(
                "the previous update of this RFACache layer was never attended: the model's attention is not "
                "'rfa' (check model.config._attn_implementation), so the cache would silently drop the past"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        attn_kwargs[KWARG] = self
        self._pending = True
        self.cumulative_length += key_states.shape[-2]
        return key_states, value_states

    def attend(
        self,
        rfa,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        causal: bool,
        scale: float | None,
        feature_q: torch.Tensor | None = None,
        feature_k: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention of the new tokens with the state; updates it. q ``[B, H, n, D]`` → ``[B, H, n, Dv]``.

        ``rfa`` is the layer's :class:`~hf_rfa.attention.RFAAttention`; ``attention_mask`` is the
        ``[B, n]`` padding mask of the new tokens (or None). Bad inputs raise ValueError and
        leave the state as it was (checked by :func:`~hf_rfa.ops.decode.continue_attention`).

        Feature inputs (``feature_input="unrotated"``): ``feature_q`` ``[B, H, n, D]`` (the new
        queries, un-rotated) with ``rope = (cos, sin)`` ``[B or 1, n, Dr]`` of the new tokens: the
        layer keeps the rotated window only and un-rotates its local block with the cache's shared
        :class:`RopeRing` (what ``RFAAttention`` passes). Or ``feature_q`` with ``feature_k``
        (any feature keys): the state then keeps a copy of the window's (``DecodeState.win_kf``).
        With an exact memory (``memory > 0``) the new keys are un-rotated with ``rope`` at once and
        the state keeps the feature keys of its buffer and memory (``MemoryState.mem_kf``).
        """
        if not causal:
            raise ValueError("RFACache holds the state of causal attention; this layer is bidirectional (is_causal=False)")
        fm = rfa.feature_map
        validate_qkv(query, key, value, causal=True)  # before a state is built from (or checked against) their shapes
        memory = getattr(rfa, "memory", 0)
        if rope is not None and (feature_k is not None or feature_q is None):
            raise ValueError("rope (cos, sin) goes with feature_q and without feature_k (the feature keys are un-rotated from the kept keys)")
        if self.state is None:
            b, hkv, _, d = key.shape
            ct = torch.float64 if query.dtype == torch.float64 else torch.float32
            if memory > 0:  # exact global memory: its own state (ops.memory), at most `memory` keys per kv head
                self.state = MemoryState.empty(
                    (b, hkv, d, value.shape[-1], fm.feature_dim), rfa.sinks, memory, key.dtype, key.device, compute_dtype=ct,
                    feature_keys=feature_q is not None,  # un-rotated keys of the buffer and the memory
                )
            else:
                self.state = DecodeState.empty(
                    (b, hkv, d, value.shape[-1], fm.feature_dim), rfa.sinks, key.dtype, key.device, compute_dtype=ct,
                    feature_keys=feature_k is not None,  # rope: un-rotated from win_k, nothing kept
                )
        if self.state.seen + key.shape[2] != self.cumulative_length:
            raise RuntimeError(
                f"RFACache layer out of step: state has {self.state.seen} tokens + {key.shape[2]} new, "
                f"update counted {self.cumulative_length}"
            )
        if memory > 0:
            if rope is not None:  # the new keys un-rotated with their own (cos, sin)
                feature_k = unrotate(key, *rope)
            settings = MemoryCall(
                window=rfa.window, sinks=rfa.sinks, memory=memory, memory_every=rfa.memory_every, scale=scale,
                chunk_size=rfa.chunk_size, memory_score=getattr(rfa, "memory_score", "value_norm"),
                distance=getattr(rfa, "memory_distance", 0), far_rope=getattr(rfa, "memory_rope", None),
            )
            out, self.state = continue_memory_attention(self.state, query, key, value, fm, attention_mask, settings, (feature_q, feature_k))
            self._pending = False
            return out
        key_fn = None
        if rope is not None:
            if self.ring is None:
                self.ring = RopeRing(rfa.window)
            cos, sin = self.ring.local(self.state.seen, key.shape[2], self.state.win_k.shape[2], *rope)

            def key_fn(keys: torch.Tensor) -> torch.Tensor:  # the local block's keys, un-rotated
                return unrotate(keys, cos, sin)

        settings = DecodeCall(window=rfa.window, sinks=rfa.sinks, scale=scale, chunk_size=rfa.chunk_size, backend=rfa.backend)
        out, self.state = continue_attention(self.state, query, key, value, fm, attention_mask, settings, (feature_q, feature_k, key_fn))
        self._pending = False
        return out

    # ---- bookkeeping transformers calls ---------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state = None
        self.cumulative_length = 0
        self._pending = False

    def _map_batch(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(f"tokens_to_remove={tokens_to_remove}: an RFACache layer keeps a recurrent state and cannot be cropped")

    def offload(self) -> None:  # nothing large to move
        pass

    def prefetch(self) -> None:
        pass

    def nbytes(self) -> int:
        """Bytes of this layer's state (a shared :class:`RopeRing` is counted by the cache, once)."""
        return 0 if self.state is None else self.state.nbytes()


def _text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


class RFACache(Cache):
    """Cache for ``generate()`` with a converted causal model: per layer a constant-size state.

    Args:
        model_or_config: the converted model or its config (reads ``config.rfa_config`` to tell
            which layers are converted and ``num_hidden_layers``).
    Raises:
        ValueError: the config carries no ``rfa_config`` (the model was not converted).

    ``nbytes()`` is the memory held (constant in the context length for converted layers): the
    layers' states plus, with ``feature_input="unrotated"``, the rotations of the last ``W``
    positions once (``rope_ring``, shared by all layers; ``ring_nbytes()``).
    """

    def __init__(self, model_or_config) -> None:
        config = getattr(model_or_config, "config", model_or_config)
        d = getattr(config, CONFIG_ATTR, None)
        if not d:
            raise ValueError(f"{CONFIG_ATTR}: the config has none; RFACache needs a model converted with hf_rfa.convert")
        rfa_cfg = RFAConfig.from_dict(d)
        n_layers = getattr(_text_config(config), "num_hidden_layers", None)
        if not isinstance(n_layers, int) or n_layers <= 0:
            raise ValueError(f"num_hidden_layers: cannot read the number of layers from {type(config).__name__}")
        converted = [i for i in range(n_layers) if rfa_cfg.converts_layer(i)]
        #: the rotations of the last W positions, one for all layers (feature_input="unrotated")
        self.rope_ring = RopeRing(rfa_cfg.window, users=len(converted))
        layers = [RFACacheLayer(ring=self.rope_ring) if i in converted else DynamicLayer() for i in range(n_layers)]
        super().__init__(layers=layers)

    def reset(self) -> None:
        super().reset()
        self.rope_ring.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.rope_ring.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.rope_ring.map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.rope_ring.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def ring_nbytes(self) -> int:
        """Bytes of the shared rotary ring (0 unless ``feature_input="unrotated"``)."""
        return self.rope_ring.nbytes()

    def nbytes(self) -> int:
        """Bytes held by all layers (states, kept window/sink K/V, full K/V of unconverted layers)
        and the shared rotary ring, counted once."""
        total = self.ring_nbytes()
        for layer in self.layers:
            if isinstance(layer, RFACacheLayer):
                total += layer.nbytes()
            elif layer.is_initialized and layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        return total


def uses_rfa(model) -> bool:
    """True when ``model`` is converted and runs ``attn_implementation="rfa"``."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, CONFIG_ATTR, None):
        return False
    from .attention import ATTN_NAME

    return ATTN_NAME in (compat.attn_implementation_of(_text_config(cfg)), compat.attn_implementation_of(cfg))


def install_generate_hook() -> None:
    """Make ``generate()`` of converted models default to :class:`RFACache` (idempotent).

    Wraps ``GenerationMixin._prepare_cache_for_generation``: the stock method runs first; if it
    built its default ``DynamicCache`` for a converted model, that cache is swapped for an
    ``RFACache``. Models that are not converted, user-passed caches, ``use_cache=False``, an
    explicit ``cache_implementation`` and assistant models are left exactly as transformers does.
    """
    compat.wrap_prepare_cache_for_generation(_use_rfa_cache)


def _use_rfa_cache(model, generation_config, model_kwargs: dict, mode) -> None:
    """After the stock ``_prepare_cache_for_generation``: swap its default cache for an RFACache."""
    if (
        getattr(mode, "value", mode) in DEFAULT_MODES
        and uses_rfa(model)
        and getattr(generation_config, "cache_implementation", None) is None
        and not getattr(generation_config, "is_assistant", False)
    ):
        for key in ("cache", "past_key_values"):
            if compat.is_default_dynamic_cache(model_kwargs.get(key)):
                model_kwargs[key] = RFACache(model.config)
                logger.debug("generate(): using hf_rfa.RFACache for %s", type(model).__name__)
