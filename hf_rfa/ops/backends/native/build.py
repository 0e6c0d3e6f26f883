"""Safe building and loading of the compiled kernel (used by :func:`hf_rfa.ops.native.load`).

- The build folder must be owned by this user and writable by no one else (nor its parent,
  unless that is a sticky folder such as ``/tmp``): a library another user could replace is
  never loaded.
- Builds are serialised by an ``flock`` on ``<build folder>/hf_rfa.lock`` (released by the
  kernel when a process dies, so a killed build blocks nobody), waited for at most
  :func:`lock_timeout` seconds (``HF_RFA_NATIVE_LOCK_TIMEOUT``, default 300); on timeout the
  caller falls back to the PyTorch path.
- A library is loaded only if the marker file :data:`MARKER` written after a successful build
  and load vouches for it (SHA-256): a truncated or corrupted ``.so`` (a killed link, a full
  disk) is deleted and rebuilt instead of crashing the process with SIGBUS/SIGSEGV. Under the
  lock torch's own ``lock`` file can only be stale and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

#: file in the build folder mapping each verified library to its SHA-256
MARKER = "hf_rfa_build.json"
LOCK_FILE = "hf_rfa.lock"


def lock_timeout() -> float:
    """Seconds to wait for another process's build (``HF_RFA_NATIVE_LOCK_TIMEOUT``, default 300)."""
    raw = os.environ.get("HF_RFA_NATIVE_LOCK_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"HF_RFA_NATIVE_LOCK_TIMEOUT must be a finite number of seconds >= 0, got {raw!r}")
    return value


def check_folder(folder: Path) -> None:
    """RuntimeError unless ``folder`` is ours and writable by no one else (its parent too, unless
    sticky)."""
    uid = os.getuid()
    for path, sticky_ok in ((folder, False), (folder.parent, True)):
        st = path.stat()
        sticky = sticky_ok and bool(st.st_mode & stat.S_ISVTX)
        if (st.st_uid != uid and not sticky) or (st.st_mode & 0o022 and not sticky):
            raise RuntimeError(
                f"build folder {path} is writable by other users or not owned by uid {uid} (mode {stat.filemode(st.st_mode)}): "
                "refusing to load a library from it; set TORCH_EXTENSIONS_DIR to a private folder"
            )


@contextlib.contextmanager
def build_lock(folder: Path, timeout: float) -> Iterator[None]:
    """Hold the inter-process build lock of ``folder``; TimeoutError after ``timeout`` seconds."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for another process building the native kernel in {folder}") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _known(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def drop_unverified(folder: Path) -> None:
    """Under the lock: remove torch's (stale) ``lock`` file and every ``.so`` the marker does not
    vouch for, so that torch rebuilds it instead of loading it."""
    torch_lock = folder / "lock"
    if torch_lock.exists():
        logger.warning("hf_rfa: removing a stale build lock %s (left by a killed build)", torch_lock)
        torch_lock.unlink(missing_ok=True)
    known = _known(folder)
    for lib in folder.glob("*.so"):
        if known.get(lib.name) != _sha256(lib):
            logger.warning("hf_rfa: %s is not a verified build (interrupted or modified): rebuilding it", lib)
            lib.unlink()


def record(folder: Path, lib: Path) -> None:
    """Vouch for the library ``lib`` just built and loaded (atomic update of the marker)."""
    known = _known(folder)
    known[lib.name] = _sha256(lib)
    tmp = folder / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(known, indent=1), encoding="utf-8")
    os.replace(tmp, folder / MARKER)
