"""Linear attention on precomputed features: bidirectional, and causal in chunkwise-parallel form.

Inputs are *features*, not q/k: ``qf [B, Hkv, G, N, F]`` (G query heads per key/value head —
grouped-query attention without materialising repeated K/V), ``kf [B, Hkv, N, F]`` (zero rows
for keys that must not contribute), ``v [B, Hkv, N, Dv]``, and optional log scales ``lq
[B, Hkv, G, N]``, ``lk [B, Hkv, N]`` (NEG for skipped keys). Outputs are :class:`Partial`s.

Causal form (chunk size C): within a chunk the product ``(φq φkᵀ ⊙ causal) v`` is exact; across
chunks a prefix state (``recurrent.LinearState``) carries ``Σ φ(k) vᵀ`` and ``Σ φ(k)``. Memory is
O(N·F + C²) per head, never N×N. Stabilisation is streaming-safe: each query's scale is the
running maximum of key log scales up to and including that query (``cummax``), so no output
depends on later tokens, even through a max.
"""

from __future__ import annotations

import torch

from .masks import NEG
from .partial import Partial
from .recurrent import LinearState, fold


def bidirectional_linear(qf: torch.Tensor, lq: torch.Tensor | None, kf: torch.Tensor, lk: torch.Tensor | None, v: torch.Tensor) -> Partial:
    """Every query attends to every (non-zero) key. Returns a Partial ``[B, Hkv, G, Nq, ·]``."""
    if lk is None:
        S = kf.transpose(-1, -2) @ v  # [B,Hkv,F,Dv]
        z = kf.sum(-2)
        ref = torch.zeros(kf.shape[:2], dtype=kf.dtype, device=kf.device)
    else:
        ref = lk.amax(-1).detach()  # [B,Hkv]
        w = torch.exp(lk - ref.unsqueeze(-1)).unsqueeze(-1) * kf
        S = w.transpose(-1, -2) @ v
        z = w.sum(-2)
    num = qf @ S.unsqueeze(2)
    den = (qf * z[:, :, None, None, :]).sum(-1)
    ls = ref[:, :, None, None].expand(den.shape)
    return Partial(num, den, ls if lq is None else ls + lq)


def causal_linear(
    qf: torch.Tensor,
    lq: torch.Tensor | None,
    kf: torch.Tensor,
    lk: torch.Tensor | None,
    v: torch.Tensor,
    chunk_size: int = 64,
    state: LinearState | None = None,
) -> tuple[Partial, LinearState]:
    """Causal linear attention, query t sees keys s ≤ t (plus everything folded into ``state``).

    Any N (the last chunk may be short). Returns the Partial for all N queries and the state
    after the last key (for decoding or the next segment).
    """
    b, hkv, g, n, f = qf.shape
    dv = v.shape[-1]
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if state is None:
        state = LinearState.zeros(b, hkv, f, dv, device=qf.device, dtype=qf.dtype)
    S, z, ref = state.S, state.z, state.ref
    if lk is None:  # unscaled features: everything at log scale 0
        new_ref = ref.clamp_min(0.0)
        old = torch.exp(ref - new_ref)
        S, z, ref = S * old[..., None, None], z * old[..., None], new_ref
    nums, dens, lss = [], [], []
    tril_full = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=qf.device).tril()
    for c0 in range(0, n, chunk_size):
        c1 = min(n, c0 + chunk_size)
        qc, kc, vc = qf[:, :, :, c0:c1], kf[:, :, c0:c1], v[:, :, c0:c1]
        tril = tril_full[: c1 - c0, : c1 - c0]
        scores = qc @ kc.unsqueeze(2).transpose(-1, -2)  # [B,Hkv,G,C,C]
        if lk is None:
            a = scores.masked_fill(~tril, 0.0)
            num = qc @ S.unsqueeze(2) + a @ vc.unsqueeze(2)
            den = (qc * z[:, :, None, None, :]).sum(-1) + a.sum(-1)
            lss.append(ref[:, :, None, None].expand(den.shape))
            S = S + kc.transpose(-1, -2) @ vc
            z = z + kc.sum(-2)
        else:
            lkc = lk[:, :, c0:c1]
            mt = torch.maximum(torch.cummax(lkc, dim=-1).values, ref.unsqueeze(-1)).detach()  # [B,Hkv,C]
            inter = torch.exp(ref.unsqueeze(-1) - mt)  # [B,Hkv,C]
            logd = lkc.unsqueeze(-2) - mt.unsqueeze(-1)  # [B,Hkv,C(t),C(s)]
            d = torch.exp(torch.where(tril, logd, torch.full_like(logd, NEG)))
            a = scores * d.unsqueeze(2)
            num = (qc @ S.unsqueeze(2)) * inter[:, :, None, :, None] + a @ vc.unsqueeze(2)
            den = (qc * z[:, :, None, None, :]).sum(-1) * inter.unsqueeze(2) + a.sum(-1)
            lss.append(mt.unsqueeze(2).expand(den.shape))
            new_ref = mt[..., -1]
            old = torch.exp(ref - new_ref)
            w = torch.exp(lkc - new_ref.unsqueeze(-1)).unsqueeze(-1) * kc
            S = S * old[..., None, None] + w.transpose(-1, -2) @ vc
            z = z * old[..., None] + w.sum(-2)
            ref = new_ref
        nums.append(num)
        dens.append(den)
    ls = torch.cat(lss, dim=-1)
    out = Partial(torch.cat(nums, dim=-2), torch.cat(dens, dim=-1), ls if lq is None else ls + lq)
    return out, LinearState(S, z, ref, state.log_gate_sum)


def shift_keys(x: torch.Tensor, shift: int, fill: float, dim: int = 2) -> torch.Tensor:
    """Delay a key-axis tensor by ``shift`` positions (front-filled with ``fill``), same length.

    Query t then sees original keys s ≤ t − shift: the feature part of a causal hybrid window.
    """
    n = x.shape[dim]
    if shift <= 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = min(shift, n)
    pad = torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)
    kept = x.narrow(dim, 0, max(n - shift, 0))
    return torch.cat([pad, kept], dim=dim)
