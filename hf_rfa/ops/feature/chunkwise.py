"""One block of causal linear attention in chunkwise-parallel form (the autograd form).

Inputs are *features*, not q/k: ``qf [B, Hkv, G, T, F]`` (G query heads per key/value head —
grouped-query attention without materialising repeated K/V), ``kf [B, Hkv, T, F]`` (zero rows
for keys that must not contribute), values with a ones column appended ``va [B, Hkv, T, Dv+1]``
(:func:`with_ones`: numerator and denominator come out of the same matmuls), optional key log
scales ``lk [B, Hkv, T]`` (NEG for skipped keys), and the state entering the block ``S [B, Hkv,
F, Dv+1]`` (``Σ φ(k) [v, 1]ᵀ``) relative to ``ref [B, Hkv]``.

A block is L chunks of C tokens: within a chunk the product ``(φq φkᵀ ⊙ causal ⊙ decay) v`` is
exact; all chunks of the block are one batched matmul, and the states entering each chunk are
one small matmul of an ``[L, L]`` decay matrix with the per-chunk state increments (no Python
loop per chunk).

Stabilisation is streaming-safe: each query's scale is the running maximum of key log scales up
to and including that query (``cummax``), chunk states are stored relative to the running max at
the chunk's last key, and every decay factor is ``exp(earlier max − later max) ≤ 1``; masked
(future) entries are exact zeros, so no output depends on later tokens, even through a max or
through rounding. The scan over blocks is :mod:`hf_rfa.ops.feature.scan`; the inference form of this
step is :func:`hf_rfa.ops.backends.causal_infer.causal_block_into` (this is its twin).
"""

from __future__ import annotations

import torch

from ..masks import NEG, needs_grad

#: one block's ``(qf, lq, kf, lk, v)``
Block = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]

#: one block's raw inputs ``(xq [B,H,T,D], xk [B,Hkv,T,D], v [B,Hkv,T,Dv], key mask [B,T] | None,
#: query gate term [B,Hkv,G,T] | None, key gate term [B,Hkv,T] | None)``
Tokens = tuple


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """``[..., N, Dv]`` → ``[..., N, Dv+1]`` with a trailing column of ones (the denominator)."""
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


