"""Linear attention on precomputed features: bidirectional, and causal in chunkwise-parallel form.

Inputs are *features*, not q/k: ``qf [B, Hkv, G, N, F]`` (G query heads per key/value head —
grouped-query attention without materialising repeated K/V), ``kf [B, Hkv, N, F]`` (zero rows
for keys that must not contribute), ``v [B, Hkv, N, Dv]``, and optional log scales ``lq
[B, Hkv, G, N]``, ``lk [B, Hkv, N]`` (NEG for skipped keys). Outputs are :class:`Partial`\\ s.

The causal form runs the block scan of :mod:`hf_rfa.ops.feature.scan` (one block:
:mod:`hf_rfa.ops.feature.chunkwise`). These are the autograd forms on whole-sequence features; the fused
forms that apply the feature map block by block are :mod:`hf_rfa.ops.feature.fused` (causal) and
:mod:`hf_rfa.ops.feature.bidirectional`.
"""

from __future__ import annotations

import torch

from .chunkwise import Block
from ..masks import NEG, needs_grad, shift_keys
from ..partial import Partial
from ..recurrent import LinearState
from .scan import causal_scan, plan_blocks, split_tokens


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
    *,
    block_size: int | None = None,
) -> tuple[Partial, LinearState]:
    """Causal linear attention, query t sees keys s ≤ t (plus everything folded into ``state``).

    Any N (the last chunk may be short). Returns the Partial for all N queries and the state
    after the last key (for decoding or the next segment). ``block_size``: tokens per batched
    block (default :data:`hf_rfa.ops.feature.scan.DEFAULT_BLOCK_SIZE`; bounds the working set, not the result).
    """
    b, hkv, g, n, f = qf.shape
    dv = v.shape[-1]
    if state is None:
        state = LinearState.zeros(b, hkv, f, dv, device=qf.device, dtype=qf.dtype)

    plan = plan_blocks(n, chunk_size, block_size)
    sizes = [p[0] for p in plan]
    cuts = (split_tokens(qf, sizes, 3), split_tokens(lq, sizes, -1), split_tokens(kf, sizes, 2), split_tokens(lk, sizes, -1), split_tokens(v, sizes, 2))

    def get(i: int, ws) -> Block:
        return tuple(x[i] for x in cuts)

    infer = not needs_grad(qf, lq, kf, lk, v, state.S, state.z, state.ref)
    return causal_scan(get, plan, state, lk is not None, g, infer)


def bidirectional_window_parts(qf, lq, kf, lk, vv, window: int, chunk_size: int) -> list[Partial]:
    """Feature part of bidirectional attention from precomputed features (``qf [B,Hkv,G,N,F]``,
    ``kf [B,Hkv,N,F]``, log scales or None, ``vv [B,Hkv,N,Dv]``): all keys (``window == 0``) or
    the band outside the window, keys s <= t - W (forward pass) and s >= t + W (reversed pass)."""
    if window == 0:
        return [bidirectional_linear(qf, lq, kf, lk, vv)]
    ks, vs = shift_keys(kf, window, 0.0), shift_keys(vv, window, 0.0)
    ls = shift_keys(lk, window, NEG) if lk is not None else None
    forward = causal_linear(qf, lq, ks, ls, vs, chunk_size)[0]
    fl = lambda x, dim: x.flip(dim) if x is not None else None  # noqa: E731
    kr, vr = shift_keys(fl(kf, 2), window, 0.0), shift_keys(fl(vv, 2), window, 0.0)
    lr = shift_keys(fl(lk, 2), window, NEG) if lk is not None else None
    rev = causal_linear(fl(qf, 3), fl(lq, 3), kr, lr, vr, chunk_size)[0]
    return [forward, Partial(rev.num.flip(3), rev.den.flip(3), rev.log_scale.flip(3))]


__all__ = ["bidirectional_linear", "bidirectional_window_parts", "causal_linear", "shift_keys"]
