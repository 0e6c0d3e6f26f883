"""Optional ``torch.compile`` of the elementwise-heavy inner functions (inference only).

The causal linear path is a handful of matmuls surrounded by elementwise passes (feature
exponentials, running-max decays, masks). Inductor fuses the elementwise passes into loops
around the matmuls. On this project's CPU the default eager inference form
(:mod:`hf_rfa.ops.backends.causal_infer`: reused buffers, in-place passes) has since measured faster
than the compiled functional block step (fp32, H = 12, m = 256, 2 threads: N = 2048 38.6 vs
48.9 ms, N = 16384 290.5 vs 350.5 ms; ``benchmarks/results/speed.md``), so compiling is an
opt-in for other devices and PyTorch versions, not a speed-up here: when it is enabled, full
blocks take the compiled functional step instead of the inference form.

Off by default (the first call of each shape compiles for seconds, and every call site must keep
a stable shape to avoid recompiling). Turn it on with :func:`set_compile` or the environment
variable ``HF_RFA_COMPILE=1``. Compiled functions are used only when

- compilation is enabled,
- no autograd graph is being recorded (``torch.is_grad_enabled()`` is False or no input
  requires grad) — training keeps the eager, tested-by-gradcheck path,
- we are not already inside ``torch.compile`` (a compiled model traces the eager functions).

Every compiled function has an eager twin (the function itself) and tests compare them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, TypeVar

import torch

from ..masks import needs_grad

_F = TypeVar("_F", bound=Callable)
_ENABLED = {"on": os.environ.get("HF_RFA_COMPILE", "0").strip().lower() in ("1", "true", "yes", "on")}
_COMPILED: dict[Callable, Callable] = {}
_LOCAL = threading.local()  # .suppressed: a call that chose another backend (see ops.backends)


def set_compile(enabled: bool) -> None:
    """Enable or disable the compiled inference kernels for this process."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}")
    _ENABLED["on"] = enabled


def compile_enabled() -> bool:
    """Whether :func:`set_compile` (or ``HF_RFA_COMPILE``) turned the compiled kernels on."""
    return _ENABLED["on"]


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """No compiled kernel inside this block (this thread), even when compiling is enabled: a call
    that asked for another backend."""
    before = getattr(_LOCAL, "suppressed", False)
    _LOCAL.suppressed = True
    try:
        yield
    finally:
        _LOCAL.suppressed = before


def wanted() -> bool:
    """Compiling is enabled and not suppressed for the current call."""
    return _ENABLED["on"] and not getattr(_LOCAL, "suppressed", False)


def active(*tensors: torch.Tensor | None) -> bool:
    """True when a compiled kernel may be used for a call on ``tensors`` (see module docstring)."""
    if not wanted() or torch.compiler.is_compiling():
        return False
    return not needs_grad(*tensors)


def compiled(fn: _F) -> _F:
    """The (cached) compiled twin of ``fn``: ``torch.compile(fn, fullgraph=True)``.

    Shapes are specialised on the first call; a second distinct shape makes torch recompile once
    with dynamic shapes, so callers should route only shape-stable calls here.
    """
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, fullgraph=True)
    return _COMPILED[fn]  # type: ignore[return-value]


def maybe_compiled(fn: _F, *tensors: torch.Tensor | None) -> _F:
    """``compiled(fn)`` when :func:`active` for ``tensors``, else ``fn`` itself."""
    return compiled(fn) if active(*tensors) else fn
