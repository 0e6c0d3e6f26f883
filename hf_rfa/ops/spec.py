"""``AttentionSpec``: the settings of one attention layer, built once and validated once.

Every entry point reads one frozen spec instead of a restated list of keywords:
:func:`hf_rfa.random_feature_attention` builds one from its keywords, ``RFAAttention`` holds the
one :meth:`AttentionSpec.from_config` builds from a model's ``RFAConfig``, and the ops pass it (with
the per-call choices of :class:`CallPlan`) down to the forms that compute. What a call adds — causal
or not, the logit scale, the backend actually run — is :class:`CallPlan`'s. A gate or a decay is
the feature map's (learned parameters read through ``feature_map.log_gate``), not a spec field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .backends import check_name
from .masks import MAX_CHUNK, MAX_SINKS, check_int
from .memory.scores import MEMORY_SCORES
from .memory.state import MAX_MEMORY

#: what the feature part of a rotary-embedded model reads (``feature_input``)
FEATURE_INPUTS = ("rotated", "unrotated")


@dataclass(frozen=True)
class AttentionSpec:
    """The settings of random feature attention for one layer (see ``RFAConfig`` for each field's
    meaning); ValueError naming the field for a bad value."""

    window: int = 0
    sinks: int = 0
    chunk_size: int = 64
    checkpoint_blocks: bool = True
    backend: str = "auto"
    memory: int = 0
    memory_every: int = 64
    memory_score: str = "value_norm"
    feature_input: str = "rotated"
    memory_distance: int = 0

    def __post_init__(self) -> None:
        check_int("window", self.window)
        check_int("sinks", self.sinks, 0, MAX_SINKS)
        check_int("chunk_size", self.chunk_size, 1, MAX_CHUNK)
        check_int("memory", self.memory, 0, MAX_MEMORY)
        check_int("memory_every", self.memory_every, 1, MAX_CHUNK)
        check_int("memory_distance", self.memory_distance, 0, 2**31 - 1)
        if not isinstance(self.checkpoint_blocks, bool):
            raise ValueError(f"checkpoint_blocks must be True or False, got {self.checkpoint_blocks!r}")
        check_name(self.backend)
        if self.memory_score not in MEMORY_SCORES:
            raise ValueError(f"memory_score must be one of {list(MEMORY_SCORES)}, got {self.memory_score!r}")
        if self.feature_input not in FEATURE_INPUTS:
            raise ValueError(f"feature_input must be one of {list(FEATURE_INPUTS)}, got {self.feature_input!r}")

    @classmethod
    def from_config(cls, config: Any, layer_idx: int | None = None) -> "AttentionSpec":
        """The spec of an ``RFAConfig`` (its fields of the same names) for layer ``layer_idx``
        (its ``memory_per_layer`` entry when the config has one: ``RFAConfig.memory_of``)."""
        values = {f.name: getattr(config, f.name) for f in fields(cls)}
        if hasattr(config, "memory_of"):
            values["memory"] = config.memory_of(layer_idx)
        return cls(**values)

    def replace(self, **changes: Any) -> "AttentionSpec":
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_call(self, causal: bool, feature_map: Any, nq: int, nk: int) -> None:
        """The checks that need the call (ValueError): the memory is causal only and scores by
        ``feature_error`` only with a feature state; a bidirectional window needs Nq == Nk;
        ``feature_map='none'`` needs an exact part."""
        null = getattr(feature_map, "null", False)
        if self.memory > 0 and not causal:
            raise ValueError("memory > 0 needs causal attention: the exact memory is chosen over the past (use memory=0 for bidirectional layers)")
        if self.memory > 0 and self.memory_score == "feature_error" and null:
            raise ValueError("memory_score='feature_error' needs a feature state to score keys against; feature_map='none' has none (use memory_score='value_norm')")
        if not causal and self.window > 0 and nq != nk:
            raise ValueError(f"a bidirectional window needs Nq == Nk, got Nq={nq}, Nk={nk}")
        if null and self.window == 0 and self.sinks == 0:
            raise ValueError("feature_map='none' needs window > 0 or sinks > 0 (otherwise no key is attended)")


@dataclass(frozen=True)
class CallPlan:
    """One call of the op once its arguments are checked: the layer's spec with ``window`` and
    ``sinks`` clipped to the Nk keys, the call's ``causal`` and logit ``scale``, the backend that
    runs the feature part (``backend``, resolved), whether the exact band of a causal hybrid runs
    the C++ kernel (``native_band``), and whether the recomputing hybrid's forward may answer its
    band with that kernel where usable (``native_forward``: the call asked for ``"auto"``), and the
    rotation of position ``spec.memory_distance`` (``memory_rope``) when the memory clamps distances."""

    spec: AttentionSpec
    causal: bool
    scale: float
    backend: str
    native_band: bool = False
    native_forward: bool = False
    memory_rope: tuple | None = None  # (cos, sin) [Dr] of position spec.memory_distance: the memory's far keys

    @property
    def window(self) -> int:
        return self.spec.window

    @property
    def sinks(self) -> int:
        return self.spec.sinks

    @property
    def exact(self) -> bool:
        """The call has an exact part (window and/or sinks)."""
        return self.spec.window > 0 or self.spec.sinks > 0


__all__ = ["FEATURE_INPUTS", "AttentionSpec", "CallPlan"]
