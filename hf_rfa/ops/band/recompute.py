"""The exact band in training as a recomputing Function (O(N·D) activation memory).

The autograd form of the exact window/sinks (:func:`hf_rfa.ops.band.exact.band_block`) saves the
band probabilities of every layer (``N × (C + W + S)`` per query head). :class:`BandFunction` runs
the forward block by block without a graph and saves only its inputs; backward recomputes one
block's probabilities and writes its gradients by hand (:func:`band_block_grads`). The gradients are
those of the autograd form, which stays the reference twin (``tests/ops/test_recompute.py``;
float64 gradcheck). The causal hybrid's Function (:mod:`hf_rfa.ops.hybrid.function`) reuses
:func:`band_tiles`, :func:`band_numden` and :func:`band_block_grads`; the feature scan's Function is
:mod:`hf_rfa.ops.feature.recompute`.
"""

from __future__ import annotations

import torch

from ..masks import NEG, exp_floor, no_autocast
from .plan import BandPlan, gather_sinks


class BandFunction(torch.autograd.Function):
    """Exact band + sinks of the hybrid: ``(plan, xq [B,Hkv,G,N,D], xk [B,Hkv,N,D], v
    [B,Hkv,N,Dv])`` → ``(num [B,Hkv,G,N,Dv], den [B,Hkv,G,N], ls [B,Hkv,G,N])`` (ls, each row's
    max score, carries no gradient, as in the autograd form). Saves only xq, xk, v.

    Forward and backward run :func:`band_tiles` block by block (the G query heads of a kv head
    stacked as rows: the band keys are read once per kv head, not once per query head); backward
    recomputes a block's probabilities and writes its gradients by hand (four batched matmuls and
    an overlap-add of the chunks' key bands) instead of an autograd graph per block. Its twin is the
    autograd form :func:`hf_rfa.ops.band.exact.band_block` (``tests/ops/test_recompute.py``)."""

    @staticmethod
    def forward(ctx, plan: BandPlan, xq, xk, v):
        with torch.no_grad():
            num, den, ls = _band_apply(plan, xq, xk, v)
        ctx.plan = plan
        ctx.save_for_backward(xq, xk, v)
        ctx.mark_non_differentiable(ls)
        return num, den, ls

    @staticmethod
    @no_autocast  # a backward run inside torch.autocast (loss.backward() in the autocast block) stays float32
    def backward(ctx, dnum, dden, _dls):
        plan: BandPlan = ctx.plan
        xq, xk, v = (x.detach() for x in ctx.saved_tensors)
        with torch.no_grad():
            dq, dxk, dv = _band_apply(plan, xq, xk, v, dnum, dden)
        return None, dq, dxk, dv


def stack_rows(x: torch.Tensor, L: int, c: int) -> torch.Tensor:
    """``[B,Hkv,G,L·C,·]`` → ``[B,Hkv,L,G·C,·]`` (a chunk's G query heads stacked as rows)."""
    b, hkv, g, _, e = x.shape
    return x.reshape(b, hkv, g, L, c, e).transpose(2, 3).reshape(b, hkv, L, g * c, e)


def unstack_rows(x: torch.Tensor, g: int, c: int) -> torch.Tensor:
    """Inverse of :func:`stack_rows`: ``[B,Hkv,L,G·C,·]`` → ``[B,Hkv,G,L·C,·]``."""
    b, hkv, L, _, e = x.shape
    return x.reshape(b, hkv, L, g, c, e).transpose(2, 3).reshape(b, hkv, g, L * c, e)


