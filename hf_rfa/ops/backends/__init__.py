"""Which implementation computes an attention call: a small registry and one visible rule.

=============  ==================================================================================
``torch``      the autograd forms (``ops.feature.chunkwise``/``ops.feature.scan``, ``ops.band.exact``, ``ops.feature.linear``): training,
               and the reference every other backend is tested against
``inference``  the PyTorch inference form (:mod:`.causal_infer`: reused workspaces, in-place
               passes; bidirectional keys folded block by block) — no autograd
``compiled``   ``torch.compile``'d full blocks (:mod:`.kernels`; opt-in: ``hf_rfa.set_compile(True)``
               or ``HF_RFA_COMPILE=1``) — no autograd
``native``     the C++ CPU kernel (:mod:`.native`): the causal scan of the positive maps and the
               exact window/sink band; other parts run the ``inference`` form — no autograd,
               CPU float32 compute, where it builds (``hf_rfa.set_native`` / ``HF_RFA_NATIVE``)
``flex``       GPU: the exact window + sinks band by PyTorch's FlexAttention (:mod:`.flex`), the
               feature part by the PyTorch forms (:mod:`.gpu`); with autograd on CUDA; on CPU
               only when named (the eager forward, a twin; no backward)
``fla``        GPU: the causal feature scan (decay, gate) by fla-core's chunked simple-GLA kernel
               (:mod:`.fla`; ``pip install hf_rfa[gpu]``), the band by FlexAttention; CUDA,
               float32 compute; on CPU only when named under Triton's interpreter (a twin)
=============  ==================================================================================

``backend="auto"`` (the default, per call of ``random_feature_attention`` and per model in
``RFAConfig.backend``) is :func:`resolve`'s rule: with autograd ``torch``; without, the first
available of ``compiled``, ``native``, ``inference``. On a CUDA tensor a whole causal call of
``random_feature_attention`` (Nq == Nk, no memory) takes the first of ``fla``, ``flex`` that is
available and answers it (:func:`.gpu.settle`: ``fla`` needs a feature part, ``flex`` an exact
band), else the rule above; bidirectional calls, memory > 0 and Nq < Nk keep it. Where only a
feature scan is chosen (the decoding continuation, a bare scan) a GPU backend runs the PyTorch
forms (``torch`` with autograd, else ``inference``). A named backend is used as asked, or refused
with a ValueError saying why (autograd, not built, not enabled). The chosen backend is logged at
DEBUG level (logger ``hf_rfa.ops.attention``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from . import fla, flex, kernels, native


@dataclass(frozen=True)
class Backend:
    """``available(device, compute dtype)``: whether it can run here; ``inference_only``: refuses
    calls that record an autograd graph; ``causal_only``: it has kernels for causal calls only."""

    name: str
    description: str
    inference_only: bool
    available: Callable[[torch.device, torch.dtype], bool]
    unavailable_hint: str = ""
    causal_only: bool = False
    #: answers whole calls of ``random_feature_attention`` only (:mod:`.gpu`); a call that chooses
    #: only a feature scan gets the PyTorch forms instead
    whole_call: bool = False


BACKENDS: dict[str, Backend] = {}
#: ``auto`` without autograd: the first available of these
AUTO_ORDER = ("compiled", "native", "inference")


def register_backend(backend: Backend) -> Backend:
    """Add a backend to :data:`BACKENDS` (names are unique)."""
    if backend.name in BACKENDS or backend.name == "auto":
        raise ValueError(f"backend name {backend.name!r} is already taken")
    BACKENDS[backend.name] = backend
    return backend


register_backend(Backend("torch", "autograd forms (training; the reference twin of every other backend)", False, lambda d, t: True))
register_backend(Backend("inference", "PyTorch inference form (reused workspaces, in-place passes)", True, lambda d, t: True))
register_backend(Backend(
    "compiled", "torch.compile'd full blocks", True, lambda d, t: kernels.compile_enabled() and not torch.compiler.is_compiling(),
    "enable it with hf_rfa.set_compile(True) or HF_RFA_COMPILE=1",
))
register_backend(Backend(
    "native", "C++ CPU kernel (causal scan of positive maps, exact window/sink band)", True, native.usable,
    "it needs a CPU, float32 compute, hf_rfa.set_native(True), the compile kernels off and a successful build",
    causal_only=True,
))

register_backend(Backend(
    "flex", "FlexAttention band + PyTorch feature part (GPU; CPU forward as a twin)", False, flex.available,
    "it needs FlexAttention (PyTorch >= 2.5) and a CUDA or CPU tensor", causal_only=True, whole_call=True,
))
register_backend(Backend(
    "fla", "fla-core chunked feature scan (decay, gate) + FlexAttention band (GPU)", False, fla.available,
    "it needs a CUDA tensor (a CPU one only under Triton's interpreter, TRITON_INTERPRET=1), float32 compute and fla-core (pip install hf_rfa[gpu])", causal_only=True, whole_call=True,
))


def backend_names() -> tuple[str, ...]:
    """``("auto", <registered names>...)``: the values ``backend=`` accepts."""
    return ("auto", *BACKENDS)


def check_name(backend: str) -> str:
    if backend not in backend_names():
        raise ValueError(f"backend must be one of {list(backend_names())}, got {backend!r}")
    return backend


def _fits(be: Backend, causal: bool, device: torch.device, dtype: torch.dtype) -> bool:
    return (causal or not be.causal_only) and be.available(device, dtype)


def resolve(backend: str, *, grad: bool, causal: bool, device: torch.device, dtype: torch.dtype, whole_call: bool = False) -> str:
    """The backend that runs a call: ``backend`` as asked (ValueError if it cannot), or for
    ``"auto"`` ``torch`` when ``grad`` (an autograd graph is recorded) and otherwise the first
    of :data:`AUTO_ORDER` that is available and has kernels for the call (``causal``). A GPU
    backend (``whole_call``) asked where the caller is not a whole call gives the PyTorch form
    (``torch`` with ``grad``, else ``inference``); the GPU choice of ``"auto"`` is
    :func:`.gpu.settle`'s, after this."""
    check_name(backend)
    if backend == "auto":
        if grad:
            return "torch"
        return next((name for name in AUTO_ORDER if _fits(BACKENDS[name], causal, device, dtype)), "inference")
    be = BACKENDS[backend]
    if be.causal_only and not causal:
        raise ValueError(f"backend={backend!r} has kernels for causal attention only (use 'auto', 'inference' or 'torch')")
    if be.inference_only and grad:
        raise ValueError(f"backend={backend!r} runs without autograd only; this call records a graph (use 'torch' or 'auto')")
    if not be.available(device, dtype):
        raise ValueError(f"backend={backend!r} is not available for {device.type} {dtype}: {be.unavailable_hint}")
    if be.whole_call and not whole_call:
        return "torch" if grad else "inference"
    return backend


def training_backend(backend: str) -> str:
    """The backend a recipe trains a layer set to ``backend`` with: ``"auto"`` in place of one that
    runs without autograd only when this call records a graph (``torch.is_grad_enabled()``),
    else ``backend`` (a user's training call with such a layer gets :func:`resolve`'s ValueError)."""
    if torch.is_grad_enabled() and backend in BACKENDS and BACKENDS[backend].inference_only:
        return "auto"
    return backend


def honoured(backend: str) -> contextlib.AbstractContextManager:
    """The context a call that asked for ``backend`` runs in: one that asked for another backend
    than ``"auto"`` or ``"compiled"`` does not run the compiled kernels even where they are enabled."""
    if backend not in ("auto", "compiled") and kernels.compile_enabled():
        return kernels.suppressed()
    return contextlib.nullcontext()


__all__ = ["AUTO_ORDER", "BACKENDS", "Backend", "backend_names", "check_name", "honoured", "register_backend", "resolve", "training_backend"]
