"""The inference form of the causal block step: same math as ``chunkwise.causal_block``, no
autograd, every intermediate written into buffers that are allocated once and reused.

Why a second form: on a CPU the block step is a handful of mid-sized batched matmuls and
elementwise passes over tensors of a few MB each. Allocating those tensors afresh for every
block makes the allocator hand back fresh pages from the OS, and the page faults (zeroing
~60 MB per call at N = 2048, H = 12, m = 256) cost about a third of the run. Here one
:class:`BlockWorkspace` holds the buffers of a full block and every block reuses them
(``torch.bmm(..., out=)``, in-place elementwise ops), and the outputs of all blocks are written
into one preallocated result (no concatenation at the end). The calling thread keeps its last
workspace for the next call of the same shape (the layers of a model, repeated prefills); it
holds ``B·Hkv·T·(G·F + F + …)`` floats, about 30 MB at B=1, H=12, T=512, F=256, until
:func:`release_workspaces` or a call of another shape replaces it.

Used by ``scan.causal_scan`` for full-size blocks when no autograd graph is recorded; the
autograd form ``chunkwise.causal_block`` is its reference twin (``tests/ops/test_speed_paths.py``).

Shapes (block of T = L·C tokens, L chunks of C, ``n3 = B·Hkv·L``): queries are stacked per
chunk as ``[n3, G·C, F]`` rows (the G query heads of a kv head share the chunk's keys), keys
``[n3, C, F]``, values with the ones column ``[n3, C, Dv+1]``.
"""

from __future__ import annotations

import threading

import torch

from ..masks import exp_floor

_CACHE = threading.local()


class BlockWorkspace:
    """Buffers for one full block ``(B, Hkv, G, T, C, F, Dv+1)``, reused by every block of a call.

    ``q``/``k`` are where the caller may write the block's features (``q_heads [B,H,T,F]`` view
    for feature maps; ``q`` is the chunk-stacked copy when G > 1), the rest is scratch.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.shape = shape
        b, hkv, g, t, c, f, dv1 = shape
        nc = t // c
        n3 = b * hkv * nc
        kw = {"dtype": dtype, "device": device}
        self.q_heads = torch.empty(b, hkv * g, t, f, **kw)  # features as a feature map returns them
        self.q = self.q_heads if g == 1 else torch.empty(n3, g * c, f, **kw)
        self.k = torch.empty(b, hkv, t, f, **kw)
        self.va = torch.empty(n3, c, dv1, **kw)
        self.va[..., -1] = 1.0  # the ones column (denominator); the value columns are copied per block
        self.scores = torch.empty(n3, g * c, c, **kw)
        self.decay = torch.empty(n3, c, c, **kw)
        self.wv = torch.empty(n3, c, dv1, **kw)
        self.U = torch.empty(n3, f, dv1, **kw)
        self.P = torch.empty(n3, f, dv1, **kw)
        self.out = torch.empty(n3, g * c, dv1, **kw)
        dev = device
        self.drop = torch.ones(c, c, dtype=torch.bool, device=dev).triu(1)  # s > t: masked
        self.keep = (~self.drop).to(dtype)  # 1 for s <= t, 0 above the diagonal
        self.floor = exp_floor(dtype)
        self.S = torch.empty(b * hkv, f * dv1, **kw)  # the state between blocks
        self.lower = torch.ones(nc, nc, dtype=dtype, device=dev).tril(-1).expand(b * hkv, nc, nc)
        self.upper = torch.ones(nc, nc, dtype=torch.bool, device=dev).triu()  # j >= i: not yet folded


def workspace(shape: tuple[int, ...], dtype: torch.dtype, device) -> BlockWorkspace:
    """The calling thread's cached workspace for ``shape = (B, Hkv, G, T, C, F, Dv+1)`` (a new one
    replaces it otherwise).

    Keeping the last workspace lets consecutive calls (the layers of a model, repeated
    prefills) reuse its pages; it holds ``≈ B·H·T·(2F + …)`` floats (about 30 MB at B=1, H=12,
    T=512, F=256) until :func:`release_workspaces` or a call with another shape.
    """
    # (tensors made under torch.inference_mode cannot be updated in place outside it: separate key)
    key = (*shape, dtype, torch.device(device), torch.is_inference_mode_enabled())
    cached = getattr(_CACHE, "ws", None)
    if cached is None or cached[0] != key:
        _CACHE.ws = (key, BlockWorkspace(tuple(shape), dtype, device))
    return _CACHE.ws[1]


def release_workspaces() -> None:
    """Drop the calling thread's cached workspace (its memory returns to the allocator)."""
    _CACHE.ws = None


