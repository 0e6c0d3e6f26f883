"""Checks of a conversion's inputs before any stage runs: one ``ValueError`` line naming the flag,
the bad value and the fix, instead of an ``IndexError`` or a refused conversion minutes later.

:func:`check_inputs` runs before anything is loaded (texts and model paths); :func:`check_model`
right after the checkpoint is loaded (lengths against the model's positions, settings the model's
attention cannot take) and returns the warnings it logged (a window covering the whole context:
exact softmax).
"""

from __future__ import annotations

import logging
import os

from torch import nn

from .. import evaluation
from .config import ConversionConfig
from .loading import CAUSAL_LM

logger = logging.getLogger(__name__)

_TEXT_FORMS = "a local .txt/.csv/.tsv/.json/.jsonl/.parquet file, wikipedia:<split>, rotten_tomatoes:<split>, bbc_news:<split> or a Hub dataset name[:config]:split"
#: passage length of the copy task (:func:`hf_rfa.recipes.long_range.copy_task`'s default, used by the pipeline)
_COPY_PASSAGE = 256


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_inputs(cfg: ConversionConfig) -> None:
    """Local paths named by ``cfg`` exist (Hub ids and dataset names are not checked here)."""
    for name in ("calibration_text", "train_text", "eval_text"):
        value = getattr(cfg, name)
        if value and evaluation.looks_like_path(value) and not os.path.exists(os.path.expanduser(value)):
            raise ValueError(f"{_flag(name)} {value!r}: no such file (give {_TEXT_FORMS})")
        if value:
            try:
                evaluation.check_asset_split(value)
            except ValueError as e:
                raise ValueError(f"{_flag(name)}: {e}") from None
    if evaluation.looks_like_path(cfg.model) and not os.path.exists(os.path.expanduser(cfg.model)):
        raise ValueError(f"--model {cfg.model!r}: no such folder or file (give a local folder, a .gguf file or a Hub id such as 'org/name')")


def has_rotary(model: nn.Module) -> bool:
    """Whether the model's attention takes rotary position embeddings."""
    from ...hf.convert import find_attention_modules
    from ...hf.rope import takes_position_embeddings

    return any(takes_position_embeddings(m) for _, m, _ in find_attention_modules(model))


def is_bidirectional(model: nn.Module) -> bool:
    """Whether any of the model's attention modules is bidirectional (an encoder's)."""
    from ...hf.convert import find_attention_modules

    return any(getattr(m, "is_causal", True) is False for _, m, _ in find_attention_modules(model))


def _lengths(cfg: ConversionConfig) -> dict[str, int]:
    """The longest sequence each causal-LM flag feeds the model."""
    out = {"--context": cfg.context, "--lora-context": cfg.lora_context or cfg.context, "--eval-contexts": max(cfg.eval_contexts)}
    if cfg.passkey_lengths:
        out["--passkey-lengths"] = max(cfg.passkey_lengths)
    if cfg.copy_gaps:
        out["--copy-gaps"] = max(cfg.copy_gaps) + 2 * _COPY_PASSAGE
    return out


def _positions(model: nn.Module) -> int | None:
    c = model.config
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)


def learned_positions(model: nn.Module) -> int | None:
    """How many positions a model without rotary embeddings can read (None: rotary, or not recorded)."""
    return None if has_rotary(model) else _positions(model)


def memory_beyond_positions(model: nn.Module, tokens: int) -> str | None:
    """The warning for reading ``tokens`` with an exact memory past a rotary model's
    ``max_position_embeddings`` (None where that does not apply): the memory's keys then lie at
    rotary distances the model was never trained on, and on SmolLM2-135M (8,192 positions) the
    published model's memory raised perplexity at 12k and 16k tokens instead of lowering it. No
    warning when ``memory_distance`` clamps the distances below the limit."""
    from ...hf.convert import rfa_config_of

    cfg, limit = rfa_config_of(model), _positions(model)
    if cfg is None or not cfg.any_memory or not has_rotary(model) or limit is None or tokens <= limit or 0 < cfg.memory_distance < limit:
        return None
    return (f"{tokens} tokens with an exact memory: keys farther back than max_position_embeddings ({limit}) are read at rotary "
            f"distances the model was never trained on, and the memory hurts there (see docs/conversion.md); "
            f"--rfa memory_distance={limit - 1} reads them as if {limit - 1} back")


def check_model(cfg: ConversionConfig, model: nn.Module, kind: str) -> list[str]:
    """Refuse what the loaded model cannot run (``ValueError``); returns the warnings logged."""
    target = cfg.rfa_config()
    rotary = has_rotary(model)
    if target.feature_input == "unrotated" and not rotary:
        fix = "--preset encoder" if kind != CAUSAL_LM else "--feature-input rotated"
        raise ValueError(
            f"--feature-input unrotated (preset recall's) needs rotary position embeddings, which {cfg.model} ({type(model).__name__}) "
            f"does not have: use {fix}")
    if kind != CAUSAL_LM and is_bidirectional(model):
        causal_only = [f for f, on in (("--decay", target.decay), ("--memory", target.memory), ("--memory-after-training", cfg.memory_after_training)) if on]
        if causal_only:
            raise ValueError(f"{', '.join(causal_only)} need causal attention, but {cfg.model} is a bidirectional {kind}: use --preset encoder (or set them to 0)")
    warnings: list[str] = []
    limit = _positions(model)
    if kind == CAUSAL_LM:
        for flag, n in _lengths(cfg).items():
            if limit and n > limit:
                if not rotary:
                    raise ValueError(f"{flag} asks for {n} tokens but {cfg.model} has {limit} learned positions: use at most {limit} ({flag})")
                warnings.append(f"{flag}: {n} tokens is beyond the {limit} positions {cfg.model} was trained on (rotary embeddings extrapolate; quality may drop)")
        longest = cfg.context
    else:
        longest = cfg.encoder_max_length
    if target.window and target.window >= longest:
        what = "--context" if kind == CAUSAL_LM else "--encoder-max-length"
        warnings.append(
            f"--window {target.window} >= {what} {longest}: every key is inside the exact window, so training and evaluation up to "
            f"{target.window} tokens run exact softmax attention (the features only serve longer sequences; the model card says so)")
    for w in warnings:
        logger.warning("%s", w)
    return warnings


__all__ = ["check_inputs", "check_model", "has_rotary", "is_bidirectional", "learned_positions"]
