"""Exact softmax over a local window and attention sinks, as a :class:`Partial`.

The hybrid of ``random_feature_attention``: keys in the local window (causal: t−W < s ≤ t;
bidirectional: |t−s| < W) and the first ``sinks`` real tokens get exact ``exp(q·k·scale)``
weights; all other keys go through the feature map. Both parts are Partials in log space and
are merged under one normaliser (``partial.merge``). Queries are processed in chunks, so memory
is O(N·(C + W + S)), never N×N (unless W ≥ N, which is then exactly softmax).
"""

from __future__ import annotations

import torch

from .masks import NEG, exp_floor, needs_grad, sink_positions
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
    block_size: int = 512,
) -> Partial:
    """Exact part of the hybrid.

    xq ``[B, Hkv, G, N, D]`` and xk ``[B, Hkv, N, D]`` already multiplied by √scale (so scores are
    ``xq·xk``), v ``[B, Hkv, N, Dv]``, key_mask ``[B, N]`` bool or None. Query t is position t.
    Returns a Partial whose log scale is each row's max exact score (NEG where none is visible).

    Queries go in chunks of C = ``chunk_size``; chunk i sees the key band ``[iC − left, iC + C +
    right)`` (left = W−1, right = 0 causal / W−1 bidirectional), taken from the padded keys with
    ``unfold`` (no copy); all chunks of a block of ``block_size`` queries are one batched matmul.
    """
    b, hkv, g, n, d = xq.shape
    dev, dv = xq.device, v.shape[-1]
    floor = exp_floor(xq.dtype)
    grad = needs_grad(xq, xk, v)
    c = max(1, min(chunk_size, n))
    nch = -(-n // c)
    npad = nch * c  # queries padded to whole chunks
    left = min(window, n) - 1 if window > 0 else 0
    right = 0 if causal or window <= 0 else min(window, n) - 1
    kw = c + left + right  # keys per chunk band
    real = key_mask if key_mask is not None else torch.ones(b, n, dtype=torch.bool, device=dev)
    if window > 0:
        # keys/values/mask padded by `left` in front and up to the band end behind
        back = npad + right - n
        kp = torch.nn.functional.pad(xk, (0, 0, left, back))
        vp = torch.nn.functional.pad(v, (0, 0, left, back))
        mp = torch.nn.functional.pad(real, (left, back), value=False)
        i_q = torch.arange(c, device=dev).view(-1, 1)
        j_k = torch.arange(kw, device=dev).view(1, -1)
        # query a+i, key a−left+j: band s ≤ t (causal) / s < t+W, and s > t−W
        band = (j_k >= i_q) & (j_k <= i_q + left + right) if not causal else (j_k >= i_q) & (j_k <= i_q + left)
    if sinks > 0:
        spos, sexists = sink_positions(key_mask, b, n, sinks, dev)  # [B,S]
        ks, vs = _gather_keys(xk, spos), _gather_keys(v, spos)
    xq = torch.nn.functional.pad(xq, (0, 0, 0, npad - n))
    lpb = max(1, block_size // c)  # chunks per block
    nums, dens, lss = [], [], []
    for c0 in range(0, nch, lpb):
        c1 = min(nch, c0 + lpb)
        L = c1 - c0
        qb = xq[:, :, :, c0 * c : c1 * c].reshape(b, hkv, g, L, c, d)
        parts_s, parts_ok, vals = [], [], []
        if window > 0:
            kb = kp[:, :, c0 * c : c1 * c + left + right].unfold(2, kw, c)  # [B,Hkv,L,D,Kw]
            vb = vp[:, :, c0 * c : c1 * c + left + right].unfold(2, kw, c)  # [B,Hkv,L,Dv,Kw]
            mb = mp[:, c0 * c : c1 * c + left + right].unfold(1, kw, c)  # [B,L,Kw]
            parts_s.append(qb @ kb.unsqueeze(2))  # [B,Hkv,G,L,C,Kw]
            parts_ok.append((band & mb.unsqueeze(-2))[:, None, None])  # [B,1,1,L,C,Kw]
            vals.append(vb.transpose(-1, -2).unsqueeze(2))  # [B,Hkv,1,L,Kw,Dv]
        if sinks > 0:
            tt = torch.arange(c0 * c, c1 * c, device=dev).view(1, L, c, 1)
            sp = spos[:, None, None, :]  # [B,1,1,S]
            ok = sexists[:, None, None, :].expand(b, L, c, sinks)
            if causal:
                ok = ok & (sp <= tt)
            if window > 0:
                in_band = ((sp <= tt) & (sp > tt - window)) if causal else ((sp - tt).abs() < window)
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
        nums.append((p @ vcat).reshape(b, hkv, g, L * c, dv))
        dens.append(p.sum(-1).reshape(b, hkv, g, L * c))
        lss.append(r.reshape(b, hkv, g, L * c))
    num, den, ls = (torch.cat(x, dim=-2 if x is nums else -1) if len(x) > 1 else x[0] for x in (nums, dens, lss))
    return Partial(num[..., :n, :], den[..., :n], ls[..., :n])
