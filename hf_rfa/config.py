"""``RFAConfig``: how a model's attention is replaced (a dataclass, validated on construction)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .feature_maps import available_feature_maps
from .ops.backends import backend_names, check_name
from .ops.masks import MAX_CHUNK, MAX_SINKS, check_int
from .ops.memory import MAX_MEMORY, MEMORY_SCORES
from .ops.spec import FEATURE_INPUTS

#: inclusive ranges of the integer fields (a config.json can carry any value: absurd ones are
#: refused before they reach an allocation or a kernel)
_INT_RANGES: dict[str, tuple[int, int]] = {
    "num_features": (1, 65536),
    "window": (0, 2**31 - 1),  # >= N: exact softmax
    "sinks": (0, MAX_SINKS),
    "redraw_interval": (0, 2**31 - 1),
    "chunk_size": (1, MAX_CHUNK),
    "seed": (-(2**63), 2**63 - 1),
    "memory": (0, MAX_MEMORY),
    "memory_every": (1, MAX_CHUNK),
    "memory_distance": (0, 2**31 - 1),
}
#: largest ``decay`` half-life (tokens)
MAX_DECAY = 1e9
#: largest layer index accepted in ``layers``
_MAX_LAYER = 2**20

#: attribute of ``model.config`` that carries the RFA settings through save/load/push_to_hub
CONFIG_ATTR = "rfa_config"


@dataclass
class RFAConfig:
    """Settings of random feature attention for a converted model.

    Stored as a dict in ``model.config.rfa_config`` so it travels with ``save_pretrained`` and
    ``push_to_hub``. Invalid values raise ``ValueError`` naming the field.
    """

    feature_map: str = field(default="favor+", metadata={"help": f"one of {available_feature_maps()}"})
    num_features: int = field(default=256, metadata={"help": "m, random projections / learned features per head"})
    window: int = field(default=0, metadata={"help": "exact-softmax local window W (0: none; >= N: exact softmax)"})
    sinks: int = field(default=0, metadata={"help": "first S real tokens always attended exactly (attention sinks)"})
    gate: bool = field(default=False, metadata={"help": "learned decay gate (feature_map='rfa', causal layers only)"})
    seed: int = field(default=0, metadata={"help": "base seed; layer l draws from (seed, l, redraw step)"})
    redraw_interval: int = field(default=0, metadata={"help": "redraw projections every N optimizer steps (0: never)"})
    layers: list[int] | None = field(default=None, metadata={"help": "indices of layers to convert (None: all)"})
    chunk_size: int = field(default=64, metadata={"help": "chunk length of the causal chunkwise-parallel form"})
    checkpoint_blocks: bool = field(
        default=True,
        metadata={"help": "training: the causal feature scan and the hybrid's exact band keep only their inputs and recompute each block in backward; activation memory O(N·D) instead of O(N·(m + W)). False: plain autograd (faster at short N)"},
    )
    backend: str = field(default="auto", metadata={"help": f"implementation of each attention call, one of {list(backend_names())} (hf_rfa.ops.backends)"})
    feature_map_options: dict[str, Any] = field(default_factory=dict, metadata={"help": "extra options of the map"})
    memory: int = field(
        default=0,
        metadata={"help": "causal layers: exact global memory of at most this many keys per kv head (0: off), re-chosen every memory_every positions among the keys older than the window (not sinks) as ranked by memory_score; answered by exact softmax, excluded from the feature part (hf_rfa.ops.memory)"},
    )
    memory_every: int = field(default=64, metadata={"help": "the exact memory is re-chosen at positions that are multiples of this (used with memory > 0)"})
    decay: float = field(
        default=0.0,
        metadata={"help": "causal layers: half-life in tokens of an exponential decay of the feature state, S_t = g S_{t-1} + phi(k_t) v_t^T with g = 2^(-1/decay) per kv head, learned by attention transfer (0: no decay)"},
    )
    feature_input: str = field(
        default="rotated",
        metadata={"help": f"one of {list(FEATURE_INPUTS)}: what the feature part reads in a model with rotary position embeddings (Llama...): 'rotated' the q/k the softmax scores, 'unrotated' q/k before the rotary embedding (position-free features; the exact window and sinks keep the rotated q/k)"},
    )
    memory_per_layer: list[int] | None = field(
        default=None,
        metadata={"help": "per-layer exact-memory sizes, entry i for layer i (overrides memory layer by layer; None: every converted layer keeps memory keys per kv head), e.g. budgets in proportion to each layer's attention beyond the window at the same total"},
    )
    memory_score: str = field(
        default="value_norm",
        metadata={"help": f"one of {list(MEMORY_SCORES)} (used with memory > 0): how the exact memory ranks the keys older than the window — 'value_norm' the largest ||v||, 'feature_error' the keys whose value the feature state recalls worst (LoLA-style; needs a feature map other than 'none'), 'query_mass' the keys the queries of their exact window attended to most (selection by the query side; needs window > 0)"},
    )

    memory_distance: int = field(
        default=0,
        metadata={"help": "rotary models, feature_input='unrotated': a memory key more than this many positions behind its query is scored as if it were that far (its rotary distance clamped, e.g. to the model's max_position_embeddings, so reading past the trained context never meets an unseen distance); 0: true distances"},
    )

    def __post_init__(self) -> None:
        names = available_feature_maps()
        if self.feature_map not in names:
            raise ValueError(f"feature_map must be one of {names}, got {self.feature_map!r}")
        for name, (low, high) in _INT_RANGES.items():
            check_int(name, getattr(self, name), low, high)
        for name in ("gate", "checkpoint_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (True or False), got {getattr(self, name)!r}")
        if self.feature_map == "none" and self.window == 0 and self.sinks == 0:
            raise ValueError("feature_map='none' (window-only baseline) needs window > 0 or sinks > 0")
        check_name(self.backend)
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not (self.decay == 0 or 1.0 <= self.decay <= MAX_DECAY):
            raise ValueError(f"decay must be 0 (off) or a half-life in tokens in [1, {MAX_DECAY:g}], got {self.decay!r}")
        self.decay = float(self.decay)
        if self.decay > 0:
            clash = [name for name, bad in (("gate", self.gate), ("feature_map='none'", self.feature_map == "none")) if bad]
            if clash:
                raise ValueError(f"decay > 0 does not combine with {', '.join(clash)} (gate=True is already a decay; 'none' has no feature state); use decay=0")
        if self.feature_input not in FEATURE_INPUTS:
            raise ValueError(f"feature_input must be one of {list(FEATURE_INPUTS)}, got {self.feature_input!r}")
        if self.memory_per_layer is not None:
            per = self.memory_per_layer
            ok = isinstance(per, (list, tuple)) and 0 < len(per) <= _MAX_LAYER + 1 and all(isinstance(m, int) and not isinstance(m, bool) and 0 <= m <= MAX_MEMORY for m in per)
            if not ok:
                raise ValueError(f"memory_per_layer must be None or a non-empty list of per-layer memory sizes in [0, {MAX_MEMORY}], got {str(per)[:80]}")
            self.memory_per_layer = list(per)
        if self.memory_score not in MEMORY_SCORES:
            raise ValueError(f"memory_score must be one of {list(MEMORY_SCORES)}, got {self.memory_score!r}")
        if self.memory_distance > 0 and self.feature_input != "unrotated":
            raise ValueError(f"memory_distance={self.memory_distance} re-reads memory keys un-rotated: it needs feature_input='unrotated', got {self.feature_input!r}")
        if self.memory_score == "query_mass" and self.window == 0 and self.any_memory:
            raise ValueError("memory_score='query_mass' ranks keys by the attention their exact window gives them; it needs window > 0")
        if self.memory_score == "feature_error" and self.feature_map == "none":
            raise ValueError("memory_score='feature_error' needs a feature state to score keys against; feature_map='none' has none (use memory_score='value_norm')")
        if self.gate and self.feature_map != "rfa":
            raise ValueError(f"gate=True needs feature_map='rfa', got feature_map={self.feature_map!r}")
        if self.layers is not None:
            ok = isinstance(self.layers, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_LAYER for i in self.layers)
            if not ok:
                raise ValueError(f"layers must be None or a list of layer indices in [0, {_MAX_LAYER}], got {self.layers!r}")
            self.layers = sorted(set(self.layers))
        if not isinstance(self.feature_map_options, dict):
            raise ValueError(f"feature_map_options must be a dict, got {type(self.feature_map_options).__name__}")
        bad = [k for k, v in self.feature_map_options.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise ValueError(f"feature_map_options {bad} must be finite numbers, got {[self.feature_map_options[k] for k in bad]}")
        reserved = {"head_dim", "num_features", "seed", "num_heads", "num_kv_heads", "gate", "decay"} & set(self.feature_map_options)
        if reserved:
            raise ValueError(f"feature_map_options may not set {sorted(reserved)}: use the RFAConfig fields")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "RFAConfig":
        """The attention settings of a named preset (:mod:`hf_rfa.presets`: ``"recall"``,
        ``"window-only"``, ``"encoder"``, ``"favor+"``, ``"rfa"``); ``overrides`` replace fields.
        An unknown name raises ``ValueError`` listing the names."""
        from .presets import get_preset

        return get_preset(name).config(**overrides)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RFAConfig":
        if not isinstance(d, dict):
            raise ValueError(f"rfa_config must be a dict of RFAConfig fields, got {type(d).__name__} {str(d)[:80]}")
        d = dict(d)
        if d.pop("per_head", True) is not True:  # saved before 0.1.0's clean-up; learned maps are always per head
            raise ValueError("per_head must be True (learned feature maps have one set of parameters per head)")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown RFAConfig fields {sorted(unknown)}; valid fields: {sorted(known)}")
        return cls(**d)

    @property
    def any_memory(self) -> bool:
        """Some layer keeps an exact memory (``memory > 0`` or a positive ``memory_per_layer`` entry)."""
        return self.memory > 0 or any(self.memory_per_layer or ())

    def memory_of(self, layer_idx: int | None) -> int:
        """The exact-memory size of layer ``layer_idx``: its ``memory_per_layer`` entry if given
        (ValueError for a layer past the list's end), else ``memory``."""
        if self.memory_per_layer is None or layer_idx is None:
            return self.memory
        if not 0 <= layer_idx < len(self.memory_per_layer):
            raise ValueError(f"memory_per_layer has {len(self.memory_per_layer)} entries but layer {layer_idx} is converted: give one size per layer")
        return self.memory_per_layer[layer_idx]

    def converts_layer(self, layer_idx: int) -> bool:
        return self.layers is None or layer_idx in self.layers
