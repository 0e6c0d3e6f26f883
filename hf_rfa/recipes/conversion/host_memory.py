"""The process's resident memory on the CPU: reading it, sampling its peak, and handing freed
memory back to the operating system.

On Linux, glibc's ``malloc`` keeps memory that was freed inside its heap for later use instead of
returning it: after a stage frees a model copy, logits or the float32 checkpoint a bf16 model was
cast from, the process stays hundreds of MiB larger than what it holds (on the quick SmolLM2
conversion in bf16, 0.3–0.5 GiB of free heap between stages). :func:`release_free_memory` asks
glibc to give back the free pages (``malloc_trim(0)``; a few milliseconds); the conversion calls
it between stages and evaluations, so the resident memory follows what the memory plan counts
(``--dry-run``). Elsewhere (macOS, Windows, musl) it does nothing.

Inside a stage, trimming does not help: glibc serves a block by a memory map of its own only above
a threshold that it raises to the size of every mapped block freed (up to 32 MiB), so after the
first few MiB-sized tensors are freed, later ones come from the heap, and a freed block that a
later allocation pins stays resident. Training at long context frees blocks of several MiB in
every decoder layer between longer-lived ones: on SmolLM2-135M's LoRA step at 4,096 tokens with
activation checkpointing, the resident memory after the forward was 2.37 GiB where the tensors it
needs take about 0.65. :func:`map_large_blocks` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``;
4 MiB by default, ``--malloc-mmap-threshold``): each larger block is unmapped when freed, and the
same step measured 0.84 GiB. ``hf-rfa-finetune``, ``hf-rfa-train`` and ``hf-rfa-evaluate`` set the
same 4 MiB when they run on the CPU. The cost is system time: a fresh map's pages are faulted in (zeroed)
on first touch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import threading


def rss_now() -> int:
    """This process's resident memory now (bytes); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _libc_function(name: str, argtypes: list, restype):
    """The C library's function ``name`` with its types set (None where the C library has none:
    not glibc)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` (None where the C library has none)."""
    return _libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


#: glibc's ``mallopt`` parameter ``M_MMAP_THRESHOLD`` (malloc.h)
_M_MMAP_THRESHOLD = -3
#: the largest threshold glibc accepts on 64-bit systems (``HEAP_MAX_SIZE / 2``), MiB
MAX_MMAP_THRESHOLD_MIB = 32
#: the environment variable by which a user sets glibc's threshold before the process starts
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
#: the threshold the commands set on the CPU (MiB): the conversion's ``--malloc-mmap-threshold``
#: default, and what ``hf-rfa-finetune``, ``hf-rfa-train`` and ``hf-rfa-evaluate`` set
DEFAULT_MMAP_THRESHOLD_MIB = 4


@functools.lru_cache(maxsize=1)
def _mallopt():
    """glibc's ``mallopt`` (None where the C library has none)."""
    return _libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)


def check_mmap_threshold(mib: int) -> int:
    """``mib`` if it is a threshold :func:`map_large_blocks` takes, else a one-line ValueError."""
    if isinstance(mib, bool) or not isinstance(mib, int) or not 0 <= mib <= MAX_MMAP_THRESHOLD_MIB:
        raise ValueError(f"malloc_mmap_threshold must be an int MiB in [0, {MAX_MMAP_THRESHOLD_MIB}] (0: glibc's default), got {mib!r}")
    return mib


def map_large_blocks(mib: int) -> bool:
    """From now on, serve every C-heap block of ``mib`` MiB or more by a memory map of its own,
    returned to the operating system when freed (glibc ``mallopt(M_MMAP_THRESHOLD)``; this also
    stops glibc raising the threshold by itself; see the module docstring). Whether it was set:
    False for ``mib=0`` (glibc's default kept), where :data:`MMAP_THRESHOLD_ENV` is set (the
    user's choice stands) and where the C library is not glibc."""
    check_mmap_threshold(mib)
    if mib == 0 or MMAP_THRESHOLD_ENV in os.environ:
        return False
    fn = _mallopt()
    return bool(fn(_M_MMAP_THRESHOLD, mib * 1024**2)) if fn is not None else False


def release_free_memory() -> bool:
    """Return the C heap's free pages to the operating system (glibc ``malloc_trim(0)``); whether
    anything was released (False where there is no glibc). Tensors and Python objects alive are
    untouched: only memory already freed leaves the resident set."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@contextlib.contextmanager
def measure_peak_rss(interval: float = 0.02):
    """``with measure_peak_rss() as peak:`` — ``peak[0]``, after the block, is the largest resident
    memory of the process seen during it (bytes), sampled every ``interval`` seconds by a thread
    (so a spike shorter than that can be missed); None where it cannot be read (not Linux). The
    process's own high-water mark (``ru_maxrss``, ``/usr/bin/time``) is left untouched."""
    out: list[int | None] = [None]
    first = rss_now() or None
    if first is None:
        yield out
        return
    best = [first]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            now = rss_now()
            if now > best[0]:
                best[0] = now

    t = threading.Thread(target=sample, name="hf_rfa-peak-rss", daemon=True)
    t.start()
    try:
        yield out
    finally:
        stop.set()
        t.join()
        out[0] = max(best[0], rss_now())


__all__ = ["DEFAULT_MMAP_THRESHOLD_MIB", "check_mmap_threshold", "map_large_blocks", "measure_peak_rss", "release_free_memory", "rss_now"]
