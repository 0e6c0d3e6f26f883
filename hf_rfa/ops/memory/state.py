"""The exact memory's state (:class:`MemoryState`: the decoding state plus at most ``memory``
exact keys per kv head) and the checks of its settings."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..decode.state import DecodeState
from ..masks import MAX_CHUNK, check_int
from .scores import MEMORY_SCORES


#: largest ``memory`` (keys per kv head)
MAX_MEMORY = 65536


def check_memory_args(memory, memory_every, causal: bool, feature_map, memory_score: str = "value_norm") -> tuple[int, int]:
    """``(memory, memory_every)`` checked with ``memory_score`` (ValueError naming the argument)."""
    memory = check_int("memory", memory, 0, MAX_MEMORY)
    memory_every = check_int("memory_every", memory_every, 1, MAX_CHUNK)
    if memory_score not in MEMORY_SCORES:
        raise ValueError(f"memory_score must be one of {list(MEMORY_SCORES)}, got {memory_score!r}")
    if memory > 0 and not causal:
        raise ValueError("memory > 0 needs causal attention: the exact memory is chosen over the past (use memory=0 for bidirectional layers)")
    if memory > 0 and memory_score == "feature_error" and getattr(feature_map, "null", False):
        raise ValueError("memory_score='feature_error' needs a feature state to score keys against; feature_map='none' has none (use memory_score='value_norm')")
    return memory, memory_every


def check_far(distance, far_rope, head_dim: int, feature_keys: bool) -> None:
    """``MemoryCall.distance`` / ``far_rope`` checked (ValueError naming the bad value)."""
    check_int("memory_distance", distance, 0, 2**31 - 1)
    if distance == 0:
        return
    if not feature_keys:
        raise ValueError(f"memory_distance={distance} re-reads memory keys un-rotated: it needs the feature inputs un-rotated (feature_input='unrotated'), got none")
    ok = isinstance(far_rope, (tuple, list)) and len(far_rope) == 2 and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 1 for t in far_rope)
    if not ok or far_rope[0].shape != far_rope[1].shape or not (0 < far_rope[0].shape[0] <= head_dim) or far_rope[0].shape[0] % 2:
        raise ValueError(f"memory_distance={distance} needs memory_rope = (cos, sin) of that position, two float tensors [Dr] (Dr even, <= head dim {head_dim}), got {type(far_rope).__name__}")


@dataclass(frozen=True)
class MemoryCall:
    """The settings of one exact-memory call (:func:`~hf_rfa.ops.memory.sequential.run_sequential`,
    :func:`~hf_rfa.ops.memory.periods.run_periods`): window W, sinks S, ``memory`` M slots, refreshes
    every ``memory_every`` positions, the logit ``scale`` (None: ``D ** -0.5``, resolved by the entry
    points), the window/sink part's ``chunk_size``, ``native_band`` (a prefill's window/sink part
    runs the compiled kernel: the op's rule), ``memory_score`` (:data:`MEMORY_SCORES`), and
    ``distance`` Δ > 0 with ``far_rope = (cos, sin)`` ``[Dr]`` of position Δ: a memory key more
    than Δ positions behind the query is scored as if Δ behind it (its un-rotated key against
    :func:`~hf_rfa.ops.rotary.far_queries`; needs the feature keys un-rotated). 0: true distances."""

    window: int = 0
    sinks: int = 0
    memory: int = 1
    memory_every: int = 64
    scale: float | None = None
    chunk_size: int = 64
    native_band: bool = False
    memory_score: str = "value_norm"
    distance: int = 0
    far_rope: tuple | None = None


@dataclass
class MemoryState:
    """The past of one causal layer with an exact memory (B rows, Hkv kv heads, M slots).

    base:     :class:`~hf_rfa.ops.decode.DecodeState` whose ``win_*`` hold the *buffer*: every key
              from the oldest pending one to the last (positions ``[seen − Lb, seen)``, Lb ≤ W + E);
              ``linear`` holds every folded key; sinks as there; ``win_decay`` is unused (empty).
    mem_k:    ``[B, Hkv, M, D]`` memory keys (input dtype); ``mem_v [B, Hkv, M, Dv]`` their values.
    mem_pos:  ``[B, Hkv, M]`` long, their positions; ``mem_norm [B, Hkv, M]`` their score
              (:func:`value_norm`).
    mem_ok:   ``[B, Hkv, M]`` bool, the slot holds a key.
    mem_lg:   ``[B, Hkv, M]`` gated / decaying maps: log of each memory key's feature weight as of
              the state's anchor (the position before the buffer's first key), i.e.
              ``G_anchor − G_s + log(1 − g_s)`` — what the key weighs if it is folded (zeros otherwise).
    mem_kf:   ``[B, Hkv, M, D]`` the memory keys as the feature part reads them (feature inputs,
              e.g. un-rotated; needed when a displaced memory key is folded), or None (the feature
              part reads the keys themselves); the base then keeps ``win_kf`` for the buffer.
    buf_mass: ``[B, Hkv, Lb]`` float64, ``memory_score="query_mass"``: the attention each buffered
              key has received so far from the queries of its window (:func:`window_mass`);
              None before the first call and for the other scores.
    """

    base: DecodeState
    mem_k: torch.Tensor
    mem_v: torch.Tensor
    mem_pos: torch.Tensor
    mem_norm: torch.Tensor
    mem_ok: torch.Tensor
    mem_lg: torch.Tensor | None = None
    mem_kf: torch.Tensor | None = None
    buf_mass: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        shape: tuple[int, int, int, int, int],
        sinks: int,
        memory: int,
        dtype: torch.dtype,
        device=None,
        compute_dtype: torch.dtype = torch.float32,
        feature_keys: bool = False,
    ) -> "MemoryState":
        """State before the first token (``memory`` empty slots), ``shape`` as for
        :meth:`DecodeState.empty` (``batch, kv_heads, head_dim, value_dim, feature_dim``).
        ``feature_keys``: the calls give ``feature_q``/``feature_k`` (the feature part's own
        inputs), kept for the buffer and the memory."""
        b, h, head_dim, value_dim, _ = shape
        m = memory
        base = DecodeState.empty(shape, sinks, dtype, device, compute_dtype, feature_keys=feature_keys)
        return cls(
            base=base,
            mem_k=torch.zeros(b, h, m, head_dim, dtype=dtype, device=device),
            mem_v=torch.zeros(b, h, m, value_dim, dtype=dtype, device=device),
            mem_pos=torch.zeros(b, h, m, dtype=torch.long, device=device),
            mem_norm=torch.zeros(b, h, m, dtype=compute_dtype, device=device),
            mem_ok=torch.zeros(b, h, m, dtype=torch.bool, device=device),
            mem_lg=torch.zeros(b, h, m, dtype=compute_dtype, device=device),
            mem_kf=torch.zeros(b, h, m, head_dim, dtype=dtype, device=device) if feature_keys else None,
        )

    @property
    def seen(self) -> int:
        return self.base.seen

    @property
    def memory(self) -> int:
        return self.mem_k.shape[2]

    def _own(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "base" and getattr(self, f.name) is not None}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state by name (the base's under their own names)."""
        return {**self.base.tensors(), **self._own()}

    def map_batch(self, fn) -> "MemoryState":
        """Apply ``fn`` to the batch axis (dim 0) of every tensor: reorder, select, repeat."""
        return MemoryState(base=self.base.map_batch(fn), **{k: fn(t) for k, t in self._own().items()})

    def memory_nbytes(self) -> int:
        """Bytes of the memory slots alone (keys, values, positions, norms, flags)."""
        return sum(t.numel() * t.element_size() for t in self._own().values())

    def nbytes(self) -> int:
        """Bytes held by the state, memory included (bounded independently of the context)."""
        return self.base.nbytes() + self.memory_nbytes()


__all__ = ["MAX_MEMORY", "MemoryCall", "MemoryState", "check_memory_args"]
