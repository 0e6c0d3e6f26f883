"""Closed-form initialisation of the hybrid maps' mixing weight (``mix``) before attention transfer.

:func:`init_mixing` sets each head's ``mix`` so that the feature part carries, on one captured
batch, the same (log-)mass as softmax puts on the keys outside the exact window and sinks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .calibration import Captured, feature_inputs, rfa_layers
from ...ops.masks import NEG, key_mask_bool, sink_mask

logger = logging.getLogger(__name__)


def _regions(cap: Captured, window: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, far) bool masks ``[B, 1, N, N]``: keys answered exactly / by the features."""
    b, n, dev = cap.q.shape[0], cap.k.shape[2], cap.q.device
    t = torch.arange(n, device=dev).view(-1, 1)
    s = torch.arange(n, device=dev).view(1, -1)
    visible = (s <= t) if cap.causal else torch.ones(n, n, dtype=torch.bool, device=dev)
    visible = visible.view(1, 1, n, n)
    km = key_mask_bool(cap.mask, b, n, cap.q.device)
    if km is not None:
        visible = visible & km.view(b, 1, 1, n)
    exact = torch.zeros(1, 1, n, n, dtype=torch.bool, device=dev)
    if window > 0:
        exact = (((s <= t) & (s > t - window)) if cap.causal else ((s - t).abs() < window)).view(1, 1, n, n)
    if sinks > 0:
        exact = exact | sink_mask(km, b, n, sinks, cap.q.device).view(b, 1, 1, n)
    exact = exact & visible
    return exact, visible & ~exact


@torch.no_grad()
def init_mixing(model: nn.Module, caps: dict[int, Captured]) -> int:
    """Closed-form init of each hybrid head's ``mix``: mean over queries of
    ``log Σ_far exp(q·k·scale) − log Σ_far φ(q)·φ(k)`` (far = keys not in window/sinks; φ(q)
    without the mix itself, with the log scales of norm-preserving features; with a ``decay``,
    each feature term times its decay γ^(t−s)).

    Returns the number of layers initialised (maps without ``hybrid_mix`` are skipped).
    """
    done = 0
    for idx, rfa in rfa_layers(model).items():
        fm = rfa.feature_map
        if not getattr(fm, "hybrid_mix", False) or (rfa.window == 0 and rfa.sinks == 0) or idx not in caps:
            continue
        cap = caps[idx]
        b, h, n, d = cap.q.shape
        g = h // cap.k.shape[1]
        scale = d**-0.5 if cap.scale is None else cap.scale
        xq, xk = cap.q.float() * scale**0.5, cap.k.float() * scale**0.5
        fq, fk = feature_inputs(rfa, cap)
        xq_f, xk_f = (xq, xk) if fq is None else (fq.float() * scale**0.5, fk.float() * scale**0.5)
        fq_, fk_ = fm.unmixed_queries(xq_f), fm.forward_keys(xk_f)
        phi_k = fk_.phi.repeat_interleave(g, 1)
        scores = xq @ xk.repeat_interleave(g, 1).transpose(-1, -2)  # [B,H,N,N]
        _, far = _regions(cap, rfa.window, rfa.sinks)
        far = far.expand(b, h, n, n)
        target = torch.logsumexp(torch.where(far, scores, torch.full_like(scores, NEG)), -1)
        w = fq_.phi @ phi_k.transpose(-1, -2)
        if fq_.log_scale is not None:  # norm-preserving features: φ = phi · exp(log_scale) (log ‖x‖)
            w = w * torch.exp(fq_.log_scale.unsqueeze(-1) + fk_.log_scale.repeat_interleave(g, 1).unsqueeze(-2))
        rate = getattr(fm, "decay_log_rate", None)
        if rate is not None:  # a decayed feature state: key s reaches query t with weight γ^(t−s)
            r = rate.detach().to(w.dtype).exp()
            r = r.expand(h) if r.numel() == 1 else r.repeat_interleave(h // r.numel())
            pos = torch.arange(n, device=w.device)
            dist = (pos.view(-1, 1) - pos.view(1, -1)).clamp_min(0).to(w.dtype)
            w = w * torch.exp(-r.view(1, h, 1, 1) * dist)
        feat = torch.log((w * far).sum(-1).clamp_min(1e-30))
        rows = far.any(-1)  # [B,H,N]
        diff = torch.where(rows, target - feat, torch.zeros_like(target)).sum((0, 2)) / rows.sum((0, 2)).clamp_min(1)
        if fm.mix.numel() == 1:
            diff = diff.mean().view(1)
        fm.mix.copy_(diff.to(fm.mix.dtype))
        done += 1
    logger.info("initialised the hybrid mix of %d layers from data", done)
    return done


__all__ = ["init_mixing"]
