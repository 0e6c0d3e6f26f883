"""Named recipes: one table of what a conversion uses, read by the commands, the main job, the
benchmarks and the training scripts.

A :class:`Preset` names an :class:`~hf_rfa.config.RFAConfig` (``rfa``: its fields) and the training
budgets of a conversion (``training``: :class:`~hf_rfa.recipes.conversion.config.ConversionConfig`
fields — attention-transfer and LoRA tokens and contexts, the exact memory switched on after
training). ``RFAConfig.from_preset(name)`` builds the attention settings, ``--preset NAME`` on every
command starts from both (explicit flags override), :func:`hf_rfa.linearize` runs the whole recipe.

    recall        rotary causal LMs (the recommended preset, the commands' default): Hedgehog m=64 on
                  q/k before the rotary embedding, learned decay, exact window 64 + 4 sinks, then an
                  exact memory of 256 keys per kv head on average chosen by feature error, split over
                  the layers by the original's induction share (``make main``)
    window-only   the strongest trivial baseline: the same window and sinks, no features, memory by ‖v‖
    encoder       BERT-style encoders (all-MiniLM-L6-v2): Hedgehog m=32 + window 8 + 1 sink,
                  attention transfer on packed 512-token passages
    favor+        plain FAVOR+ random features (m=256), no exact part
    rfa           plain RFA random Fourier features (m=128, learned scale), no exact part
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

#: the preset of every command when no ``--preset`` is given
DEFAULT_PRESET = "recall"


@dataclass(frozen=True)
class Preset:
    """A named recipe: ``RFAConfig`` fields (``rfa``) and ``ConversionConfig`` budget fields (``training``)."""

    name: str
    summary: str
    rfa: Mapping[str, Any]
    training: Mapping[str, Any] = field(default_factory=dict)

    def config(self, **overrides: Any):
        """This preset's :class:`~hf_rfa.config.RFAConfig`; ``overrides`` replace fields.

        ``feature_map_options`` belong to the preset's map: overriding ``feature_map`` alone drops them.
        """
        from .config import RFAConfig

        values = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in self.rfa.items()}
        if "feature_map" in overrides and overrides["feature_map"] != values.get("feature_map") and "feature_map_options" not in overrides:
            values.pop("feature_map_options", None)
        return RFAConfig(**{**values, **overrides})


def _frozen(**kw: Any) -> Mapping[str, Any]:
    return MappingProxyType(kw)


_WINDOW, _SINKS = 64, 4
#: the token budgets of the recall recipe (and its window-only baseline: the same LoRA). LoRA at
#: learning rate 3e-4 on 65,536 tokens keeps the original's few-shot accuracy that 1e-3 on 32,768
#: lost, at the same perplexity (research/short_task_loss/)
_CAUSAL_BUDGET = dict(context=1024, lora_tokens=65536, lora_lr=3e-4, lora_context=4096, memory_after_training=256)

PRESETS: Mapping[str, Preset] = MappingProxyType({
    "recall": Preset(
        "recall",
        "rotary causal LMs (recommended): Hedgehog m=64 on un-rotated q/k + decay 128 + window 64 + 4 sinks, "
        "then an exact memory of 256 keys per kv head on average, chosen by feature error and split over the layers by the original's induction share",
        _frozen(feature_map="hedgehog", num_features=64, window=_WINDOW, sinks=_SINKS, decay=128.0, feature_input="unrotated",
                memory_score="feature_error", feature_map_options=_frozen(hybrid_mix=True)),
        _frozen(transfer_tokens=131072, transfer_query_blocks=4, memory_split="induction", **_CAUSAL_BUDGET),
    ),
    "window-only": Preset(
        "window-only",
        "baseline: exact window 64 + 4 sinks, no features (every other key dropped), then an exact memory of 256 keys by value norm",
        _frozen(feature_map="none", window=_WINDOW, sinks=_SINKS, memory_score="value_norm"),
        _frozen(transfer_tokens=0, **_CAUSAL_BUDGET),
    ),
    "encoder": Preset(
        "encoder",
        "BERT-style encoders: Hedgehog m=32 + window 8 + 1 sink, attention transfer on packed 512-token passages",
        _frozen(feature_map="hedgehog", num_features=32, window=8, sinks=1, feature_map_options=_frozen(hybrid_mix=True)),
        _frozen(transfer_tokens=500_000, lora_tokens=0, encoder_max_length=512, encoder_pack_tokens=512, memory_after_training=0),
    ),
    "favor+": Preset(
        "favor+",
        "plain FAVOR+ positive random features, m=256, no exact part (LoRA only: nothing to transfer)",
        _frozen(feature_map="favor+", num_features=256, window=0, sinks=0),
        _frozen(transfer_tokens=0, context=1024, lora_tokens=8192, memory_after_training=0),
    ),
    "rfa": Preset(
        "rfa",
        "plain RFA random Fourier features, m=128 with a learned scale, no exact part",
        _frozen(feature_map="rfa", num_features=128, window=0, sinks=0),
        _frozen(transfer_tokens=131072, context=1024, lora_tokens=8192, memory_after_training=0),
    ),
})


def available_presets() -> dict[str, str]:
    """``{name: one-line summary}`` of every preset."""
    return {name: p.summary for name, p in PRESETS.items()}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ``ValueError`` listing the names otherwise."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"preset must be one of {list(PRESETS)}, got {name!r}") from None


__all__ = ["DEFAULT_PRESET", "PRESETS", "Preset", "available_presets", "get_preset"]
