"""Training forms that keep activation memory O(N·D) per layer: recompute in backward.

The autograd forms of the hybrid's exact band (:func:`hf_rfa.ops.hybrid.band_block`) and of the
causal feature scan (:func:`hf_rfa.ops.chunkwise.causal_block` on
:func:`~hf_rfa.ops.chunkwise.block_features`) save, for every layer, the band probabilities
(``N × (C + W + S)`` per query head) and the block features (``N × F`` per head) and tiles.
The two :class:`torch.autograd.Function`\\ s here run the forward block by block without a graph
and save only their inputs (and, for the scan, the ``[F, Dv+1]`` state entering each block);
backward walks the blocks again (the scan in reverse, carrying the state's gradient), recomputes
one block with autograd on block-local leaves and accumulates its input gradients. Peak extra
memory is one block's graph. The gradients are those of the autograd forms, which stay the
reference twins (``tests/test_recompute.py``; float64 gradcheck). A causal hybrid in training
combines both in one Function that keeps q, k, v once (:mod:`hf_rfa.ops.hybrid_recompute`, which
reuses :func:`band_block_grads` and :func:`_scan_block`).
"""

from __future__ import annotations

import functools

import torch

from .exact import BandPlan, gather_sinks
from ..masks import NEG, exp_floor, no_autocast
from ..feature.chunkwise import block_features, block_step
from ..feature.scan import ScanSpec, split_tokens


def _leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    """A block-local autograd leaf (floating tensors only)."""
    if x is None or not x.is_floating_point():
        return x
    return x.detach().requires_grad_()


def _grads(outputs: list, grad_outputs: list, inputs: list) -> list:
    """``torch.autograd.grad`` over the pairs whose output needs a gradient; None for inputs
    that are None or unused."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None and o.requires_grad]
    live = [x for x in inputs if x is not None and x.requires_grad]
    if not pairs or not live:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], live, [g for _, g in pairs], allow_unused=True))
    return [next(got) if x is not None and x.requires_grad else None for x in inputs]


def _add(acc: torch.Tensor | None, g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return acc
    return g.clone() if acc is None else acc.add_(g)


def map_params(feature_map) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """The feature map's parameters as ``(names, tensors)`` (``named_parameters()``; frozen ones
    too; none for a map that is not a Module): what the recomputing Functions take as ``*params``
    and bind again in backward (:func:`with_params`). Under :func:`torch.func.functional_call`
    these are the substitute tensors."""
    if not isinstance(feature_map, torch.nn.Module):
        return (), ()
    named = list(feature_map.named_parameters())
    return tuple(n for n, _ in named), tuple(p for _, p in named)


class _Bind(torch.nn.Module):
    """Holds the feature map so that :func:`torch.func.functional_call` can rebind its
    parameters (as ``fm.<name>``) around any callable, not only the map's ``forward``."""

    def __init__(self, feature_map: torch.nn.Module) -> None:
        super().__init__()
        self.fm = feature_map

    def forward(self, fn):
        return fn()


def own_params(feature_map, names: tuple[str, ...], tensors) -> bool:
    """Whether ``tensors`` are the feature map's own parameters ``names`` (the same objects; not
    substitutes bound by :func:`torch.func.functional_call`)."""
    own = dict(feature_map.named_parameters())
    return all(own.get(n) is t for n, t in zip(names, tensors))


def with_params(feature_map, names: tuple[str, ...], tensors, fn):
    """``fn()`` with the feature map's parameters ``names`` bound to ``tensors`` (by
    :func:`torch.func.functional_call`; the map's own parameters are restored afterwards). The
    recomputing Functions run their backward's recomputation in it, on leaves of the parameter
    tensors passed to forward — never on whatever the map holds when backward runs (which differs
    under ``functional_call`` or after an in-place update)."""
    if not names:
        return fn()
    if own_params(feature_map, names, tensors):  # already bound (forward, outside functional_call):
        return fn()  # nothing to rebind — and no module mutation for torch.compile to break its graph on
    return torch.func.functional_call(_Bind(feature_map), {"fm." + n: t for n, t in zip(names, tensors)}, (fn,))


def param_leaves(params, needs) -> list:
    """Block-local leaves of the saved parameter tensors ``params``: requiring a gradient where
    ``needs`` (the Function's ``needs_input_grad`` of each) says so, detached otherwise."""
    return [p.detach().requires_grad_(bool(nd) and p.is_floating_point()) for p, nd in zip(params, needs)]


class BandFunction(torch.autograd.Function):
    """Exact band + sinks of the hybrid: ``(plan, xq [B,Hkv,G,N,D], xk [B,Hkv,N,D], v
    [B,Hkv,N,Dv])`` → ``(num [B,Hkv,G,N,Dv], den [B,Hkv,G,N], ls [B,Hkv,G,N])`` (ls, each row's
    max score, carries no gradient, as in the autograd form). Saves only xq, xk, v.

    Forward and backward run :func:`_band_tiles` block by block (the G query heads of a kv head
    stacked as rows: the band keys are read once per kv head, not once per query head); backward
    recomputes a block's probabilities and writes its gradients by hand (four batched matmuls and
    an overlap-add of the chunks' key bands) instead of an autograd graph per block. Its twin is the
    autograd form :func:`hf_rfa.ops.hybrid.band_block` (``tests/ops/test_recompute.py``)."""

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


