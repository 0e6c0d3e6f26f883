"""Bidirectional linear attention with the feature map applied block by block (inference form).

``linear.bidirectional_linear`` takes features of the whole sequence (``[N, F]`` per head for
queries and keys: 1.6 GiB at N = 65536, H = 12, F = 256). Here the keys are folded block by
block into one state ``[B, Hkv, F, Dv+1]`` (values with a ones column, for the denominator),
stored relative to the running maximum of the key log scales, and every query block then reads
it; nothing of size ``N × F`` is ever held. Without autograd only (``random_feature_attention``
uses it for ``causal=False, window=0`` in inference); ``bidirectional_linear`` is its twin.
"""

from __future__ import annotations

import torch

from .chunkwise import with_ones
from ..masks import NEG
from ..partial import Partial
from .scan import DEFAULT_BLOCK_SIZE


@torch.no_grad()
def bidirectional_feature_attention(
    feature_map,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    x_scale: float = 1.0,
    block_size: int | None = None,
    out: torch.Tensor | None = None,
) -> Partial | None:
    """Every query attends to every key through the feature map.

    q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]`` (both multiplied by ``x_scale`` block by block
    before the map; low-precision inputs are converted block by block), v ``[B, Hkv, Nk, Dv]``,
    key_mask ``[B, Nk]`` bool (False: key skipped) or None. Returns the Partial ``[B, Hkv, G, Nq,
    ·]``, or, when ``out [B, Hkv, G, Nq, Dv]`` is given, writes the normalised output
    ``num / max(den, eps)`` there and returns None.
    """
    b, h, nq, _ = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    bs = DEFAULT_BLOCK_SIZE if block_size is None else int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    S = ref = None  # [B,Hkv,F,Dv+1] relative to ref [B,Hkv]
    for t0 in range(0, nk, bs):
        fk = feature_map.forward_keys(k[:, :, t0 : t0 + bs].to(ct) * x_scale)
        kf, lk = fk.phi, fk.log_scale
        va = with_ones(v[:, :, t0 : t0 + bs].to(ct))
        if key_mask is not None:
            km = key_mask[:, None, t0 : t0 + bs]
            kf = kf * km.unsqueeze(-1)
            if lk is not None:
                lk = torch.where(km, lk, torch.full_like(lk, NEG))
        if S is None:
            S = kf.new_zeros(b, hkv, kf.shape[-1], dv + 1)
            ref = kf.new_full((b, hkv), NEG if lk is not None else 0.0)
        if lk is None:  # unscaled features: log scale 0 throughout
            S.add_(kf.transpose(-1, -2) @ va)
            continue
        new = torch.maximum(ref, lk.amax(-1))
        S.mul_(torch.exp(ref - new)[..., None, None]).add_(kf.transpose(-1, -2) @ (va * torch.exp(lk - new.unsqueeze(-1)).unsqueeze(-1)))
        ref = new
    res = None if out is not None else torch.empty(b, hkv, g, nq, dv + 1, dtype=ct, device=q.device)
    lqs = []
    for t0 in range(0, nq, bs):
        fq = feature_map.forward_queries(q[:, :, t0 : t0 + bs].to(ct) * x_scale)
        t = fq.phi.shape[2]
        qf = fq.phi.reshape(b, hkv, g, t, -1)
        blk = qf @ S.unsqueeze(2)  # [B,Hkv,G,T,Dv+1]
        if out is not None:
            torch.div(blk[..., :dv], blk[..., dv:].clamp_min(feature_map.eps), out=out[:, :, :, t0 : t0 + t])
        else:
            res[:, :, :, t0 : t0 + t] = blk
            lqs.append(None if fq.log_scale is None else fq.log_scale.reshape(b, hkv, g, t))
    if out is not None:
        return None
    ls = ref[:, :, None, None].expand(b, hkv, g, nq)
    if lqs and lqs[0] is not None:
        ls = ls + torch.cat(lqs, dim=-1)
    return Partial(res[..., :dv], res[..., dv], ls)


def whole_features(feature_map, xq_f, xk_f, feat_mask) -> tuple:
    """Whole-sequence features of a bidirectional call (no gate: it is causal only) for the autograd
    forms: ``(qf [B,Hkv,G,N,F], lq [B,Hkv,G,N] | None, kf [B,Hkv,N,F], lk [B,Hkv,N] | None)``, the
    keys outside ``feat_mask`` (padding, sinks) dropped."""
    b, hkv, n = xk_f.shape[0], xk_f.shape[1], xk_f.shape[2]
    g = xq_f.shape[1] // hkv
    fq = feature_map.forward_queries(xq_f)
    fk = feature_map.forward_keys(xk_f)
    qf = fq.phi.reshape(b, hkv, g, n, -1)
    lq = fq.log_scale.reshape(b, hkv, g, n) if fq.log_scale is not None else None
    kf, lk = fk.phi, fk.log_scale
    if feat_mask is not None:
        kf = kf * feat_mask[:, None, :, None]
        if lk is not None:
            lk = torch.where(feat_mask[:, None, :], lk, torch.full_like(lk, NEG))
    return qf, lq, kf, lk
