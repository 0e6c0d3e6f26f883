"""Output folders that nothing can lose: written aside, swapped in atomically, replaced only
when hf_rfa wrote them.

- :func:`check_target`: a non-empty target may only be replaced (``overwrite``) when it carries
  the :data:`MARKER` file that :func:`publish` writes, and never when it holds one of the run's
  inputs (a model folder, a text file); a target naming a file is refused.
- :func:`staging_dir`: a fresh ``parent/.tmp-<name>.*`` folder next to the target (same file
  system, so the final rename is atomic) with an owner file (host, pid, target); earlier ones
  whose process is gone are deleted first (:func:`remove_stale`) — only folders holding that
  owner file, never one holding a complete result, never anything else.
- :func:`publish`: rename the old target aside, rename the new folder in, then delete the old
  one. An interruption leaves the old or the new result complete under the target name (only a
  kill between the two renames leaves the old one in ``.tmp-<name>.old-*/<name>`` and the new
  one in ``.tmp-<name>.*``: both are kept by later runs); staging folders of killed runs are
  removed by the next run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: file in every folder hf_rfa publishes: only such folders may be replaced by ``overwrite``
MARKER = ".hf_rfa-output"
TMP_PREFIX = ".tmp-"
_OWNER = ".hf_rfa-owner"
#: a staging folder whose owner cannot be checked (another host) counts as stale after this
STALE_AGE_S = 24 * 3600.0


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _empty(folder: Path) -> bool:
    """No entries, or only a staging folder's owner file (a run writing into its own staging
    folder, e.g. the conversion pipeline calling ``export``)."""
    return all(p.name == _OWNER for p in folder.iterdir())


def check_target(out: str | os.PathLike, overwrite: bool, inputs: Iterable[str | os.PathLike | None] = (), flag: str = "overwrite", name: str = "output") -> Path:
    """The resolved target ``out``; ValueError when it must not be (re)written: it names a file,
    it is non-empty and ``overwrite`` is false, it was not written by hf_rfa (no :data:`MARKER`),
    or it contains one of ``inputs`` (paths that do not exist locally, e.g. Hub ids, are ignored).
    ``flag`` / ``name``: how the caller spells the overwrite option / the target in messages."""
    out = Path(out).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{name} {str(out)!r} is a file, not a folder: choose a folder path")
    for item in inputs:
        if item is None or not os.path.exists(item):
            continue
        src = Path(item).resolve()
        if _inside(src, out):
            raise ValueError(f"{name} {str(out)!r} contains the input {str(src)!r}: choose another output folder")
    if out.is_dir() and not _empty(out):
        if not overwrite:
            raise ValueError(f"{name} {str(out)!r} exists and is not empty (pass {flag})")
        if not (out / MARKER).is_file():
            raise ValueError(
                f"{name} {str(out)!r} was not written by hf_rfa (no {MARKER} file): {flag} only replaces "
                "folders hf_rfa wrote; choose a new folder or empty it yourself"
            )
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holds_result(folder: Path, name: str) -> bool:
    """A complete published result lies in ``folder`` (a publish killed between its renames)."""
    return (folder / MARKER).is_file() or (folder / name / MARKER).is_file()


def _stale_owned(folder: Path, name: str) -> bool:
    """``folder`` is a staging folder hf_rfa made for target ``name`` (its owner file says so)
    whose run is gone: same host and the process has exited, or another host and older than
    :data:`STALE_AGE_S`. A folder without the owner file is never hf_rfa's to delete."""
    owner = folder / _OWNER
    if not owner.is_file():
        return False
    info = json.loads(owner.read_text(encoding="utf-8"))
    if not isinstance(info, dict) or info.get("target", name) != name:
        return False
    if info.get("host") == socket.gethostname():
        return not _pid_alive(int(info["pid"]))
    return time.time() - folder.stat().st_mtime > STALE_AGE_S


def remove_stale(parent: Path, name: str) -> None:
    """Delete the ``parent/.tmp-<name>.*`` staging folders of killed runs: only those holding
    hf_rfa's owner file for this target (:func:`_stale_owned`) and no complete result. A complete
    result left by a publish killed between its renames is kept (a warning names it)."""
    prefix = f"{TMP_PREFIX}{name}."
    for old in parent.iterdir() if parent.is_dir() else ():
        if not old.name.startswith(prefix):
            continue  # a plain prefix test: the name is never a glob pattern
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if not old.is_dir() or old.is_symlink():
                continue
            if _holds_result(old, name):
                logger.warning("%s holds a complete result of an interrupted publish of %s: kept (move it into place or delete it yourself)", old, name)
                continue
            if _stale_owned(old, name):
                logger.info("removing the staging folder %s of an earlier, interrupted run", old)
                shutil.rmtree(old, ignore_errors=True)


def staging_dir(out: Path) -> Path:
    """A new empty staging folder next to ``out`` (owner file inside), after removing stale ones."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out.parent, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{out.name}.", dir=out.parent))
    (tmp / _OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "target": out.name}), encoding="utf-8")
    return tmp


def publish(tmp: Path, out: Path) -> Path:
    """Make the finished staging folder ``tmp`` the folder ``out`` (with :data:`MARKER`): old
    target renamed aside, new one renamed in, old one deleted."""
    (tmp / _OWNER).unlink(missing_ok=True)
    (tmp / MARKER).write_text(json.dumps({"written_by": "hf_rfa", "time": time.time()}) + "\n", encoding="utf-8")
    if out.is_dir() and _empty(out):
        if (out / _OWNER).exists():  # out is itself a staging folder: it keeps its owner
            os.replace(out / _OWNER, tmp / _OWNER)
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return out
    aside = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{out.name}.old-", dir=out.parent))
    os.replace(out, aside / out.name)
    os.replace(tmp, out)
    shutil.rmtree(aside, ignore_errors=True)
    return out