def _rows(x: torch.Tensor, L: int, c: int) -> torch.Tensor:
    """``[B,Hkv,G,L·C,·]`` → ``[B,Hkv,L,G·C,·]`` (a chunk's G query heads stacked as rows)."""
    b, hkv, g, _, e = x.shape
    return x.reshape(b, hkv, g, L, c, e).transpose(2, 3).reshape(b, hkv, L, g * c, e)


def _unrows(x: torch.Tensor, g: int, c: int) -> torch.Tensor:
    """Inverse of :func:`_rows`: ``[B,Hkv,L,G·C,·]`` → ``[B,Hkv,G,L·C,·]``."""
    b, hkv, L, _, e = x.shape
    return x.reshape(b, hkv, L, g, c, e).transpose(2, 3).reshape(b, hkv, g, L * c, e)


def _band_masks(plan: BandPlan, c0: int, c1: int, dev) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Visible entries of the block's band ``[B,L,1,C,Kw]`` and sinks ``[B,L,1,C,S]`` (None when
    absent), as in :func:`hf_rfa.ops.hybrid.band_block` (broadcast over the G rows)."""
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


def _band_tiles(plan: BandPlan, c0: int, c1: int, q6, kb, vb, ks, vs):
    """Probabilities of the query chunks ``[c0, c1)``: ``q6 [B,Hkv,L,G·C,D]`` (rows of
    :func:`_rows`), ``kb``/``vb [B,Hkv,T+left+right,·]`` the padded band keys/values (None without
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
    """One block's exact ``(num [B,Hkv,L,G·C,Dv], den [B,Hkv,L,G·C])`` (rows of :func:`_rows`)
    from the probabilities of :func:`_band_tiles`, the band values ``vbu [B,Hkv,L,Dv,Kw]`` and the
    sinks' ``vs [B,Hkv,S,Dv]`` (None where absent)."""
    num = torch.matmul(pb, vbu.transpose(-1, -2)) if pb is not None else None
    if ps is not None:
        ns = torch.matmul(ps, vs.unsqueeze(2))
        num = ns if num is None else num.add_(ns)
    den = pb.sum(-1) if pb is not None else None
    if ps is not None:
        den = ps.sum(-1) if den is None else den.add_(ps.sum(-1))
    return num, den


def band_block_grads(pb, ps, q6, kbu, vbu, ks, vs, dn6, dd6, c: int):
    """Backward of one block of the exact part from the gradients of its rows' ``num``
    (``dn6 [B,Hkv,L,G·C,Dv]``) and ``den`` (``dd6 [B,Hkv,L,G·C,1]``): ds = p ⊙ (dnum·vᵀ + dden),
    dq = ds·k, dk = dsᵀ·q, dv = pᵀ·dnum. Returns ``(dq6 [B,Hkv,L,G·C,D], dk_band, dv_band
    [B,Hkv,T+left+right,·] | None, dk_sinks, dv_sinks [B,Hkv,S,·] | None)`` — the band's key
    gradients already overlap-added over the padded span of :func:`_band_tiles`."""
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
        q6 = _rows(xqp[:, :, :, rows], L, c)
        kb = kp[:, :, span] if kp is not None else None
        vb = vp[:, :, span] if vp is not None else None
        pb, ps, r, kbu, vbu = _band_tiles(plan, c0, c1, q6, kb, vb, ks, vs)
        if not grad:
            num, den = band_numden(pb, ps, vbu, vs)
            nums.append(_unrows(num, g, c))
            dens.append(_unrows(den.unsqueeze(-1), g, c).squeeze(-1))
            lss.append(_unrows(r.unsqueeze(-1), g, c).squeeze(-1))
            continue
        dn6 = _rows(dnum[:, :, :, rows], L, c)  # [B,Hkv,L,G·C,Dv]
        dd6 = _rows(dden[:, :, :, rows].unsqueeze(-1), L, c)  # [B,Hkv,L,G·C,1]
        dq6, gk, gv, gks, gvs = band_block_grads(pb, ps, q6, kbu, vbu, ks, vs, dn6, dd6, c)
        if gk is not None:
            dkp[:, :, span] += gk
            dvp[:, :, span] += gv
        if gks is not None:
            dks += gks
            dvs += gvs
        dq[:, :, :, rows] = _unrows(dq6, g, c)
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


def _scan_block(spec: ScanSpec, c: int, S, ref, xqb, xkb, vb, kmb, lqab, lkab):
    """One block of the causal feature scan: ``(out [B,Hkv,G,T,Dv+1], ls [B,Hkv,G,T], S', ref')``."""
    hkv = xkb.shape[1]
    qf, lq, kf, lk, vb = block_features(spec.feature_map, xqb, xkb, vb, kmb, lqab, lkab, spec.x_scale, spec.ct, hkv)
    if not spec.scaled:
        lk = None
    out, ls, S, ref = block_step(qf, lq, kf, lk, vb, S, ref, c)
    return out, (ls if lq is None else ls + lq), S, ref


class ScanFunction(torch.autograd.Function):
    """Causal feature scan (features computed block by block, as ``causal_feature_attention``):
    ``(spec, S0 [B,Hkv,F,Dv+1], ref0 [B,Hkv], key_mask [B,N] | None, xq [B,H,N,D], xk
    [B,Hkv,N,D], v [B,Hkv,N,Dv], lq_add [B,Hkv,G,N] | None, lk_add [B,Hkv,N] | None, *params)``
    → ``(out [B,Hkv,G,N,Dv+1], ls [B,Hkv,G,N], S [B,Hkv,F,Dv+1], ref [B,Hkv])``. ``params``: the
    feature map's parameters named ``spec.names`` (:func:`map_params`; their gradients come back
    through this Function); both passes evaluate the map on these tensors (:func:`with_params`),
    not on what the map holds when backward runs. The incoming state gets no gradient (training
    starts from an empty state). Saves the inputs, the parameters and the state entering each
    block (``[F, Dv+1]`` per kv head and block)."""

    @staticmethod
    def forward(ctx, spec: ScanSpec, S0, ref0, key_mask, xq, xk, v, lq_add, lk_add, *params):
        sizes = [t for t, _ in spec.plan]
        cut = _cuts(sizes, key_mask, xq, xk, v, lq_add, lk_add)
        S, ref = S0, ref0
        outs, lss, states, refs = [], [], [], []

        def run():
            nonlocal S, ref
            for i, (_, c) in enumerate(spec.plan):
                states.append(S)
                refs.append(ref)
                o, ls, S, ref = _scan_block(spec, c, S, ref, *(x[i] for x in cut))
                outs.append(o)
                lss.append(ls)

        with torch.no_grad():
            with_params(spec.feature_map, spec.names, params, run)
        ctx.spec = spec
        ctx.save_for_backward(key_mask, xq, xk, v, lq_add, lk_add, torch.stack(states), torch.stack(refs), *params)
        ref = ref.clone()  # (the unscaled form passes the incoming reference through)
        ctx.mark_non_differentiable(ref)
        return torch.cat(outs, dim=-2), torch.cat(lss, dim=-1), S, ref

    @staticmethod
    @no_autocast  # a backward run inside torch.autocast (loss.backward() in the autocast block) stays float32
    def backward(ctx, dout, dls, dS, _dref):
        spec: ScanSpec = ctx.spec
        key_mask, xq, xk, v, lq_add, lk_add, states, refs, *saved = ctx.saved_tensors
        sizes = [t for t, _ in spec.plan]
        cut = _cuts(sizes, key_mask, xq, xk, v, lq_add, lk_add)
        douts = split_tokens(dout, sizes, -2)
        dlss = split_tokens(dls, sizes, -1)
        # the parameter tensors forward ran with (saved), bound again for the recomputation
        params = param_leaves(saved, ctx.needs_input_grad[9:])
        dparams: list[torch.Tensor | None] = [None] * len(params)
        blocks: list[list] = []
        for i in reversed(range(len(sizes))):
            c = spec.plan[i][1]
            leaves = [_leaf(x[i]) if x[i] is not None and x[i].is_floating_point() else x[i] for x in cut]
            S_in = states[i].detach().requires_grad_()
            with torch.enable_grad():
                o, ls, S_out, _ = with_params(spec.feature_map, spec.names, params, functools.partial(_scan_block, spec, c, S_in, refs[i], *leaves))
            got = _grads([o, ls, S_out], [douts[i], dlss[i], dS], [S_in, *params, *leaves])
            dS = got[0]
            dparams = [_add(a, g_) for a, g_ in zip(dparams, got[1 : 1 + len(params)])]
            blocks.append(got[1 + len(params) :])
        blocks.reverse()
        # gradients of the sliced inputs, in the order of _cuts: xq, xk, v, key_mask, lq_add, lk_add
        full = []
        for j, (x, dim, pos) in enumerate(zip((xq, xk, v, key_mask, lq_add, lk_add), (2, 2, 2, 1, -1, -1), (4, 5, 6, 3, 7, 8))):
            parts = [blk[j] for blk in blocks]
            if x is None or not ctx.needs_input_grad[pos] or all(p is None for p in parts):
                full.append(None)
                continue
            pieces = [p if p is not None else torch.zeros_like(cut[j][i]) for i, p in enumerate(parts)]
            full.append(torch.cat(pieces, dim=dim))
        dxq, dxk, dv, _, dlq, dlk = full
        return (None, None, None, None, dxq, dxk, dv, dlq, dlk, *dparams)


def _cuts(sizes: list[int], key_mask, xq, xk, v, lq_add, lk_add) -> list:
    """Per-block slices of the scan's inputs (one split each, as the autograd form)."""
    return [split_tokens(xq, sizes, 2), split_tokens(xk, sizes, 2), split_tokens(v, sizes, 2), split_tokens(key_mask, sizes, 1), split_tokens(lq_add, sizes, -1), split_tokens(lk_add, sizes, -1)]
