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
reference twins (``tests/test_recompute.py``; float64 gradcheck).
"""

from __future__ import annotations

import torch

from .hybrid import BandPlan, band_block, band_forward, gather_sinks
from .chunkwise import block_features, block_step
from .scan import ScanSpec, split_tokens


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


class BandFunction(torch.autograd.Function):
    """Exact band + sinks of the hybrid: ``(plan, xq [B,Hkv,G,N,D], xk [B,Hkv,N,D], v
    [B,Hkv,N,Dv])`` → ``(num [B,Hkv,G,N,Dv], den [B,Hkv,G,N], ls [B,Hkv,G,N])`` (ls, each row's
    max score, carries no gradient, as in the autograd form). Saves only xq, xk, v."""

    @staticmethod
    def forward(ctx, plan: BandPlan, xq, xk, v):
        with torch.no_grad():
            num, den, ls = band_forward(plan, xq, xk, v)
        ctx.plan = plan
        ctx.save_for_backward(xq, xk, v)
        ctx.mark_non_differentiable(ls)
        return num, den, ls

    @staticmethod
    def backward(ctx, dnum, dden, _dls):
        plan: BandPlan = ctx.plan
        xq, xk, v = (x.detach() for x in ctx.saved_tensors)
        c, n = plan.c, plan.n
        extra = plan.npad - n
        dnum = torch.zeros_like(xq[..., : v.shape[-1]].expand(*xq.shape[:-1], v.shape[-1])) if dnum is None else dnum
        dden = torch.zeros(xq.shape[:-1], dtype=xq.dtype, device=xq.device) if dden is None else dden
        dnum = torch.nn.functional.pad(dnum, (0, 0, 0, extra))
        dden = torch.nn.functional.pad(dden, (0, extra))
        xqp = plan.pad_queries(xq)
        dq = torch.zeros_like(xqp)
        kp = vp = dkp = dvp = None
        if plan.window > 0:
            kp, vp = plan.pad_keys(xk), plan.pad_keys(v)
            dkp, dvp = torch.zeros_like(kp), torch.zeros_like(vp)
        ks, vs = gather_sinks(xk, plan), gather_sinks(v, plan)
        dks = dvs = None
        for c0, c1 in plan.blocks():
            rows = slice(c0 * c, c1 * c)
            span = slice(c0 * c, c1 * c + plan.left + plan.right)
            leaves = [_leaf(xqp[:, :, :, rows]), _leaf(kp[:, :, span] if kp is not None else None), _leaf(vp[:, :, span] if vp is not None else None), _leaf(ks), _leaf(vs)]
            with torch.enable_grad():
                num, den, _ = band_block(plan, c0, c1, *leaves)
            gq, gk, gv, gks, gvs = _grads([num, den], [dnum[:, :, :, rows], dden[:, :, :, rows]], leaves)
            if gq is not None:
                dq[:, :, :, rows] = gq
            if gk is not None:
                dkp[:, :, span] += gk
            if gv is not None:
                dvp[:, :, span] += gv
            dks, dvs = _add(dks, gks), _add(dvs, gvs)
        left = plan.left
        dxk = dkp[:, :, left : left + n].clone() if dkp is not None else torch.zeros_like(xk)
        dv = dvp[:, :, left : left + n].clone() if dvp is not None else torch.zeros_like(v)
        if plan.sinks > 0:
            idx = plan.spos[:, None, :, None].expand(xk.shape[0], xk.shape[1], plan.sinks, xk.shape[-1])
            if dks is not None:
                dxk.scatter_add_(2, idx, dks)
            if dvs is not None:
                dv.scatter_add_(2, idx[..., :1].expand(*idx.shape[:-1], v.shape[-1]), dvs)
        return None, dq[:, :, :, :n], dxk, dv


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
    feature map's trainable parameters (their gradients come back through this Function). The
    incoming state gets no gradient (training starts from an empty state). Saves the inputs and
    the state entering each block (``[F, Dv+1]`` per kv head and block)."""

    @staticmethod
    def forward(ctx, spec: ScanSpec, S0, ref0, key_mask, xq, xk, v, lq_add, lk_add, *params):
        sizes = [t for t, _ in spec.plan]
        cut = _cuts(sizes, key_mask, xq, xk, v, lq_add, lk_add)
        S, ref = S0, ref0
        outs, lss, states, refs = [], [], [], []
        with torch.no_grad():
            for i, (_, c) in enumerate(spec.plan):
                states.append(S)
                refs.append(ref)
                o, ls, S, ref = _scan_block(spec, c, S, ref, *(x[i] for x in cut))
                outs.append(o)
                lss.append(ls)
        ctx.spec = spec
        ctx.save_for_backward(key_mask, xq, xk, v, lq_add, lk_add, torch.stack(states), torch.stack(refs))
        ref = ref.clone()  # (the unscaled form passes the incoming reference through)
        ctx.mark_non_differentiable(ref)
        return torch.cat(outs, dim=-2), torch.cat(lss, dim=-1), S, ref

    @staticmethod
    def backward(ctx, dout, dls, dS, _dref):
        spec: ScanSpec = ctx.spec
        key_mask, xq, xk, v, lq_add, lk_add, states, refs = ctx.saved_tensors
        sizes = [t for t, _ in spec.plan]
        cut = _cuts(sizes, key_mask, xq, xk, v, lq_add, lk_add)
        douts = split_tokens(dout, sizes, -2)
        dlss = split_tokens(dls, sizes, -1)
        params = [p for p in spec.feature_map.parameters() if p.requires_grad] if isinstance(spec.feature_map, torch.nn.Module) else []
        dparams: list[torch.Tensor | None] = [None] * len(params)
        blocks: list[list] = []
        for i in reversed(range(len(sizes))):
            c = spec.plan[i][1]
            leaves = [_leaf(x[i]) if x[i] is not None and x[i].is_floating_point() else x[i] for x in cut]
            S_in = states[i].detach().requires_grad_()
            with torch.enable_grad():
                o, ls, S_out, _ = _scan_block(spec, c, S_in, refs[i], *leaves)
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
