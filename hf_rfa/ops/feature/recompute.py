"""The causal feature scan in training as a recomputing Function (O(N·D) activation memory).

:class:`ScanFunction` runs the scan block by block without a graph and saves only its inputs (and
the ``[F, Dv+1]`` state entering each block); backward walks the blocks in reverse, recomputes one
block with autograd on block-local leaves (carrying the state's gradient) and accumulates its input
gradients. Its twin is the autograd form (:func:`hf_rfa.ops.feature.chunkwise.block_step` on
:func:`~hf_rfa.ops.feature.chunkwise.block_features`; ``tests/ops/test_recompute.py``). The causal
hybrid reuses :func:`scan_block` (:mod:`hf_rfa.ops.hybrid.function`).
"""

from __future__ import annotations

import functools

import torch

from ..autograd import add_grad, grads, leaf, param_leaves, with_params
from ..masks import no_autocast
from .chunkwise import Tokens, block_features, block_step
from .scan import ScanSpec, split_tokens


def scan_block(spec: ScanSpec, c: int, S, ref, tokens: Tokens):
    """One block of the causal feature scan from its :data:`~hf_rfa.ops.feature.chunkwise.Tokens`:
    ``(out [B,Hkv,G,T,Dv+1], ls [B,Hkv,G,T], S', ref')``."""
    hkv = tokens[1].shape[1]
    qf, lq, kf, lk, vb = block_features(spec.feature_map, tokens, spec.x_scale, spec.ct, hkv)
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
    def forward(ctx, spec: ScanSpec, *inputs):
        S0, ref0, key_mask, xq, xk, v, lq_add, lk_add = inputs[:8]
        params = inputs[8:]
        sizes = [t for t, _ in spec.plan]
        cut = _cuts(sizes, key_mask, xq, xk, v, lq_add, lk_add)
        S, ref = S0, ref0
        outs, lss, states, refs = [], [], [], []

        def run():
            nonlocal S, ref
            for i, (_, c) in enumerate(spec.plan):
                states.append(S)
                refs.append(ref)
                o, ls, S, ref = scan_block(spec, c, S, ref, tuple(x[i] for x in cut))
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
            leaves = [leaf(x[i]) if x[i] is not None and x[i].is_floating_point() else x[i] for x in cut]
            S_in = states[i].detach().requires_grad_()
            with torch.enable_grad():
                o, ls, S_out, _ = with_params(spec.feature_map, spec.names, params, functools.partial(scan_block, spec, c, S_in, refs[i], tuple(leaves)))
            got = grads([o, ls, S_out], [douts[i], dlss[i], dS], [S_in, *params, *leaves])
            dS = got[0]
            dparams = [add_grad(a, g_) for a, g_ in zip(dparams, got[1 : 1 + len(params)])]
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


__all__ = ["ScanFunction", "scan_block"]