def _band_masks(plan: BandPlan, c0: int, c1: int, dev) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Visible entries of the block's band ``[B,L,1,C,Kw]`` and sinks ``[B,L,1,C,S]`` (None when
    absent), as in :func:`hf_rfa.ops.band.exact.band_block` (broadcast over the G rows)."""
    c, L = plan.c, c1 - c0
    band_ok = sink_ok = None
    if plan.window > 0:
        span = slice(c0 * c, c1 * c + plan.left + plan.right)
        mp = torch.nn.functional.pad(plan.key_mask, (plan.left, plan.npad + plan.right - plan.n), value=False)
        mb = mp[:, span].unfold(1, plan.kw, c)  # [B,L,Kw]
        band_ok = (plan.band & mb.unsqueeze(-2)).unsqueeze(2)  # [B,L,1,C,Kw]
    if plan.sinks > 0:
        tt = torch.arange(c0 * c, c1 * c, device=dev).view(1, L, c, 1)
        sp = plan.spos[:, None, None, :]
        ok = plan.sexists[:, None, None, :].expand(plan.b, L, c, plan.sinks)
        if plan.causal:
            ok = ok & (sp <= tt)
        if plan.window > 0:
            in_band = ((sp <= tt) & (sp > tt - plan.window)) if plan.causal else ((sp - tt).abs() < plan.window)
            ok = ok & ~in_band
        sink_ok = ok.unsqueeze(2)  # [B,L,1,C,S]
    return band_ok, sink_ok


def band_tiles(plan: BandPlan, c0: int, c1: int, q6, kb, vb, ks, vs):
    """Probabilities of the query chunks ``[c0, c1)``: ``q6 [B,Hkv,L,G·C,D]`` (rows of
    :func:`stack_rows`), ``kb``/``vb [B,Hkv,T+left+right,·]`` the padded band keys/values (None without
    a window), ``ks``/``vs [B,Hkv,S,·]`` the sinks'. Returns ``(p_band [B,Hkv,L,G·C,Kw] | None,
    p_sink [B,Hkv,L,G·C,S] | None, r [B,Hkv,L,G·C], kbu, vbu)`` — probabilities relative to each
    row's max visible score r, clamped at :func:`exp_floor` and exactly 0 where not visible
    (the autograd form's values)."""
    b, hkv, L, gc, d = q6.shape
    c, g = plan.c, gc // plan.c
    band_ok, sink_ok = _band_masks(plan, c0, c1, q6.device)
    floor = exp_floor(q6.dtype)
    sb = ss = kbu = vbu = None
    r = None
    if band_ok is not None:
        kbu = kb.unfold(2, plan.kw, c)  # [B,Hkv,L,D,Kw] (view)
        vbu = vb.unfold(2, plan.kw, c)  # [B,Hkv,L,Dv,Kw] (view)
        sb = torch.matmul(q6, kbu)  # [B,Hkv,L,G·C,Kw]
        drop_b = ~band_ok  # [B,L,1,C,Kw]
        sb.view(b, hkv, L, g, c, -1).masked_fill_(drop_b.unsqueeze(1), NEG)
        r = sb.amax(-1)
    if sink_ok is not None:
        ss = torch.matmul(q6, ks.transpose(-1, -2).unsqueeze(2))  # [B,Hkv,L,G·C,S]
        drop_s = ~sink_ok
        ss.view(b, hkv, L, g, c, -1).masked_fill_(drop_s.unsqueeze(1), NEG)
        rs = ss.amax(-1)
        r = rs if r is None else torch.maximum(r, rs)
    out = []
    for sc, drop in ((sb, None if sb is None else drop_b), (ss, None if ss is None else drop_s)):
        if sc is None:
            out.append(None)
            continue
        sc.sub_(r.unsqueeze(-1)).clamp_(floor, 0.0).exp_()
        sc.view(b, hkv, L, g, c, -1).masked_fill_(drop.unsqueeze(1), 0.0)
        out.append(sc)
    return out[0], out[1], r, kbu, vbu


def _overlap_add(x: torch.Tensor, c: int, length: int) -> torch.Tensor:
    """Key-band gradients ``[B,Hkv,L,Kw,E]`` (chunk l's band starts at padded key l·C) summed
    into ``[B,Hkv,length,E]`` (the backward of ``unfold(2, Kw, C)``)."""
    b, hkv, L, kw, e = x.shape
    m = -(-kw // c)
    if m * c != kw:
        x = torch.nn.functional.pad(x, (0, 0, 0, m * c - kw))
    x = x.view(b, hkv, L, m, c, e)
    out = x.new_zeros(b, hkv, (L + m - 1) * c, e)
    for j in range(m):
        out[:, :, j * c : (j + L) * c] += x[:, :, :, j].reshape(b, hkv, L * c, e)
    return out[:, :, :length]


def band_numden(pb, ps, vbu, vs) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's exact ``(num [B,Hkv,L,G·C,Dv], den [B,Hkv,L,G·C])`` (rows of :func:`stack_rows`)
    from the probabilities of :func:`band_tiles`, the band values ``vbu [B,Hkv,L,Dv,Kw]`` and the
    sinks' ``vs [B,Hkv,S,Dv]`` (None where absent)."""
    num = torch.matmul(pb, vbu.transpose(-1, -2)) if pb is not None else None
    if ps is not None:
        ns = torch.matmul(ps, vs.unsqueeze(2))
        num = ns if num is None else num.add_(ns)
    den = pb.sum(-1) if pb is not None else None
    if ps is not None:
        den = ps.sum(-1) if den is None else den.add_(ps.sum(-1))
    return num, den


def band_block_grads(tiles: tuple, dn6, dd6, c: int):
    """Backward of one block of the exact part from its ``tiles = (pb, ps, q6, kbu, vbu, ks, vs)``
    (probabilities, stacked queries, band keys/values, sinks' keys/values) and the gradients of
    its rows' ``num`` (``dn6 [B,Hkv,L,G·C,Dv]``) and ``den`` (``dd6 [B,Hkv,L,G·C,1]``): ds = p ⊙ (dnum·vᵀ + dden),
    dq = ds·k, dk = dsᵀ·q, dv = pᵀ·dnum. Returns ``(dq6 [B,Hkv,L,G·C,D], dk_band, dv_band
    [B,Hkv,T+left+right,·] | None, dk_sinks, dv_sinks [B,Hkv,S,·] | None)`` — the band's key
    gradients already overlap-added over the padded span of :func:`band_tiles`."""
    pb, ps, q6, kbu, vbu, ks, vs = tiles
    dq6 = gk = gv = gks = gvs = None
    if pb is not None:
        length = (pb.shape[2] - 1) * c + pb.shape[-1]  # the padded span: T + left + right
        ds = torch.matmul(dn6, vbu).add_(dd6).mul_(pb)  # [B,Hkv,L,G·C,Kw]
        dq6 = torch.matmul(ds, kbu.transpose(-1, -2))
        gk = _overlap_add(torch.matmul(ds.transpose(-1, -2), q6), c, length)  # from [B,Hkv,L,Kw,D]
        gv = _overlap_add(torch.matmul(pb.transpose(-1, -2), dn6), c, length)  # from [B,Hkv,L,Kw,Dv]
    if ps is not None:
        dss = torch.matmul(dn6, vs.unsqueeze(2).transpose(-1, -2)).add_(dd6).mul_(ps)  # [B,Hkv,L,G·C,S]
        dqs = torch.matmul(dss, ks.unsqueeze(2))
        dq6 = dqs if dq6 is None else dq6.add_(dqs)
        gks = torch.matmul(dss.transpose(-1, -2), q6).sum(2)
        gvs = torch.matmul(ps.transpose(-1, -2), dn6).sum(2)
    return dq6, gk, gv, gks, gvs


def _band_apply(plan: BandPlan, xq, xk, v, dnum=None, dden=None):
    """Forward ``(num, den, ls)`` of the exact part over all blocks, or, with the output gradients
    ``dnum [B,Hkv,G,N,Dv]``/``dden [B,Hkv,G,N]``, its backward ``(dxq, dxk, dv)``: probabilities
    p recomputed per block, ds = p ⊙ (dnum·vᵀ + dden), dq = ds·k, dk = dsᵀ·q, dv = pᵀ·dnum (the
    row max is a constant, as in the autograd form; entries clamped at the exp floor — weights
    below 3e-38 of the row's largest — pass their tiny gradient instead of none)."""
    c, n, g = plan.c, plan.n, plan.g
    b, hkv = plan.b, plan.hkv
    dv_ = v.shape[-1]
    grad = dnum is not None or dden is not None
    xqp = plan.pad_queries(xq)
    kp = vp = None
    if plan.window > 0:
        kp, vp = plan.pad_keys(xk), plan.pad_keys(v)
    ks, vs = gather_sinks(xk, plan), gather_sinks(v, plan)
    if grad:
        dnum = torch.zeros(*xq.shape[:-1], dv_, dtype=xq.dtype, device=xq.device) if dnum is None else dnum
        dden = torch.zeros(xq.shape[:-1], dtype=xq.dtype, device=xq.device) if dden is None else dden
        extra = plan.npad - n
        dnum = torch.nn.functional.pad(dnum, (0, 0, 0, extra))
        dden = torch.nn.functional.pad(dden, (0, extra))
        dq = torch.empty_like(xqp)
        dkp = torch.zeros_like(kp) if kp is not None else None
        dvp = torch.zeros_like(vp) if vp is not None else None
        dks = torch.zeros_like(ks) if ks is not None else None
        dvs = torch.zeros_like(vs) if vs is not None else None
    nums, dens, lss = [], [], []
    for c0, c1 in plan.blocks():
        L = c1 - c0
        rows = slice(c0 * c, c1 * c)
        span = slice(c0 * c, c1 * c + plan.left + plan.right)
        q6 = stack_rows(xqp[:, :, :, rows], L, c)
        kb = kp[:, :, span] if kp is not None else None
        vb = vp[:, :, span] if vp is not None else None
        pb, ps, r, kbu, vbu = band_tiles(plan, c0, c1, q6, kb, vb, ks, vs)
        if not grad:
            num, den = band_numden(pb, ps, vbu, vs)
            nums.append(unstack_rows(num, g, c))
            dens.append(unstack_rows(den.unsqueeze(-1), g, c).squeeze(-1))
            lss.append(unstack_rows(r.unsqueeze(-1), g, c).squeeze(-1))
            continue
        dn6 = stack_rows(dnum[:, :, :, rows], L, c)  # [B,Hkv,L,G·C,Dv]
        dd6 = stack_rows(dden[:, :, :, rows].unsqueeze(-1), L, c)  # [B,Hkv,L,G·C,1]
        dq6, gk, gv, gks, gvs = band_block_grads((pb, ps, q6, kbu, vbu, ks, vs), dn6, dd6, c)
        if gk is not None:
            dkp[:, :, span] += gk
            dvp[:, :, span] += gv
        if gks is not None:
            dks += gks
            dvs += gvs
        dq[:, :, :, rows] = unstack_rows(dq6, g, c)
    if not grad:
        num, den, ls = (torch.cat(x, dim=-2 if x is nums else -1) if len(x) > 1 else x[0] for x in (nums, dens, lss))
        return num[..., :n, :], den[..., :n], ls[..., :n]
    left = plan.left
    dxk = dkp[:, :, left : left + n].clone() if dkp is not None else torch.zeros_like(xk)
    dv = dvp[:, :, left : left + n].clone() if dvp is not None else torch.zeros_like(v)
    if plan.sinks > 0:
        idx = plan.spos[:, None, :, None].expand(xk.shape[0], xk.shape[1], plan.sinks, xk.shape[-1])
        dxk.scatter_add_(2, idx, dks)
        dv.scatter_add_(2, idx[..., :1].expand(*idx.shape[:-1], dv_), dvs)
    return dq[:, :, :, :n], dxk, dv


__all__ = ["BandFunction", "band_block_grads", "band_numden", "band_tiles", "stack_rows", "unstack_rows"]
