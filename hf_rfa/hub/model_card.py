"""Model card (README.md) of an exported hf_rfa model: ``huggingface_hub.ModelCard`` metadata
(license, base_model, tags, ``model-index`` eval results) + usage + settings + metrics.

The quality table shows only the numbers passed in ``metrics``; without them the card says that
no measurements were supplied. Nothing is estimated or filled in. A value may carry its 95%
confidence interval as ``{"value": x, "ci95": [lo, hi]}`` (``ci95`` None: none measured); the
table shows it as ``x [lo, hi]`` and the ``model-index`` the value.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import fields
from typing import Any, Iterable

from ..config import RFAConfig


def _field_help() -> dict[str, str]:
    """``{field: help}`` of :class:`RFAConfig`: the card explains each setting in the config's own words."""
    return {f.name: f.metadata.get("help", f.name) for f in fields(RFAConfig)}


def eval_results(
    metrics: dict[str, Any] | None, task_type: str, dataset_name: str | None = None, dataset_type: str | None = None
) -> list:
    """``huggingface_hub.EvalResult`` per numeric entry of ``metrics`` (the card's ``model-index``).

    ``{name: value}`` → one result named ``name``; ``{name: {column: value}}`` → one per numeric
    column, named ``name [column]``. Strings are shown in the table only.
    """
    from huggingface_hub import EvalResult

    out = []
    for name, row in (metrics or {}).items():
        cells = row.items() if isinstance(row, dict) and not is_interval(row) else [(None, row)]
        for col, value in cells:
            value = value["value"] if is_interval(value) else value
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            label = name if col is None else f"{name} [{col}]"
            out.append(EvalResult(
                task_type=task_type, dataset_type=dataset_type or "custom", dataset_name=dataset_name or "held-out text (see the table)",
                metric_type=_slug(label), metric_name=label, metric_value=float(value),
            ))
    return out


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.lower()).strip("_") or "metric"


def card_data(
    base_model: str | None, tags: list[str], pipeline_tag: str | None, license: str | None,
    metrics: dict[str, Any] | None = None, model_name: str | None = None,
    dataset_name: str | None = None, dataset_type: str | None = None,
):
    """The card's metadata (``huggingface_hub.ModelCardData``), with eval results when measured."""
    from huggingface_hub import ModelCardData

    results = eval_results(metrics, pipeline_tag or "text-generation", dataset_name, dataset_type)
    return ModelCardData(
        base_model=base_model or None, library_name="transformers", license=license or None,
        pipeline_tag=pipeline_tag, tags=list(tags), model_name=model_name if results else None,
        eval_results=results or None,
    )


def is_interval(value: Any) -> bool:
    """Whether ``value`` is a figure with its interval: a dict with exactly the keys ``value`` and ``ci95``."""
    return isinstance(value, dict) and set(value) == {"value", "ci95"}


def _number(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{path} must be a number, got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{path} must be finite, got {value!r}")


def _check_value(path: str, value: Any) -> None:
    if is_interval(value):
        _number(f"{path}['value']", value["value"])
        ci = value["ci95"]
        if ci is not None:
            if not isinstance(ci, (list, tuple)) or len(ci) != 2:
                raise ValueError(f"{path}['ci95'] must be [lo, hi] or None, got {ci!r}")
            for i, b in enumerate(ci):
                _number(f"{path}['ci95'][{i}]", b)
        return
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"{path} must be a number, a string or {{'value': number, 'ci95': [lo, hi]}}, got {type(value).__name__}")
    if isinstance(value, numbers.Real) and not math.isfinite(float(value)):
        raise ValueError(f"{path} must be finite, got {value!r}")


def _fmt(value: Any) -> str:
    if is_interval(value):
        ci = value["ci95"]
        return _fmt(value["value"]) + ("" if ci is None else f" [{_fmt(ci[0])}, {_fmt(ci[1])}]")
    if isinstance(value, str):
        return value.replace("|", "\\|")
    if isinstance(value, numbers.Integral):
        return str(value)
    return f"{float(value):.4g}"


