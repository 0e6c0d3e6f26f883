"""Model card (README.md) of an exported hf_rfa model: YAML front matter + usage + settings + metrics.

The quality table shows only the numbers passed in ``metrics``; without them the card says that
no measurements were supplied. Nothing is estimated or filled in.
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


def _yaml_scalar(value: Any) -> str:
    # a JSON string is a valid YAML scalar (double-quoted style)
    return json.dumps(value, ensure_ascii=False)


def _front_matter(base_model: str | None, tags: list[str], pipeline_tag: str | None, license: str | None) -> str:
    lines = ["---"]
    if base_model:
        lines.append(f"base_model: {_yaml_scalar(base_model)}")
    lines.append("library_name: transformers")
    if license:
        lines.append(f"license: {_yaml_scalar(license)}")
    if pipeline_tag:
        lines.append(f"pipeline_tag: {_yaml_scalar(pipeline_tag)}")
    lines.append("tags:")
    lines.extend(f"- {_yaml_scalar(t)}" for t in tags)
    lines.append("---")
    return "\n".join(lines) + "\n"


def _check_value(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(f"{path} must be a number or a string, got {type(value).__name__}")
    if isinstance(value, numbers.Real) and not math.isfinite(float(value)):
        raise ValueError(f"{path} must be finite, got {value!r}")


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return value.replace("|", "\\|")
    if isinstance(value, numbers.Integral):
        return str(value)
    return f"{float(value):.4g}"


def metrics_table(metrics: dict[str, Any] | None) -> str:
    """Markdown table of measured metrics.

    ``{name: value}`` → a ``metric | value`` table; ``{name: {column: value}}`` (e.g. columns
    ``rfa``/``softmax``/``dataset``) → one row per name, columns in first-seen order. Values must
    be numbers or strings; ValueError names the bad entry (``metrics['ppl']['rfa']``).
    """
    if metrics is None or len(metrics) == 0:
        return "No quality measurements were supplied at export time.\n"
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a dict, got {type(metrics).__name__}")
    nested = [isinstance(v, dict) for v in metrics.values()]
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
) -> str:
    """The README.md text of an exported model (see module docstring)."""
    from .. import __version__

    tags = list(tags)
    title = f"{base_model} with random feature attention" if base_model else f"{model_class} with random feature attention"
    origin = f"[`{base_model}`](https://huggingface.co/{base_model})" if base_model else f"a `{model_class}`"
    hybrid = []
    if config.window:
        hybrid.append(f"exact softmax over a local window of {config.window} tokens")
    if config.sinks:
        hybrid.append(f"the first {config.sinks} tokens attended exactly (attention sinks)")
    hybrid_text = (" combined with " + " and ".join(hybrid)) if hybrid else ""
    size = f" ({num_parameters / 1e6:.1f}M parameters)" if num_parameters else ""
    intro = (
        f"This checkpoint is {origin}{size} whose softmax self-attention was replaced by **random feature "
        f"attention** with hf_rfa {__version__}: feature map "
        f"`{config.feature_map}` with {config.num_features} features per head{hybrid_text}. Attention "
        "costs linear time and memory in the sequence length. The random projections and any learned "
        "feature-map parameters are stored in the weights (`*.rfa.feature_map.*`), so outputs are reproducible."
    )
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
    return _front_matter(base_model, tags, pipeline_tag, license) + body
