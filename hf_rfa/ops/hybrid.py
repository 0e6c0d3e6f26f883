"""Exact softmax over a local window and attention sinks, as a :class:`Partial`.

The hybrid of ``random_feature_attention``: keys in the local window (causal: t−W < s ≤ t;
bidirectional: |t−s| < W) and the first ``sinks`` real tokens get exact ``exp(q·k·scale)``
weights; all other keys go through the feature map. Both parts are Partials in log space and
are merged under one normaliser (``partial.merge``). Queries are processed in chunks, so memory
is O(N·(C + W + S)), never N×N (unless W ≥ N, which is then exactly softmax).
"""

from __future__ import annotations

import torch

from .masks import NEG, exp_floor, sink_positions
from .partial import Partial


def _gather_keys(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x ``[B, Hkv, N, D]``, pos ``[B, S]`` → ``[B, Hkv, S, D]``."""
    idx = pos[:, None, :, None].expand(x.shape[0], x.shape[1], pos.shape[1], x.shape[-1])
    return torch.gather(x, 2, idx)


def exact_local(
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    window: int,
    sinks: int,
    causal: bool,
    chunk_size: int = 64,
) -> Partial:
    """Exact part of the hybrid.

    xq ``[B, Hkv, G, N, D]`` and xk ``[B, Hkv, N, D]`` already multiplied by √scale (so scores are
    ``xq·xk``), v ``[B, Hkv, N, Dv]``, key_mask ``[B, N]`` bool or None. Query t is position t.
    Returns a Partial whose log scale is each row's max exact score (NEG where none is visible).
    """
    b, hkv, g, n, d = xq.shape
    dev = xq.device
    floor = exp_floor(xq.dtype)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (xq, xk, v))
    kpos = torch.arange(n, device=dev)
    if sinks > 0:
        spos, sexists = sink_positions(key_mask, b, n, sinks, dev)  # [B,S]
        ks, vs = _gather_keys(xk, spos), _gather_keys(v, spos)
    nums, dens, lss = [], [], []
    for a0 in range(0, n, chunk_size):
        a1 = min(n, a0 + chunk_size)
        qc = xq[:, :, :, a0:a1]
        t = torch.arange(a0, a1, device=dev).view(-1, 1)  # [C,1]
        parts_s, parts_v, parts_ok = [], [], []
        if window > 0:
            lo = max(0, a0 - window + 1)
            hi = a1 if causal else min(n, a1 + window - 1)
            s = kpos[lo:hi].view(1, -1)
            band = ((s <= t) & (s > t - window)) if causal else ((s - t).abs() < window)  # [C,K]
            ok = band.view(1, a1 - a0, hi - lo)
            if key_mask is not None:
                ok = ok & key_mask[:, None, lo:hi]
            parts_s.append(qc @ xk[:, :, lo:hi].unsqueeze(2).transpose(-1, -2))  # [B,Hkv,G,C,K]
            parts_v.append(v[:, :, lo:hi])
            parts_ok.append(ok.expand(b, a1 - a0, hi - lo))
        if sinks > 0:
            sp = spos.unsqueeze(1)  # [B,1,S]
            ok = sexists.unsqueeze(1).expand(b, a1 - a0, sinks)
            tt = t.view(1, -1, 1)
            if causal:
                ok = ok & (sp <= tt)
            if window > 0:
                in_band = ((sp <= tt) & (sp > tt - window)) if causal else ((sp - tt).abs() < window)
                ok = ok & ~in_band
            parts_s.append(qc @ ks.unsqueeze(2).transpose(-1, -2))  # [B,Hkv,G,C,S]
            parts_v.append(vs)
            parts_ok.append(ok)
        scores = torch.cat(parts_s, dim=-1) if len(parts_s) > 1 else parts_s[0]
        drop = ~(torch.cat(parts_ok, dim=-1) if len(parts_ok) > 1 else parts_ok[0])[:, None, None]  # [B,1,1,C,K+S]
        vals = torch.cat(parts_v, dim=-2) if len(parts_v) > 1 else parts_v[0]  # [B,Hkv,K+S,Dv]
        # exponents clamped to [floor, 0] before the exp, masked entries zeroed after it: exp of
        # NEG or of denormal-producing exponents takes the CPU's slow path (7–60× slower)
        if grad:
            r = scores.masked_fill(drop, NEG).amax(-1).detach()  # [B,Hkv,G,C]
            p = torch.exp((scores - r.unsqueeze(-1)).clamp(floor, 0.0)).masked_fill(drop, 0.0)
        else:  # one buffer, in place
            p = scores.masked_fill(drop, NEG)
            r = p.amax(-1)
            p.sub_(r.unsqueeze(-1)).clamp_(floor, 0.0).exp_().masked_fill_(drop, 0.0)
        nums.append(p @ vals.unsqueeze(2))
        dens.append(p.sum(-1))
        lss.append(r)
    return Partial(torch.cat(nums, dim=-2), torch.cat(dens, dim=-1), torch.cat(lss, dim=-1))