def metrics_table(metrics: dict[str, Any] | None) -> str:
    """Markdown table of measured metrics.

    ``{name: value}`` → a ``metric | value`` table; ``{name: {column: value}}`` (e.g. columns
    ``rfa``/``softmax``/``dataset``) → one row per name, columns in first-seen order. Values must
    be numbers, strings or figures with their interval (``{"value": x, "ci95": [lo, hi]}``, shown
    as ``x [lo, hi]``); ValueError names the bad entry (``metrics['ppl']['rfa']``).
    """
    if metrics is None or len(metrics) == 0:
        return "No quality measurements were supplied at export time.\n"
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict, got {type(metrics).__name__}")
    nested = [isinstance(v, dict) and not is_interval(v) for v in metrics.values()]
    if any(nested) and not all(nested):
        raise ValueError("metrics must be all {name: value} or all {name: {column: value}}, not a mix")
    for name in metrics:
        if not isinstance(name, str) or not name:
            raise ValueError(f"metrics keys must be non-empty strings, got {name!r}")
    if not any(nested):
        rows = ["| metric | value |", "| --- | --- |"]
        for name, value in metrics.items():
            _check_value(f"metrics[{name!r}]", value)
            rows.append(f"| {_fmt(name)} | {_fmt(value)} |")
        return "\n".join(rows) + "\n"
    columns: list[str] = []
    for name, row in metrics.items():
        for col, value in row.items():
            if not isinstance(col, str) or not col:
                raise ValueError(f"metrics[{name!r}] keys must be non-empty strings, got {col!r}")
            _check_value(f"metrics[{name!r}][{col!r}]", value)
            if col not in columns:
                columns.append(col)
    rows = ["| metric | " + " | ".join(_fmt(c) for c in columns) + " |", "| --- |" + " --- |" * len(columns)]
    for name, row in metrics.items():
        rows.append(f"| {_fmt(name)} | " + " | ".join(_fmt(row[c]) if c in row else "" for c in columns) + " |")
    return "\n".join(rows) + "\n"


def settings_table(config: RFAConfig) -> str:
    rows = ["| setting | value |", "| --- | --- |"]
    help_text = _field_help()
    for key, value in config.to_dict().items():
        if key == "layers" and value is None:
            value = "all"
        text = json.dumps(value) if isinstance(value, (dict, list, bool)) else str(value)
        text = text.replace("|", "\\|")
        label = help_text.get(key, key).replace("|", "\\|")
        rows.append(f"| `{key}`: {label} | {text} |")
    return "\n".join(rows) + "\n"


def _intro(config: RFAConfig, origin: str, num_parameters: int | None, version: str) -> str:
    """The model card's first paragraph: what the checkpoint is and how it attends."""
    hybrid = []
    if config.window:
        hybrid.append(f"exact softmax over a local window of {config.window} tokens")
    if config.sinks:
        hybrid.append(f"the first {config.sinks} tokens attended exactly (attention sinks)")
    if config.any_memory:
        chosen = {"feature_error": "the keys whose value the feature state recalls worst", "query_mass": "the keys their window's queries attended to most"}.get(config.memory_score, "the keys with the largest value norm")
        size = f"at most {config.memory}" if config.memory_per_layer is None else f"per-layer sizes of {min(config.memory_per_layer)}–{max(config.memory_per_layer)}"
        hybrid.append(f"an exact memory of {size} older keys per key-value head ({chosen}, re-chosen every {config.memory_every} tokens)")
    hybrid_text = (" combined with " + " and ".join(hybrid)) if hybrid else ""
    size = f" ({num_parameters / 1e6:.1f}M parameters)" if num_parameters else ""
    intro = (
        f"This checkpoint is {origin}{size} whose softmax self-attention was replaced by **random feature "
        f"attention** with hf_rfa {version}: feature map "
        f"`{config.feature_map}` with {config.num_features} features per head{hybrid_text}. Attention "
        "costs linear time and memory in the sequence length. The random projections and any learned "
        "feature-map parameters are stored in the weights (`*.rfa.feature_map.*`), so outputs are reproducible."
    )
    if config.window:
        intro += (
            f" Up to {config.window} tokens every key lies inside the exact window: there the model computes exact "
            "softmax attention, and the random features serve only keys further back."
        )
    return intro


def render_model_card(
    config: RFAConfig,
    model_class: str,
    auto_class: str,
    base_model: str | None = None,
    metrics: dict[str, Any] | None = None,
    tags: Iterable[str] = ("hf_rfa", "linear-attention", "random-feature-attention"),
    pipeline_tag: str | None = None,
    license: str | None = None,
    num_parameters: int | None = None,
    repo_id: str = "<this-repo>",
    dataset_name: str | None = None,
    dataset_type: str | None = None,
) -> str:
    """The README.md text of an exported model (see module docstring), built as a
    ``huggingface_hub.ModelCard`` (metadata: license, base_model, tags, model-index)."""
    from huggingface_hub import ModelCard

    from .. import __version__

    tags = list(tags)
    title = f"{base_model} with random feature attention" if base_model else f"{model_class} with random feature attention"
    origin = f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model else f"a `{model_class}`"
    intro = _intro(config, origin, num_parameters, __version__)
    body = f"""
# {title}

{intro}

## Usage

Without hf_rfa (the modeling code ships with this repository):

```python
from transformers import {auto_class}

model = {auto_class}.from_pretrained("{repo_id}", trust_remote_code=True)
```

With hf_rfa installed, no remote code is run:

```python
import hf_rfa

model = hf_rfa.from_pretrained("{repo_id}")  # a plain `{model_class}` with the "rfa" attention
```

Padding masks are supported; custom 4-D masks and packed sequences are not (linear attention only
sees a 2-D padding mask).

## Random feature attention settings

{settings_table(config)}
## Quality

{metrics_table(metrics)}
"""
    data = card_data(base_model, tags, pipeline_tag, license, metrics, model_name=title, dataset_name=dataset_name, dataset_type=dataset_type)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n{body}"))