def _unscaled_tiles(q3, k3, v3, a, S, nc: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every key at log scale 0: ``(out [B·Hkv·L, G·C, Dv+1], S' [B·Hkv, F·(Dv+1)])`` from the
    chunk tiles ``q3 [B·Hkv·L, G·C, F]``, ``k3 [B·Hkv·L, C, F]``, ``v3 [B·Hkv·L, C, Dv+1]``, the
    masked intra-chunk scores ``a [B·Hkv·L, G, C, C]`` and the incoming state ``S``."""
    n3, c, f = k3.shape
    dv1 = v3.shape[-1]
    bh = n3 // nc
    U = torch.bmm(k3.transpose(1, 2), v3).view(bh, nc, f * dv1)  # chunk increments
    lower = torch.ones(nc, nc, dtype=U.dtype, device=U.device).tril(-1).expand(bh, nc, nc)
    P = torch.bmm(lower, U)
    P = P.add_(S.reshape(bh, 1, f * dv1)) if not grad else P + S.reshape(bh, 1, f * dv1)
    S_out = P[:, -1] + U[:, -1]
    inter = torch.bmm(q3, P.view(n3, f, dv1))  # [B·Hkv·L, G·C, Dv+1]
    out = inter.baddbmm_(a.view(n3, -1, c), v3)
    return out, S_out


def _scaled_tiles(q3, k3, v3, scores, drop, lk, state: tuple, grad: bool):
    """Keys with log scales ``lk [B,Hkv,T]`` and the incoming ``state = (S, ref)``: ``(out
    [B·Hkv·L, G·C, Dv+1], mt [B,Hkv,T], S' [B·Hkv, F·(Dv+1)], ref' [B,Hkv])`` — ``mt`` is each
    query's running max (its log scale)."""
    S, ref = state
    n3, c, f = k3.shape
    dv1, g = v3.shape[-1], scores.shape[1]
    b, hkv, t = lk.shape
    bh, nc = b * hkv, t // c
    mt = torch.maximum(torch.cummax(lk, dim=-1).values, ref.unsqueeze(-1)).detach()  # [B,Hkv,T]
    mtc = mt.reshape(n3, c)
    lkc = lk.reshape(n3, c)
    r_end = mtc[:, -1].view(bh, nc)  # reference of each chunk's state (running max at its last key)
    r_in = torch.cat([ref.reshape(bh, 1), r_end[:, :-1]], dim=-1)  # reference of the state entering chunk i
    # intra-chunk decay exp(lk_s − mt_t) ≤ 1 for s ≤ t, exact 0 above the diagonal
    logd = lkc.unsqueeze(-2) - mtc.unsqueeze(-1)  # [B·Hkv·L, C(t), C(s)]
    if grad:
        d = torch.exp(logd.masked_fill(drop, 0.0)).masked_fill(drop, 0.0)
        a = scores * d.unsqueeze(1)
    else:
        d = logd.masked_fill_(drop, 0.0).exp_().masked_fill_(drop, 0.0)
        a = scores.mul_(d.unsqueeze(1))
    # per-chunk increments relative to their own chunk-end reference (weights ≤ 1); the per-key
    # weight scales [v, 1] (C × (Dv+1)) rather than the features (C × F): Σ k_s (w_s v_s)ᵀ
    wv = v3 * torch.exp(lkc - r_end.reshape(n3, 1)).unsqueeze(-1)
    U = torch.bmm(k3.transpose(1, 2), wv).view(bh, nc, f * dv1)
    # state entering chunk i: Σ_{j<i} exp(r_end_j − r_in_i) U_j + exp(ref − r_in_i) S
    logD = r_end.unsqueeze(-2) - r_in.unsqueeze(-1)  # [B·Hkv, L(i), L(j)]
    upper = torch.ones(nc, nc, dtype=torch.bool, device=lk.device).triu()  # j >= i: not yet folded
    D = torch.exp(logD.masked_fill(upper, 0.0)).masked_fill_(upper, 0.0)
    carry = torch.exp(ref.reshape(bh, 1) - r_in)  # [B·Hkv, L] ≤ 1
    P = torch.bmm(D, U)
    P = P.addcmul_(carry.unsqueeze(-1), S.reshape(bh, 1, f * dv1)) if not grad else torch.addcmul(P, carry.unsqueeze(-1), S.reshape(bh, 1, f * dv1))
    S_out = P[:, -1] * torch.exp(r_in[:, -1:] - r_end[:, -1:]) + U[:, -1]
    inter = torch.bmm(q3, P.view(n3, f, dv1)).view(n3, g, c, dv1)
    inter = inter.mul_(torch.exp(r_in.reshape(n3, 1) - mtc)[:, None, :, None])  # ≤ 1, no gradient
    out = inter.view(n3, g * c, dv1).baddbmm_(a.view(n3, g * c, c), v3)
    return out, mt, S_out, r_end[:, -1].view(b, hkv)


def causal_block(
    qf: torch.Tensor,
    lq: torch.Tensor | None,
    kf: torch.Tensor,
    lk: torch.Tensor | None,
    va: torch.Tensor,
    S: torch.Tensor,
    ref: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of T = L·C tokens (T a multiple of ``chunk``) with incoming state ``S [B,Hkv,F,Dv+1]``
    relative to ``ref [B,Hkv]``. ``lk is None`` means every key has log scale 0 and ``ref >= 0``.

    Every product is a 3-D batched matmul over ``B·Hkv·L`` chunks (the G query heads of a kv head
    are stacked as rows, so K/V are never repeated). Exponentials are only taken of entries that
    are used (≤ 0); masked entries are zeroed afterwards (an exp of a huge negative number is both
    slow on CPUs and unnecessary).

    Returns ``(out [B,Hkv,G,T,Dv+1], ls [B,Hkv,G,T], S', ref')``.
    """
    b, hkv, g, t, f = qf.shape
    c = chunk
    nc = t // c
    dv1 = va.shape[-1]
    n3 = b * hkv * nc
    if g == 1:
        q3 = qf.reshape(n3, c, f)
    else:  # rows (g, t) of one chunk together
        q3 = qf.reshape(b, hkv, g, nc, c, f).transpose(2, 3).reshape(n3, g * c, f)
    k3 = kf.reshape(n3, c, f)
    v3 = va.reshape(n3, c, dv1)
    grad = needs_grad(qf, kf, lk, va, S)
    drop = ~torch.ones(c, c, dtype=torch.bool, device=qf.device).tril()  # s > t
    scores = torch.bmm(q3, k3.transpose(1, 2)).view(n3, g, c, c)  # [B·Hkv·L, G, C(t), C(s)]
    if lk is None:
        a = scores.masked_fill_(drop, 0.0) if not grad else scores.masked_fill(drop, 0.0)
        out, S_out = _unscaled_tiles(q3, k3, v3, a, S, nc, grad)
        ls, ref_out = ref[:, :, None, None].expand(b, hkv, g, t), ref
    else:
        out, mt, S_out, ref_out = _scaled_tiles(q3, k3, v3, scores, drop, lk, (S, ref), grad)
        ls = mt.unsqueeze(2).expand(b, hkv, g, t)
    out = out.view(b, hkv, nc, g, c, dv1).transpose(2, 3).reshape(b, hkv, g, t, dv1)
    return out, ls, S_out.view(b, hkv, f, dv1), ref_out


def block_step(qf, lq, kf, lk, v, S, ref, chunk: int):
    """:func:`causal_block` with the ones column appended to ``v`` (the unit compiled by
    :mod:`hf_rfa.ops.backends.kernels` when enabled)."""
    return causal_block(qf, lq, kf, lk, with_ones(v.to(qf.dtype)), S, ref, chunk)


def block_features(feature_map, tokens: Tokens, x_scale: float, ct: torch.dtype, hkv: int) -> Block:
    """One block's ``(qf [B,Hkv,G,T,F], lq, kf [B,Hkv,T,F], lk, v)`` from its raw ``tokens = (xqb
    [B,H,T,D], xkb [B,Hkv,T,D], vb, key mask kmb [B,T], gate offsets lqab, lkab)`` (:data:`Tokens`;
    autograd form)."""
    xqb, xkb, vb, kmb, lqab, lkab = tokens
    if x_scale != 1.0:  # (in the compute dtype: bf16/fp16 inputs are not rounded again)
        xqb, xkb = xqb.to(ct) * x_scale, xkb.to(ct) * x_scale
    fq, fk = feature_map.forward_queries(xqb), feature_map.forward_keys(xkb)
    return assemble_block(fq, fk, vb, kmb, lqab, lkab, hkv, in_place=False)


def assemble_block(fq, fk, vb, kmb, lqab, lkab, hkv: int, in_place: bool) -> Block:
    """A block from query/key :class:`~hf_rfa.feature_maps.Features` (queries ``[B,H,T,F]``):
    queries grouped per kv head, gate offsets added to the log scales, masked keys zeroed (log
    scale NEG). ``in_place``: zero the key features in place (inference workspaces)."""
    b, h, t = fq.phi.shape[:3]
    qf = fq.phi.reshape(b, hkv, h // hkv, t, -1)
    lq = fq.log_scale.reshape(b, hkv, h // hkv, t) if fq.log_scale is not None else None
    if lqab is not None:
        lq = lqab if lq is None else lq + lqab
    kf, lk = key_terms(fk, kmb, lkab, in_place)
    return qf, lq, kf, lk, vb


def key_terms(fk, kmb, lkab, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(kf [B,Hkv,T,F], lk [B,Hkv,T] | None)`` from key :class:`~hf_rfa.feature_maps.Features`:
    gate offsets ``lkab`` added to the log scales, keys masked out by ``kmb [B,T]`` zeroed (log
    scale NEG). ``in_place``: zero the features in place."""
    kf, lk = fk.phi, fk.log_scale
    if lkab is not None:
        lk = lkab if lk is None else lk + lkab
    if kmb is not None:
        km = kmb[:, None]
        kf = kf.mul_(km.unsqueeze(-1)) if in_place else kf * km.unsqueeze(-1)
        if lk is not None:
            lk = torch.where(km, lk, torch.full_like(lk, NEG))
    return kf, lk


__all__ = ["Block", "Tokens", "assemble_block", "block_features", "block_step", "causal_block", "key_terms", "with_ones"]
