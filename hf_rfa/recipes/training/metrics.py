"""Metrics of the training recipes: accuracy and perplexity computed here; ``--metric NAME`` through
``evaluate`` with the offline fallback (:mod:`hf_rfa.integrations.metrics`)."""

from __future__ import annotations

import math

import numpy as np


def accuracy(predictions, references) -> float:
    """Fraction of equal entries (same definition as the Hub's ``accuracy`` metric)."""
    p, r = np.asarray(predictions).reshape(-1), np.asarray(references).reshape(-1)
    if p.shape != r.shape:
        raise ValueError(f"predictions has {p.size} entries but references has {r.size}")
    return float((p == r).mean()) if p.size else float("nan")


def perplexity(mean_loss: float) -> float:
    """exp(mean token cross-entropy), ``inf`` on overflow."""
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return float("inf")


def argmax_logits(logits, labels):
    """Trainer ``preprocess_logits_for_metrics``: keep class ids, not logits."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def classification_metrics(eval_pred) -> dict[str, float]:
    """Trainer ``compute_metrics`` for classification (after :func:`argmax_logits`)."""
    preds, labels = eval_pred.predictions, eval_pred.label_ids
    return {"accuracy": accuracy(preds, labels)}


def classification_metrics_for(names, num_labels: int | None = None):
    """Trainer ``compute_metrics`` for the ``--metric`` names (``evaluate`` when it loads, else offline)."""
    from ...integrations.metrics import classification_metrics as build

    return build(list(names), num_labels)
