"""``hf_rfa.linearize``: what ``hf-rfa-convert`` does to the model, in one Python call, without the
evaluation and the export: (memory split) → convert → (init mixing) → attention transfer → LoRA →
exact memory. The memory split (``memory_split="induction"``) is measured on ``train_texts``, where
the command measures it on its calibration text.

It runs the conversion stages' own training steps (:func:`.stages.convert_target`,
:func:`.stages.init_mixing`, :func:`.stages.train_transfer`, :func:`.stages.train_lora`,
:func:`.stages.add_memory`) on the same seeded batches, so with the same preset, settings and
training text it builds the model the command line builds (tests compare the state dicts). The
command's baselines (``--baselines``, ``--window-only-baseline``) draw their LoRA initialisation
from the same global generator before the model's own stages: a run with baselines starts the
model's LoRA from another draw.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Sequence

import torch
from torch import nn

from .. import evaluation
from ...config import RFAConfig
from ...presets import DEFAULT_PRESET
from .config import ConversionConfig
from .loading import CAUSAL_LM, kind_of, load_model
from .state import State
from . import memory_split, stages
from ..._logging import error_line

logger = logging.getLogger(__name__)

_RFA_FIELDS = {f.name for f in fields(RFAConfig)}


def _config(name: str, model: str, overrides: dict[str, Any]) -> ConversionConfig:
    """The preset's ``ConversionConfig`` with ``overrides`` (``RFAConfig`` or ``ConversionConfig`` field names)."""
    own = {f.name for f in fields(ConversionConfig)}
    unknown = sorted(set(overrides) - own - _RFA_FIELDS)
    if unknown:
        raise ValueError(f"linearize got unknown settings {unknown}: give RFAConfig fields (e.g. window) or ConversionConfig fields (e.g. lora_tokens)")
    rfa = {k: v for k, v in overrides.items() if k in _RFA_FIELDS}
    rest = {k: v for k, v in overrides.items() if k not in _RFA_FIELDS}
    return ConversionConfig.from_preset(name, rfa=rfa, model=model, **rest)


def _load(model: nn.Module | str, tokenizer: Any) -> tuple[nn.Module, Any, str, str]:
    if isinstance(model, str):
        m, tok, kind = load_model(model)
        return m, tokenizer or tok, kind, model
    if not hasattr(model, "config"):
        raise ValueError(f"model must be a transformers model or a checkpoint name, got {type(model).__name__}")
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    if tokenizer is None:
        from transformers import AutoTokenizer

        if not getattr(model.config, "_name_or_path", ""):
            raise ValueError(f"the {name} given was not loaded from a checkpoint, so its tokenizer cannot be found: pass tokenizer=")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except OSError as e:
            reason = error_line(e)
            raise OSError(f"the tokenizer of {name!r} could not be loaded ({reason}): pass tokenizer=") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, kind_of(model.config), name


def _train_data(s: State, train_texts: str | Sequence[str]) -> None:
    """The training stream the command builds from ``--train-text`` (causal: token windows; encoders: sentences)."""
    cfg = s.cfg
    if s.kind == CAUSAL_LM:
        text = evaluation.load_text(train_texts) if isinstance(train_texts, str) else "\n".join(train_texts)
        s.ids["train"] = train = evaluation.tokenize(s.tok, text)
        s.train_stream = lambda: evaluation.shuffled_batches(train, cfg.context, cfg.batch_size, cfg.seed)
        return
    sentences = evaluation.load_labelled(train_texts)[0] if isinstance(train_texts, str) else list(train_texts)
    if cfg.encoder_pack_tokens:
        sentences = evaluation.pack_texts(s.tok, sentences, cfg.encoder_pack_tokens)
    if not sentences:
        raise ValueError("train_texts holds no text to train on")

    def stream():
        g = torch.Generator().manual_seed(cfg.seed)
        while True:
            order = torch.randperm(len(sentences), generator=g).tolist()
            yield from evaluation.sentence_batches(s.tok, [sentences[i] for i in order], 16, cfg.encoder_max_length)

    s.texts = {"train": sentences}
    s.train_stream = stream


def linearize(
    model: nn.Module | str,
    preset: str = DEFAULT_PRESET,
    train_texts: str | Sequence[str] | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    **settings: Any,
) -> nn.Module:
    """Convert ``model`` with ``preset`` and train it as ``hf-rfa-convert --preset`` does; returns it.

    Args:
        model: a transformers model (converted in place) or a checkpoint name / folder (loaded
            as the command loads it: float32, SDPA).
        preset: a name from :func:`hf_rfa.available_presets` (its settings and training budgets).
        train_texts: training text: a source as ``--train-text`` takes (a file, ``wikipedia:train``,
            ``name[:config]:split``) or a list of texts (causal LMs: joined by newlines). Needed
            unless the budgets are 0 (``transfer_tokens=0, lora_tokens=0``) and the memory is not
            split by measurement (``memory_split="uniform"`` or ``memory_after_training=0``).
        tokenizer: the model's tokenizer (default: loaded from the model's name).
        progress: progress bars of the training stages on stderr, as the command shows them (the
            recall preset trains for minutes); ``False`` for none.
        settings: overrides, by field name, of ``RFAConfig`` (``window=128``) or of the command's
            ``ConversionConfig`` (``lora_tokens=0``, ``context=512``, ``memory_after_training=0``).

    Returns the converted model (LoRA merged, exact memory switched on where the preset does),
    ready for ``generate``, ``save_pretrained`` or :func:`hf_rfa.export`.
    """
    m, tok, kind, name = _load(model, tokenizer)
    cfg = _config(preset, name, {"progress": progress, **settings})
    torch.manual_seed(cfg.seed)  # as the command's run: LoRA initialises from the global generator
    s = State(cfg=cfg, model=m, tok=tok, kind=kind, report={"rows": [], "stages": {}})
    if cfg.memory_split != "uniform" and cfg.memory_after_training > 0 and kind == CAUSAL_LM:  # measured on the original
        if train_texts is None:
            raise ValueError(f"memory_split={cfg.memory_split!r} measures the original model on text: give train_texts (or memory_split='uniform')")
        _train_data(s, train_texts)
        s.ids["calibration"] = s.ids["train"]  # the command measures on its calibration text
        memory_split.measure_split(s)
    stages.convert_target(s)
    # the command fits the mixing weights and trains whatever has a budget: both read the training text
    if stages._trainable(s) or (kind == CAUSAL_LM and cfg.lora_tokens > 0):
        if train_texts is None:
            raise ValueError(
                f"preset {preset!r} trains {s.label} (transfer_tokens={cfg.transfer_tokens}, lora_tokens={cfg.lora_tokens}): give "
                "train_texts (or use hf_rfa.convert(model, hf_rfa.RFAConfig.from_preset(...)) for the untrained model)")
        if s.train_stream is None:
            _train_data(s, train_texts)
        stages.init_mixing(s)
        stages.train_transfer(s)
        stages.train_lora(s)
    stages.add_memory(s)
    logger.info("linearized %s with preset %s: %s", name, preset, {k: v["tokens"] for k, v in s.stages.items()})
    return s.model.eval()


__all__ = ["linearize"]
