"""The GPU backends ``flex`` and ``fla`` of a whole ``random_feature_attention`` call.

=========  ========================================================================================
``flex``   the exact window + sinks band by FlexAttention (:mod:`.flex`); the feature part by the
           PyTorch forms (``torch`` with autograd, the recomputing scan with ``checkpoint_blocks``;
           ``inference`` without)
``fla``    the feature scan (decay and gate included) by fla-core's chunked simple-GLA kernel
           (:mod:`.fla`, ``pip install hf_rfa[gpu]``), the band (if any) by FlexAttention; a row
           whose key scales the kernel cannot hold (:data:`.fla.SPREAD`) sends the call's feature
           part to the PyTorch forms
=========  ========================================================================================

Both answer causal calls with Nq == Nk (a prefill, a training step) and no exact memory; the
band and the feature part are merged under the shared normaliser in log space
(:func:`~hf_rfa.ops.partial.merge`, :func:`~hf_rfa.ops.partial.finalize`), as the PyTorch hybrid
does. :func:`settle` is the rule: ``auto`` on a CUDA tensor takes the first of :data:`GPU_ORDER`
that is available and answers the call, else the PyTorch rule of
:func:`hf_rfa.ops.backends.resolve`; a named GPU backend that cannot answer the call is refused
with a ValueError naming why. ``flex`` also runs on CPU when named (FlexAttention's eager forward,
the twin tests; no backward there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..feature.fused import ScanRun, causal_feature_attention
from ..feature.linear import shift_keys
from ..masks import sink_mask, to_output_dtype
from ..partial import Partial, finalize, merge
from ..rotary import unrotate
from . import fla, flex

logger = logging.getLogger(__name__)

#: ``auto`` on CUDA: the first of these that is available and answers the call
GPU_ORDER = ("fla", "flex")


@dataclass(frozen=True)
class CallFacts:
    """What :func:`unsupported` reads of a call (:func:`settle`'s keywords, ``dtype`` aside)."""

    grad: bool
    causal: bool
    window: int
    sinks: int
    memory: int
    nq: int
    nk: int
    feature_map: Any
    device: torch.device


def unsupported(name: str, call: CallFacts) -> str | None:
    """Why backend ``name`` cannot answer this call (one line), or None when it can."""
    if not call.causal:
        return "answers causal attention only"
    if call.memory > 0:
        return "does not answer memory > 0 (the exact memory runs its own PyTorch form)"
    if call.nq != call.nk:
        return f"answers calls with as many queries as keys only, got Nq={call.nq}, Nk={call.nk}"
    band = call.window > 0 or call.sinks > 0
    if band and call.grad and call.device.type != "cuda":
        return "needs a CUDA device for gradients (FlexAttention has no CPU backward)"
    null = getattr(call.feature_map, "null", False)
    if name == "flex" and not band:
        return "needs an exact band (window > 0 or sinks > 0)"
    if name == "fla" and (null or call.window >= call.nk):
        return "needs a feature part (feature_map other than 'none' and window < N)"
    if name == "fla" and call.grad and getattr(call.feature_map, "has_gate", False) and fla.gated_backward_refused(call.device):
        return ("cannot train a decay or gate on this GPU: fla-core refuses its gated backward on Hopper with "
                "Triton >= 3.4.0, < 3.7.1 (install tilelang, or Triton >= 3.7.1)")
    return None


def settle(be: str, requested: str, **call) -> str:
    """The backend of a whole call once :func:`~hf_rfa.ops.backends.resolve` chose ``be`` for
    ``requested``: for ``"auto"`` on CUDA the first of :data:`GPU_ORDER` that is available and
    answers the call (else ``be``); a named GPU backend is checked against the call (ValueError
    with :func:`unsupported`'s reason). ``call``: the fields of :class:`CallFacts` and ``dtype``."""
    from . import BACKENDS

    dtype = call.pop("dtype")
    facts = CallFacts(**call)
    device = facts.device
    if requested == "auto":
        if device.type != "cuda":
            return be
        return next((n for n in GPU_ORDER if BACKENDS[n].available(device, dtype) and unsupported(n, facts) is None), be)
    if be in GPU_ORDER:
        reason = unsupported(be, facts)
        if reason is not None:
            raise ValueError(f"backend={be!r} {reason}")
    return be


def gate_terms(feature_map, xk: torch.Tensor, key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated (or decaying) map's log terms of the PyTorch scan from scaled keys ``xk [B,Hkv,N,D]``:
    ``(key term [B,Hkv,N], query term [B,Hkv,1,N])`` = (log(1−g) − cumulative log g, cumulative
    log g); padded positions never decay (the PyTorch hybrid's terms)."""
    logg, log1mg = feature_map.log_gate(xk)
    if key_mask is not None:
        logg = logg * key_mask[:, None, :]
    cum = torch.cumsum(logg, dim=-1)
    return log1mg - cum, cum[:, :, None, :]


def attention(q, k, v, feature_map, key_mask, call, *, grad: bool, features: tuple = (None, None, None)) -> torch.Tensor:
    """A causal call (Nq == Nk == N, checked, finite inputs) by ``call.backend`` (``"flex"``/``"fla"``):
    q ``[B, H, N, D]``, k ``[B, Hkv, N, D]``, v ``[B, Hkv, N, Dv]``, ``key_mask [B, N]`` bool or
    None → ``[B, H, N, Dv]`` in q's dtype. ``call``: the :class:`~hf_rfa.ops.spec.CallPlan`
    (window, sinks, scale, its spec's chunk size and ``checkpoint_blocks``). ``features =
    (feature_q, feature_k, feature_rope)``: what the feature part reads (as in
    ``random_feature_attention``; the rotary embedding is undone up front here)."""
    feature_q, feature_k, feature_rope = features
    b, h, n, _ = q.shape
    window, sinks, scale = min(call.window, n), min(call.sinks, n), call.scale
    if feature_rope is not None:
        feature_q, feature_k = unrotate(q, *feature_rope), unrotate(k, *feature_rope)
    parts: list[Partial] = []
    if window > 0 or sinks > 0:
        parts.append(flex.band_partial(q, k, v, key_mask, window, sinks, scale))
    if window < n and not getattr(feature_map, "null", False):
        fq_in = q if feature_q is None else feature_q
        fk_in = k if feature_k is None else feature_k
        feat_mask = key_mask
        if sinks > 0:
            real = key_mask if key_mask is not None else torch.ones(b, n, dtype=torch.bool, device=q.device)
            feat_mask = real & ~sink_mask(key_mask, b, n, sinks, q.device)
        part = None
        if call.backend == "fla":
            part = fla.scan_partial(feature_map, fq_in, fk_in, v, feat_mask, key_mask, window, scale**0.5)
            if part is None and not torch.compiler.is_compiling():
                logger.debug("fla: a row's key scales span more than %g nats; the PyTorch scan answers", fla.SPREAD)
        if part is None:
            part = _torch_feature_part(feature_map, (fq_in, fk_in, v), (feat_mask, key_mask), window, call, grad)
        parts.append(part)
    total = parts[0]
    for p in parts[1:]:
        total = merge(total, p)
    out = finalize(total, feature_map.eps).reshape(b, h, n, -1)
    return to_output_dtype(out, q.dtype)


def _torch_feature_part(feature_map, inputs: tuple, masks: tuple, window: int, call, grad: bool) -> Partial:
    """The causal feature part by the PyTorch scan (:func:`~hf_rfa.ops.feature.fused.causal_feature_attention`)
    on keys delayed by ``window``: ``torch`` with autograd, ``inference`` without. ``inputs =
    (fq_in, fk_in, v)``, ``masks = (feat_mask, key_mask)``."""
    (fq_in, fk_in, v), (feat_mask, key_mask) = inputs, masks
    b, n = fk_in.shape[0], fk_in.shape[2]
    root = call.scale**0.5
    lk_add = lq_add = None
    if feature_map.has_gate:
        ct = torch.float64 if fk_in.dtype == torch.float64 else torch.float32
        lk_add, lq_add = gate_terms(feature_map, fk_in.to(ct) * root, key_mask)
    ks, vs, kmask = fk_in, v, feat_mask
    if window > 0:  # query t reads keys s <= t - W
        ks, vs = shift_keys(fk_in, window, 0.0), shift_keys(v, window, 0.0)
        lk_add = shift_keys(lk_add, window, 0.0) if lk_add is not None else None
        real = feat_mask if feat_mask is not None else torch.ones(b, n, dtype=torch.bool, device=fk_in.device)
        kmask = shift_keys(real, window, False, dim=1)
    scan_be = "torch" if grad else "inference"
    run = ScanRun(call.spec.chunk_size, x_scale=root, checkpoint=call.spec.checkpoint_blocks, backend=scan_be)
    part, _ = causal_feature_attention(feature_map, fq_in, ks, vs, (kmask, lq_add, lk_add), run)
    return part


__all__ = ["GPU_ORDER", "CallFacts", "attention", "gate_terms", "settle", "unsupported"]
