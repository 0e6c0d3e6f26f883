"""Exact softmax over a local window and attention sinks, as a :class:`Partial`.

The hybrid of ``random_feature_attention``: keys in the local window (causal: t−W < s ≤ t;
bidirectional: |t−s| < W) and the first ``sinks`` real tokens get exact ``exp(q·k·scale)``
weights; all other keys go through the feature map. Both parts are Partials in log space and
are merged under one normaliser (``partial.merge``). Queries are processed in chunks, so memory
is O(N·(C + W + S)), never N×N (unless W ≥ N, which is then exactly softmax).
"""

from __future__ import annotations

import torch

from ..masks import NEG, exp_floor, needs_grad, sink_positions
from ..partial import Partial, last_rows
from .plan import Band, BandPlan, band_plan, gather_keys, gather_sinks
from .recompute import BandFunction


def band_block(
    plan: BandPlan,
    c0: int,
    c1: int,
    qb: torch.Tensor,
    kb: torch.Tensor | None,
    vb: torch.Tensor | None,
    ks: torch.Tensor | None,
    vs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact part of the query chunks ``[c0, c1)``: qb ``[B, Hkv, G, T, D]`` (T = (c1−c0)·C padded
    queries), kb/vb ``[B, Hkv, T + left + right, ·]`` the padded keys/values of their bands (None
    without a window), ks/vs the sinks' keys/values. Returns ``(num [B,Hkv,G,T,Dv], den, r
    [B,Hkv,G,T])`` with r the row's max exact score (detached). Autograd form when any input
    needs a gradient, else one buffer in place."""
    b, hkv, g, c = plan.b, plan.hkv, plan.g, plan.c
    L = c1 - c0
    dev, d = qb.device, qb.shape[-1]
    floor = exp_floor(qb.dtype)
    grad = needs_grad(qb, kb, vb, ks, vs)
    qb = qb.reshape(b, hkv, g, L, c, d)
    kw = plan.kw
    parts_s, parts_ok, vals = [], [], []
    if plan.window > 0:
        span = slice(c0 * c, c1 * c + plan.left + plan.right)
        kbu = kb.unfold(2, kw, c)  # [B,Hkv,L,D,Kw]
        vbu = vb.unfold(2, kw, c)  # [B,Hkv,L,Dv,Kw]
        mp = torch.nn.functional.pad(plan.key_mask, (plan.left, plan.npad + plan.right - plan.n), value=False)
        mb = mp[:, span].unfold(1, kw, c)  # [B,L,Kw]
        parts_s.append(qb @ kbu.unsqueeze(2))  # [B,Hkv,G,L,C,Kw]
        parts_ok.append((plan.band & mb.unsqueeze(-2))[:, None, None])  # [B,1,1,L,C,Kw]
        vals.append(vbu.transpose(-1, -2).unsqueeze(2))  # [B,Hkv,1,L,Kw,Dv]
    if plan.sinks > 0:
        sinks, window, dv = plan.sinks, plan.window, vs.shape[-1]
        tt = torch.arange(c0 * c, c1 * c, device=dev).view(1, L, c, 1)
        sp = plan.spos[:, None, None, :]  # [B,1,1,S]
        ok = plan.sexists[:, None, None, :].expand(b, L, c, sinks)
        if plan.causal:
            ok = ok & (sp <= tt)
        if window > 0:
            in_band = ((sp <= tt) & (sp > tt - window)) if plan.causal else ((sp - tt).abs() < window)
            ok = ok & ~in_band
        parts_s.append(qb @ ks[:, :, None, None].transpose(-1, -2))  # [B,Hkv,G,L,C,S]
        parts_ok.append(ok[:, None, None])
        vals.append(vs[:, :, None, None].expand(b, hkv, 1, L, sinks, dv))
    scores = torch.cat(parts_s, dim=-1) if len(parts_s) > 1 else parts_s[0]
    drop = ~(torch.cat([o.expand(*o.shape[:3], L, c, o.shape[-1]) for o in parts_ok], dim=-1) if len(parts_ok) > 1 else parts_ok[0])
    vcat = torch.cat(vals, dim=-2) if len(vals) > 1 else vals[0]  # [B,Hkv,1,L,K,Dv]
    # exponents clamped to [floor, 0] before the exp, masked entries zeroed after it: exp of
    # NEG or of denormal-producing exponents takes the CPU's slow path (7–60× slower)
    if grad:
        r = scores.masked_fill(drop, NEG).amax(-1).detach()  # [B,Hkv,G,L,C]
        p = torch.exp((scores - r.unsqueeze(-1)).clamp(floor, 0.0)).masked_fill(drop, 0.0)
    else:  # one buffer, in place
        p = scores.masked_fill(drop, NEG)
        r = p.amax(-1)
        p.sub_(r.unsqueeze(-1)).clamp_(floor, 0.0).exp_().masked_fill_(drop, 0.0)
    dv = vcat.shape[-1]
    return (p @ vcat).reshape(b, hkv, g, L * c, dv), p.sum(-1).reshape(b, hkv, g, L * c), r.reshape(b, hkv, g, L * c)


def exact_local(
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    band: Band,
    recompute: bool = False,
) -> Partial:
    """Exact part of the hybrid.

    xq ``[B, Hkv, G, N, D]`` and xk ``[B, Hkv, N, D]`` already multiplied by √scale (so scores are
    ``xq·xk``), v ``[B, Hkv, N, Dv]``, key_mask ``[B, N]`` bool or None; ``band``: the window W,
    sinks S, causal or not, chunk and block lengths (:class:`~hf_rfa.ops.band.plan.Band`). Query t
    is position t. Returns a Partial whose log scale is each row's max exact score (NEG where none
    is visible).

    Queries go in chunks of C = ``band.chunk_size``; chunk i sees the key band ``[iC − left, iC + C
    + right)`` (left = W−1, right = 0 causal / W−1 bidirectional), taken from the padded keys with
    ``unfold`` (no copy); all chunks of a block of ``band.block_size`` queries are one batched matmul.
    ``recompute``: with autograd, keep only the inputs and recompute each block's probabilities
    in backward (:mod:`hf_rfa.ops.band.recompute`; O(N·D) saved instead of O(N·(C+W+S)) per head).
    """
    plan = band_plan(xq, key_mask, band.window, band.sinks, band.causal, band.chunk_size, band.block_size, nk=xk.shape[2])
    if recompute and needs_grad(xq, xk, v):
        num, den, ls = BandFunction.apply(plan, xq, xk, v)
        return Partial(num, den, ls)
    return Partial(*band_forward(plan, xq, xk, v))


def exact_local_last(
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    band: Band,
    rows: int,
    recompute: bool = False,
) -> Partial:
    """Causal :func:`exact_local` (``band.causal`` True) of the last ``rows`` query positions only (``[B,Hkv,G,rows,·]``):
    run on the keys those queries see — the sinks' keys gathered in front of the keys from the first
    window position on — with the matching last rows of ``xq [B,Hkv,G,N,D]``, when every sink exists
    and lies before that window (else :func:`exact_local` on all rows, then cut)."""
    window, sinks = band.window, band.sinks
    b, hkv, g, n, d = xq.shape
    c0 = n - rows - max(window - 1, 0)  # first key in any of the queries' windows
    fits = rows < n and c0 > 0
    if fits and sinks > 0:
        spos, sok = sink_positions(key_mask, b, n, sinks, xq.device)
        fits = bool(sok.all()) and int(spos.max()) < c0
    if not fits:
        return last_rows(exact_local(xq, xk, v, key_mask, band, recompute=recompute), rows)
    keys, vals, mask = xk[:, :, c0:], v[:, :, c0:], key_mask[:, c0:] if key_mask is not None else None
    if sinks > 0:  # the sinks in front: the crop's first S real tokens
        keys = torch.cat([gather_keys(xk, spos), keys], dim=2)
        vals = torch.cat([gather_keys(v, spos), vals], dim=2)
        if mask is not None:
            mask = torch.cat([sok, mask], dim=1)
    crop = keys.shape[2]  # sinks + W − 1 + rows
    return last_rows(exact_local(xq[..., n - crop :, :], keys, vals, mask, band, recompute=recompute), rows)


def band_forward(plan: BandPlan, xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All blocks of the exact part → ``(num [B,Hkv,G,N,Dv], den, ls [B,Hkv,G,N])``."""
    c, n = plan.c, plan.n
    xqp = plan.pad_queries(xq)
    kp = vp = None
    if plan.window > 0:
        kp, vp = plan.pad_keys(xk), plan.pad_keys(v)
    ks, vs = gather_sinks(xk, plan), gather_sinks(v, plan)
    nums, dens, lss = [], [], []
    for c0, c1 in plan.blocks():
        span = slice(c0 * c, c1 * c + plan.left + plan.right)
        kb = kp[:, :, span] if kp is not None else None
        vb = vp[:, :, span] if vp is not None else None
        num, den, r = band_block(plan, c0, c1, xqp[:, :, :, c0 * c : c1 * c], kb, vb, ks, vs)
        nums.append(num)
        dens.append(den)
        lss.append(r)
    num, den, ls = (torch.cat(x, dim=-2 if x is nums else -1) if len(x) > 1 else x[0] for x in (nums, dens, lss))
    return num[..., :n, :], den[..., :n], ls[..., :n]
