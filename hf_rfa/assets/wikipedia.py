"""Wikipedia articles (gensim's test dump) as clean text in disjoint calibration / train / eval splits."""

from __future__ import annotations

import bz2
import contextlib
import functools
import logging
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from .store import CALIBRATION_EVERY, EVAL_EVERY, GENSIM_PACKAGE, MIN_ARTICLE_CHARS, WIKIPEDIA_FILE, WIKIPEDIA_SPLITS, _FORMAT_VERSION, _atomic_write_json, _atomic_write_text, _package_file, _read_json, _timed, cache_dir

logger = logging.getLogger(__name__)

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


