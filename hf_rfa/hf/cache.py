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
:class:`~hf_rfa.hf.rotations.RopeRing` shared by all layers (``2·W·Dr`` numbers per batch row, or
for the whole batch when the positions are the same in every row), counted once in ``nbytes()``.
With an exact memory the ring covers its buffer (``W + memory_every`` positions) and the memory's
keys, which may lie anywhere in the past, are un-rotated where a call reads them (a refresh, keys
beyond ``memory_distance``) with rotations recomputed from the model's rotary embedding
(:class:`~hf_rfa.hf.rotations.RopeTable`, checked against every forward's); where that check
fails (a rotary embedding that changes with the length, padding after the first real token,
positions that do not count the real tokens) the layers keep copies of their un-rotated keys.

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
from ..ops.memory import MemoryCall, MemoryState, continue_memory_attention, derive_feature_keys
from .rope import unrotate
from .rotations import RopeRing, RopeTable

logger = logging.getLogger(__name__)

#: key under which a cache layer hands itself to the attention function (see attention.py)
KWARG = "rfa_cache_layer"
#: generation modes that get an RFACache by default (the others may roll a cache back: crop)
DEFAULT_MODES = frozenset({"greedy_search", "sample", "beam_search", "beam_sample"})


class RFACacheLayer(CacheLayerMixin):
    """One converted layer's cache: a :class:`~hf_rfa.ops.decode.DecodeState`, constant size.

    ``keys``/``values`` stay ``None``: nothing grows with the context.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, ring: RopeRing | None = None, table: RopeTable | None = None, **kwargs) -> None:
        super().__init__()
        self.state: DecodeState | MemoryState | None = None
        self.cumulative_length = 0
        self._pending = False
        #: the rotations of the last W (with a memory W + memory_every) positions, shared by the
        #: layers of an RFACache (one of its own when None and a layer un-rotates); not part of
        #: this layer's nbytes()
        self.ring = ring
        #: the rotations of any past position for the memory's keys (shared like the ring)
        self.table = table
        self._owns_rotations = ring is None and table is None

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
        With an exact memory (``memory > 0``) the new keys are un-rotated with ``rope`` at once; the
        buffer's and the memory's are un-rotated where a call reads them (:meth:`_attend_memory`).
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
                    feature_keys=feature_q is not None and (rope is None or not self._derives(rfa, attention_mask, key, rope)),
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
            settings = MemoryCall(
                window=rfa.window, sinks=rfa.sinks, memory=memory, memory_every=rfa.memory_every, scale=scale,
                chunk_size=rfa.chunk_size, memory_score=getattr(rfa, "memory_score", "value_norm"),
                distance=getattr(rfa, "memory_distance", 0), far_rope=getattr(rfa, "memory_rope", None),
            )
            out = self._attend_memory(rfa, (query, key, value), attention_mask, settings, (feature_q, feature_k), rope)
            self._pending = False
            return out
        key_fn = None
        if rope is not None:
            if self.ring is None:
                self.ring = RopeRing(rfa.window)
            cos, sin = self.ring.local(self.state.seen, key.shape[2], self.state.win_k.shape[2], *rope)
            key_fn = lambda keys: unrotate(keys, cos, sin)  # noqa: E731 - the local block's keys, un-rotated

        settings = DecodeCall(window=rfa.window, sinks=rfa.sinks, scale=scale, chunk_size=rfa.chunk_size, backend=rfa.backend)
        out, self.state = continue_attention(self.state, query, key, value, fm, attention_mask, settings, (feature_q, feature_k, key_fn))
        self._pending = False
        return out

    def _shared(self, rfa) -> tuple[RopeRing, RopeTable]:
        """The ring (covering a memory's buffer) and table, of the cache or of this layer alone."""
        if self.ring is None:
            self.ring = RopeRing(rfa.window + rfa.memory_every)
        if self.table is None:
            self.table = RopeTable()
        return self.ring, self.table

    def _derives(self, rfa, attention_mask, key, rope) -> bool:
        """Whether this forward's memory layer may derive its kept keys' feature inputs (the shared
        table reproduces the model's rotations; observed once per forward)."""
        _, table = self._shared(rfa)
        return table.observe(self.cumulative_length - key.shape[2], key.shape[2], attention_mask, *rope, tuple(getattr(rfa, "rotary", ())))

    def _attend_memory(self, rfa, qkv: tuple, attention_mask, settings: MemoryCall, features: tuple, rope) -> torch.Tensor:
        """The attention of a layer with an exact memory (:meth:`attend`'s arguments). With ``rope``
        the state keeps the rotated keys only while the table holds (:class:`RopeTable`): the
        buffer's are un-rotated with the ring's rotations, the memory's with the table's, where a
        call reads them; once it does not, the layer keeps copies again (derived one last time)."""
        query, key, value = qkv
        feature_q, feature_k = features
        key_fn = None
        if rope is not None:
            feature_k = unrotate(key, *rope)  # the new keys un-rotated with their own (cos, sin)
            ring, table = self._shared(rfa)
            lb = self.state.base.win_k.shape[2]
            cos, sin = ring.local(self.state.seen, key.shape[2], lb, *rope)
            dtype = rope[0].dtype

            def derived(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
                if positions.dim() == 1:  # the buffer: the ring's rotations
                    return unrotate(keys, cos[:, :lb], sin[:, :lb])
                b, h, m, d = keys.shape  # the memory: positions [B, Hkv, M]
                c, s = table.rotations(positions.reshape(positions.shape[0], -1), dtype)
                return unrotate(keys.reshape(b, 1, h * m, d), c, s).reshape(b, h, m, d)

            if self.state.mem_kf is None:
                if self._derives(rfa, attention_mask, key, rope):
                    key_fn = derived
                else:  # copies from now on
                    self.state = derive_feature_keys(self.state, derived)
        out, self.state = continue_memory_attention(self.state, query, key, value, rfa.feature_map, attention_mask, settings, (feature_q, feature_k, key_fn))
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
        if self._owns_rotations:  # (an RFACache resets the ring and table it shares)
            self.ring = self.table = None

    def _map_batch(self, fn) -> None:
        if self.state is not None:
            self.state = self.state.map_batch(fn)
        if self._owns_rotations:
            for shared in (self.ring, self.table):
                if shared is not None:
                    shared.map_batch(fn)

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
        self.rope_ring = RopeRing(rfa_cfg.window + (rfa_cfg.memory_every if rfa_cfg.any_memory else 0), users=len(converted))
        #: the rotations of any past position, for the memory's keys (one for all layers)
        self.rope_table = RopeTable()
        layers = [RFACacheLayer(ring=self.rope_ring, table=self.rope_table) if i in converted else DynamicLayer() for i in range(n_layers)]
        super().__init__(layers=layers)

    def reset(self) -> None:
        super().reset()
        self.rope_ring.reset()
        self.rope_table.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.rope_ring.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))
        self.rope_table.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.rope_ring.map_batch(lambda t: t[indices])
        self.rope_table.map_batch(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.rope_ring.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))
        self.rope_table.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

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
