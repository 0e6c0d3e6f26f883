"""The state that the conversion stages (:mod:`.stages`) share, and how a variant is evaluated.

A stage reads and writes one :class:`State`: the model being converted, the texts, the report's
rows, the per-layer errors and the names of the variants measured so far. :func:`evaluate` adds
the rows of one variant — perplexity (causal LMs) or embedding cosine / accuracy (encoders), and
the long-range tasks — and is chosen by the model's kind from :data:`EVALUATORS`.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .. import evaluation, long_range
from ..intervals import fmt
from . import calibration, transfer
from ...config import CONFIG_ATTR, RFAConfig
from .config import ConversionConfig
from .host_memory import release_free_memory
from .loading import CAUSAL_LM, CLASSIFIER, ENCODER

logger = logging.getLogger(__name__)

Batches = Iterator[tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class State:
    """What the stages of one run share (filled in as they go)."""

    cfg: ConversionConfig
    model: nn.Module
    tok: Any
    kind: str
    report: dict[str, Any]
    #: per-layer attention-output errors, ``{variant: [LayerError]}`` (``layer_errors.md``)
    errors: dict[str, list] = field(default_factory=dict)
    #: model-card metrics of the final variant
    metrics: dict[str, dict] = field(default_factory=dict)
    #: causal: token ids ``[T]`` of the calibration / train / eval text
    ids: dict[str, torch.Tensor] = field(default_factory=dict)
    #: encoders: sentences of the calibration / train / eval text, eval labels (or None), reference embeddings
    texts: dict[str, Any] = field(default_factory=dict)
    #: calibration batches of the per-layer error table
    error_batches: list = field(default_factory=list)
    #: a fresh seeded stream of training batches (attention transfer; the first batch initialises mixing)
    train_stream: Callable[[], Batches] | None = None
    #: the converted layers' config and the rows' name of it
    target: RFAConfig | None = None
    label: str = ""
    #: the variant the model card reports (updated by every training stage)
    final: str = ""
    #: name of the window-only baseline's final row (None: not run)
    baseline: str | None = None
    #: what a baseline's LoRA changed in the model, until :meth:`restore` puts it back
    saved: Any = None

    def restore(self) -> None:
        """After a baseline's LoRA (trained and merged into the model itself): its weights as they
        were before it (:func:`.lora.restore_weights`)."""
        if self.saved is not None:
            from .lora import restore_weights

            restore_weights(self.model, self.saved)
            self.saved = None

    @property
    def rows(self) -> list[dict]:
        return self.report["rows"]

    @property
    def stages(self) -> dict[str, dict]:
        return self.report["stages"]

    def layer_errors(self, name: str) -> None:
        self.errors[name] = calibration.layer_errors(self.model, self.error_batches, progress=self.cfg.progress)


def evaluate(s: State, name: str, stage: dict | None = None, of: nn.Module | None = None, passkey: bool = False) -> None:
    """Append the rows of variant ``name`` (``of``, default the state's model); ``stage``: its training.
    What training freed (a model copy, its activations) first leaves the resident set
    (:func:`.host_memory.release_free_memory`)."""
    release_free_memory()
    EVALUATORS[s.kind](s, name, of if of is not None else s.model, passkey)
    if stage:
        for row in s.rows:
            if row["variant"] == name:
                row.update({"train_tokens": stage["tokens"], "train_minutes": stage["minutes"]})


def _evaluate_causal(s: State, name: str, model: nn.Module, passkey: bool) -> None:
    """Long-range tasks, then perplexity at every ``eval_contexts`` (the op's autograd form up to
    ``eval_twin_max``, its inference form above). The longest context runs first: a shorter
    context's window that begins where a longer one's did reads that forward's first positions
    (:func:`~hf_rfa.recipes.evaluation.perplexity`'s ``prefixes``; not for a length-dependent rotary)."""
    cfg = s.cfg
    _long_range(s, model, name, passkey)
    prefixes: dict[bool, dict] = {True: {}, False: {}}  # by form: the twin's and the chunked op's figures are not mixed
    rows = {}
    for ctx in sorted(set(cfg.eval_contexts), reverse=True):
        twin = ctx <= cfg.eval_twin_max and getattr(model.config, CONFIG_ATTR, None) is not None
        transfer.register_train()
        with calibration.attn_implementation(model, transfer.TRAIN_NAME) if twin else nullcontext():
            r = evaluation.perplexity(model, s.ids["eval"], ctx, cfg.eval_tokens, progress=cfg.progress, desc=name, seed=cfg.seed,
                                      prefixes=prefixes[twin])
        rows[ctx] = {
            "variant": name, "context": ctx, "perplexity": r["perplexity"], "perplexity_ci95": r["ci95"], "eval_tokens": r["tokens"],
            "windows": r["windows"], "window_nll": r["window_nll"], "window_tokens": r["window_tokens"],
            "op": "op (autograd form)" if twin else "chunked op",
        }
        logger.info("%s @%d: perplexity %s (%d tokens, %d windows)", name, ctx, fmt(r["perplexity"], r["ci95"]), r["tokens"], r["windows"])
    s.rows.extend(dict(rows[ctx]) for ctx in cfg.eval_contexts)


def classifier_scores(result: dict) -> dict:
    """A row's classifier figures from :func:`~hf_rfa.recipes.evaluation.accuracy`'s result: every
    metric (``accuracy`` and the ``--metric`` ones), without the example count."""
    return {k: v for k, v in result.items() if k != "examples"}


def _evaluate_encoder(s: State, name: str, model: nn.Module, passkey: bool) -> None:
    """Embedding cosine to the original's, and accuracy for classifiers with labels."""
    cfg, t = s.cfg, s.texts
    row = {"variant": name}
    n = cfg.encoder_max_length
    row.update(evaluation.embedding_cosine(t["reference"], evaluation.sentence_embeddings(model, s.tok, t["eval"], max_length=n, progress=cfg.progress)))
    if s.kind == CLASSIFIER and t["labels"] is not None:
        row.update(classifier_scores(evaluation.accuracy(model, s.tok, t["eval"], t["labels"], max_length=n, progress=cfg.progress, metrics=cfg.metric)))
    s.rows.append(row)
    logger.info("%s: %s", name, row)


#: how a variant is measured, by model kind
EVALUATORS: dict[str, Callable[[State, str, nn.Module, bool], None]] = {CAUSAL_LM: _evaluate_causal, ENCODER: _evaluate_encoder, CLASSIFIER: _evaluate_encoder}


def _long_range(s: State, model: nn.Module, name: str, passkey: bool) -> None:
    """Copy task at ``copy_gaps`` and (``passkey``) passkey retrieval, into ``report["long_range"]``."""
    cfg = s.cfg
    if not cfg.copy_gaps and not (passkey and cfg.passkey_lengths):
        return
    entry: dict[str, Any] = {"variant": name, "copy": {}, "passkey": None}
    for gap in cfg.copy_gaps:
        r = long_range.copy_task(model, s.ids["eval"], gap=gap, draws=cfg.copy_draws, seed=cfg.seed, progress=cfg.progress)
        r.pop("per_draw")
        entry["copy"][str(gap)] = r
        logger.info("%s copy @gap %d: second copy %s (first %.2f)", name, gap, fmt(r["second"], r["second_ci95"]), r["first"])
    if passkey and cfg.passkey_lengths:
        entry["passkey"] = long_range.passkey_task(model, s.tok, cfg.passkey_lengths, trials=cfg.passkey_trials, seed=cfg.seed, progress=cfg.progress)
        logger.info("%s passkey: %s", name, entry["passkey"]["mean"])
    s.report.setdefault("long_range", []).append(entry)


def rows_markdown(rows: list[dict]) -> str:
    """The printed / ``RESULTS.md`` table of every row."""
    keys = [k for k in ("variant", "context", "perplexity", "cosine_mean", "cosine_min", "accuracy", "f1", "precision", "recall", "eval_tokens", "sentences", "train_tokens", "train_minutes") if any(k in r for r in rows)]
    lines = ["| " + " | ".join(k + (" [95% CI]" if k == "perplexity" and any(r.get("perplexity_ci95") for r in rows) else "") for k in keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            if k == "perplexity" and r.get("perplexity_ci95"):
                cells.append(fmt(v, r["perplexity_ci95"], ".4g"))
                continue
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["EVALUATORS", "State", "classifier_scores", "evaluate", "rows_markdown"]