def causal_block_into(
    ws: BlockWorkspace,
    qf: torch.Tensor,
    kf: torch.Tensor,
    lk: torch.Tensor | None,
    v: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor],
    dest: tuple[torch.Tensor, torch.Tensor | None, float | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One full block without autograd, written into ``dest = (out [B,Hkv,G,T,Dv+1], ls_out
    [B,Hkv,T] | None, eps | None)`` (views into the call's result). Inputs as in
    ``chunkwise.causal_block``: ``qf [B,Hkv,G,T,F]``, ``kf [B,Hkv,T,F]``, ``lk [B,Hkv,T]`` or None
    (all key log scales 0, ``ref >= 0``), ``va [B,Hkv,T,Dv+1]``, incoming ``state = (S
    [B,Hkv,F,Dv+1], ref [B,Hkv])``, S relative to ref. ``qf``/``kf`` may already be
    ``ws.q_heads``/``ws.k`` (then nothing is copied). With ``eps``, ``out [B,Hkv,G,T,Dv]``
    receives the normalised output ``num / max(den, eps)`` instead.

    Returns the outgoing ``(S', ref')``; ``S'`` is a view of ``ws.S`` (clone it before the
    workspace is reused by another call).
    """
    S, ref = state
    out, ls_out, eps = dest
    b, hkv, g, t, c, f, dv1 = ws.shape
    nc = t // c
    bh, n3 = b * hkv, b * hkv * nc
    # ---- operands in chunk-stacked layout (copies only when the caller's layout differs)
    if g == 1:
        if qf.data_ptr() != ws.q.data_ptr():
            ws.q.view(b, hkv, t, f).copy_(qf.view(b, hkv, t, f))
    else:
        ws.q.view(b, hkv, nc, g, c, f).copy_(qf.reshape(b, hkv, g, nc, c, f).transpose(2, 3))
    if kf.data_ptr() != ws.k.data_ptr():
        ws.k.copy_(kf)
    ws.va.view(b, hkv, t, dv1)[..., : dv1 - 1].copy_(v)
    q3, k3, v3 = ws.q.view(n3, g * c, f), ws.k.view(n3, c, f), ws.va
    scores = torch.bmm(q3, k3.transpose(1, 2), out=ws.scores).view(n3, g, c, c)  # [n3, G, C(t), C(s)]
    if lk is None:
        scores.masked_fill_(ws.drop, 0.0)
        U = torch.bmm(k3.transpose(1, 2), v3, out=ws.U).view(bh, nc, f * dv1)
        P = torch.bmm(ws.lower, U, out=ws.P.view(bh, nc, f * dv1))
        P.add_(S.reshape(bh, 1, f * dv1))
        S_out = torch.add(P[:, -1], U[:, -1], out=ws.S)  # S is consumed
        res = torch.bmm(q3, ws.P, out=ws.out)
        res.baddbmm_(ws.scores, v3)
        _emit(res, out, eps, ws.shape)
        if ls_out is not None:
            ls_out.copy_(ref.unsqueeze(-1).expand(b, hkv, t))
        return S_out.view(b, hkv, f, dv1), ref
    mt = torch.maximum(torch.cummax(lk, dim=-1).values, ref.unsqueeze(-1))  # [B,Hkv,T]
    if ls_out is not None:
        ls_out.copy_(mt)
    mtc, lkc = mt.view(n3, c), lk.reshape(n3, c)
    r_end = mtc[:, -1].view(bh, nc)  # reference of each chunk's state
    r_in = torch.cat([ref.reshape(bh, 1), r_end[:, :-1]], dim=-1)  # reference entering chunk i
    # intra-chunk decay exp(lk_s − mt_t) ≤ 1 for s ≤ t; exact 0 above the diagonal
    # (clamped to ≤ 0 before the exp: no overflow above the diagonal, which is then zeroed; and
    # to ≥ exp_floor: no denormals, which would make exp 50× slower)
    d = torch.sub(lkc.unsqueeze(-2), mtc.unsqueeze(-1), out=ws.decay).clamp_(ws.floor, 0.0).exp_().mul_(ws.keep)
    scores.mul_(d.unsqueeze(1))
    # chunk increments relative to their chunk-end reference, the weight on [v, 1]
    torch.mul(v3, torch.exp(lkc - r_end.reshape(n3, 1)).unsqueeze(-1), out=ws.wv)
    U = torch.bmm(k3.transpose(1, 2), ws.wv, out=ws.U).view(bh, nc, f * dv1)
    logD = r_end.unsqueeze(-2) - r_in.unsqueeze(-1)  # [B·Hkv, L(i), L(j)]
    D = torch.exp(logD.masked_fill_(ws.upper, 0.0)).masked_fill_(ws.upper, 0.0)
    carry = torch.exp(ref.reshape(bh, 1) - r_in)  # ≤ 1
    P = torch.bmm(D, U, out=ws.P.view(bh, nc, f * dv1))
    P.addcmul_(carry.unsqueeze(-1), S.reshape(bh, 1, f * dv1))
    S_out = torch.addcmul(U[:, -1], P[:, -1], torch.exp(r_in[:, -1:] - r_end[:, -1:]), out=ws.S)  # S is consumed
    res = torch.bmm(q3, ws.P, out=ws.out)
    res.view(n3, g, c, dv1).mul_(torch.exp(r_in.reshape(n3, 1) - mtc)[:, None, :, None])  # ≤ 1
    res.baddbmm_(ws.scores, v3)
    _emit(res, out, eps, ws.shape)
    return S_out.view(b, hkv, f, dv1), r_end[:, -1].reshape(b, hkv)


def _emit(res: torch.Tensor, out: torch.Tensor, eps: float | None, shape: tuple[int, ...]) -> None:
    """Chunk-stacked ``res [n3, G·C, Dv+1]`` → ``out`` in ``[B,Hkv,G,T,·]`` order: copied as is, or
    (with ``eps``) normalised on the way."""
    b, hkv, g, t, c, f, dv1 = shape
    nc = t // c
    r = res.view(b, hkv, nc, g, c, dv1).transpose(2, 3)
    if eps is None:
        out.view(b, hkv, g, nc, c, dv1).copy_(r)
    else:
        torch.div(r[..., : dv1 - 1], r[..., dv1 - 1 :].clamp_min(eps), out=out.view(b, hkv, g, nc, c, dv1 - 1))
