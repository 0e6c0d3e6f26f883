"""``evaluate`` metrics, with hf_rfa's offline implementations as the fallback.

``evaluate.load(NAME)`` fetches the metric's script from the Hugging Face Hub, so offline it
usually fails. :func:`load_metric` tries it first (a Hub name, or a local script / folder) and,
when it cannot be loaded, falls back to the offline implementation of the same name —
``accuracy``, ``f1``, ``precision``, ``recall`` — which takes the same arguments and gives the
same numbers on the same predictions (the definitions of scikit-learn, which the Hub's scripts
call). :func:`classification_metrics` builds a ``Trainer`` ``compute_metrics`` from names.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

AVERAGES = ("binary", "micro", "macro", "weighted")


def _arrays(predictions, references) -> tuple[np.ndarray, np.ndarray]:
    p, r = np.asarray(predictions).reshape(-1), np.asarray(references).reshape(-1)
    if p.shape != r.shape:
        raise ValueError(f"predictions has {p.size} entries but references has {r.size}")
    if not p.size:
        raise ValueError("predictions is empty: no metric to compute")
    return p, r


def accuracy(predictions, references, normalize: bool = True, sample_weight=None) -> dict[str, float]:
    """``{"accuracy": fraction (or count, normalize=False) of predictions equal to references}``."""
    p, r = _arrays(predictions, references)
    w = np.ones(p.size) if sample_weight is None else np.asarray(sample_weight, dtype=float).reshape(-1)
    hits = float(((p == r) * w).sum())
    return {"accuracy": hits / float(w.sum()) if normalize else hits}


def _counts(p: np.ndarray, r: np.ndarray, label, w: np.ndarray) -> tuple[float, float, float]:
    tp = float(((p == label) & (r == label)) @ w)
    return tp, float((p == label) @ w) - tp, float((r == label) @ w) - tp  # tp, fp, fn


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0  # scikit-learn's zero_division default (0, with a warning there)


def _prf(kind: str, predictions, references, labels=None, pos_label=1, average: str = "binary", sample_weight=None) -> dict[str, float]:
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    p, r = _arrays(predictions, references)
    w = np.ones(p.size) if sample_weight is None else np.asarray(sample_weight, dtype=float).reshape(-1)
    present = np.unique(np.concatenate([p, r]))
    if average == "binary":
        if len(present) > 2:
            raise ValueError(f"average='binary' needs two classes, found {len(present)} ({present.tolist()[:5]}...); use average='macro', 'micro' or 'weighted'")
        chosen = [pos_label]
    else:
        chosen = list(present) if labels is None else list(labels)
    per = []
    for lab in chosen:
        tp, fp, fn = _counts(p, r, lab, w)
        prec, rec = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
        per.append((tp, fp, fn, {"precision": prec, "recall": rec, "f1": _ratio(2 * tp, 2 * tp + fp + fn)}[kind]))
    if average == "micro":
        tp, fp, fn = (sum(x[i] for x in per) for i in range(3))
        value = {"precision": _ratio(tp, tp + fp), "recall": _ratio(tp, tp + fn), "f1": _ratio(2 * tp, 2 * tp + fp + fn)}[kind]
    elif average == "weighted":
        support = [x[0] + x[2] for x in per]
        value = _ratio(sum(s * x[3] for s, x in zip(support, per)), sum(support))
    else:  # binary (one label) or macro
        value = sum(x[3] for x in per) / len(per)
    return {kind: float(value)}


f1 = functools.partial(_prf, "f1")
precision = functools.partial(_prf, "precision")
recall = functools.partial(_prf, "recall")

#: the offline implementations, by the ``evaluate`` name they stand in for
OFFLINE_METRICS: dict[str, Callable[..., dict[str, float]]] = {"accuracy": accuracy, "f1": f1, "precision": precision, "recall": recall}


@dataclass
class Metric:
    """A loaded metric: ``compute(predictions=..., references=..., **options) -> {name: value}``."""

    name: str
    source: str  # "evaluate" or "offline"
    _compute: Callable[..., dict[str, Any]]

    def compute(self, predictions, references, **options: Any) -> dict[str, Any]:
        return dict(self._compute(predictions=predictions, references=references, **options))


def _evaluate_load(name: str):
    import evaluate

    return evaluate.load(name)


def load_metric(name: str, fallback: bool = True) -> Metric:
    """``evaluate.load(name)`` when it can be loaded, else the offline metric of that name.

    Raises:
        ValueError: evaluate cannot load ``name`` and there is no offline implementation of it
            (or ``fallback=False``); the message names the offline ones.
    """
    try:
        loaded = _evaluate_load(name)
    except Exception as e:  # ImportError, FileNotFoundError / ConnectionError (no Hub), ...
        if not fallback or name not in OFFLINE_METRICS:
            raise ValueError(f"metric {name!r} could not be loaded with evaluate ({type(e).__name__}: {e}); "
                             f"offline implementations: {sorted(OFFLINE_METRICS)}") from e
        logger.info("evaluate.load(%r) failed (%s); using hf_rfa's offline %s", name, type(e).__name__, name)
        return Metric(name, "offline", OFFLINE_METRICS[name])
    return Metric(name, "evaluate", loaded.compute)


def classification_metrics(names: Sequence[str] = ("accuracy",), num_labels: int | None = None) -> Callable[[Any], dict[str, float]]:
    """A ``Trainer`` ``compute_metrics`` computing each metric in ``names`` on argmax predictions.

    ``f1`` / ``precision`` / ``recall`` use ``average="binary"`` with two labels and ``"macro"``
    otherwise. Works with or without ``preprocess_logits_for_metrics`` (logits are argmaxed).
    """
    if not names:
        raise ValueError("names is empty: give at least one metric, e.g. ['accuracy']")
    metrics = [load_metric(n) for n in names]

    def compute(eval_pred) -> dict[str, float]:
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        if isinstance(preds, tuple):
            preds = preds[0]
        preds = np.asarray(preds)
        if preds.ndim > np.asarray(labels).ndim:
            preds = preds.argmax(-1)
        n = num_labels if num_labels is not None else len(np.unique(np.concatenate([preds.reshape(-1), np.asarray(labels).reshape(-1)])))
        out: dict[str, float] = {}
        for m in metrics:
            opts = {"average": "binary" if n <= 2 else "macro"} if m.name in ("f1", "precision", "recall") else {}
            for k, v in m.compute(predictions=preds, references=labels, **opts).items():
                out[k] = float(v)
        return out

    return compute
