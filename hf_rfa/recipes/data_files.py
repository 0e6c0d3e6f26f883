"""Local data files through ``datasets.load_dataset`` — the one code path for every recipe.

``load_local(path)`` picks the builder by suffix (:data:`BUILDERS`): ``.csv``/``.tsv`` → ``"csv"``,
``.json``/``.jsonl`` → ``"json"`` (a ``{"data": [...]}`` file is read through ``field="data"``),
``.parquet`` → ``"parquet"``, anything else → ``"text"`` (``sample_by`` ``line`` | ``paragraph`` |
``document``). Used by the training data (:mod:`hf_rfa.recipes.training.data`) and the conversion/evaluation
text sources (:mod:`hf_rfa.recipes.evaluation`).
"""

from __future__ import annotations

import json
import os
from typing import Any

#: builder of ``datasets.load_dataset`` per file suffix (others: "text")
BUILDERS: dict[str, str] = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
SAMPLE_BY = ("line", "paragraph", "document")


def builder_of(path: str) -> str:
    """``"csv"`` | ``"json"`` | ``"parquet"`` | ``"text"`` for a file name."""
    return BUILDERS.get(os.path.splitext(path)[1].lower(), "text")


def _json_field(path: str) -> str | None:
    """``"data"`` for a JSON file holding ``{"data": [...]}``, else None (JSON lines / a list)."""
    if not path.lower().endswith(".json"):
        return None
    with open(path, encoding="utf-8") as f:
        head = f.read(1).strip() or f.read(64).lstrip()[:1]
    if head != "{":
        return None
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError:  # JSON lines starting with an object
            return None
    return "data" if isinstance(obj, dict) and isinstance(obj.get("data"), list) else None


def load_local(path: str | os.PathLike, sample_by: str = "line", what: str = "data file"):
    """A local file as a ``datasets.Dataset`` (see module docstring).

    Args:
        path: the file; its suffix chooses the builder.
        sample_by: for text files, one row per ``line``, ``paragraph`` (blank-line separated) or
            ``document`` (the whole file).
        what: the field name used in error messages (e.g. ``train_file``).
    Raises:
        ValueError: the file does not exist, or ``sample_by`` is not one of :data:`SAMPLE_BY`.
    """
    from datasets import load_dataset

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    if sample_by not in SAMPLE_BY:
        raise ValueError(f"sample_by must be one of {SAMPLE_BY}, got {sample_by!r}")
    builder = builder_of(path)
    kwargs: dict[str, Any] = {}
    if builder == "text":
        kwargs["sample_by"] = sample_by
    elif builder == "csv" and path.lower().endswith(".tsv"):
        kwargs["delimiter"] = "\t"
    elif builder == "json" and _json_field(path):
        kwargs["field"] = "data"
    return load_dataset(builder, data_files=os.path.abspath(path), split="train", **kwargs)
