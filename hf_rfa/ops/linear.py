"""Linear attention on precomputed features: bidirectional, and causal in chunkwise-parallel form.

Inputs are *features*, not q/k: ``qf [B, Hkv, G, N, F]`` (G query heads per key/value head —
grouped-query attention without materialising repeated K/V), ``kf [B, Hkv, N, F]`` (zero rows
for keys that must not contribute), ``v [B, Hkv, N, Dv]``, and optional log scales ``lq
[B, Hkv, G, N]``, ``lk [B, Hkv, N]`` (NEG for skipped keys). Outputs are :class:`Partial`s.

Causal form (chunk size C): within a chunk the product ``(φq φkᵀ ⊙ causal ⊙ decay) v`` is exact;
across chunks a prefix state carries ``Σ φ(k) vᵀ`` and ``Σ φ(k)`` (kept together as one
``[F, Dv+1]`` matrix: v with a column of ones appended, so numerator and denominator come out of
the same matmuls). The sequence is processed in *blocks* of several chunks (``block_size``
tokens): all chunks of a block are one batched matmul, and the states entering each chunk of the
block are one small matmul of a ``[L+1, L]`` decay matrix with the per-chunk state increments
(no Python loop per chunk). Memory is O(N·F + block·(C + F·Dv/C)) per head, never N×N.

Stabilisation is streaming-safe: each query's scale is the running maximum of key log scales up
to and including that query (``cummax``), chunk states are stored relative to the running max at
the chunk's last key, and every decay factor is ``exp(earlier max − later max) ≤ 1``; masked
(future) entries are exact zeros, so no output depends on later tokens, even through a max or
through rounding.

:func:`causal_feature_attention` is the fused form used by ``random_feature_attention`` for pure
causal linear attention: it calls the feature map block by block, so the ``[N, F]`` feature
tensors are never materialised (cache-resident blocks, O(N·Dv) extra memory in inference).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint

from .backends import kernels, native, resolve
from .backends.causal_infer import BlockWorkspace, causal_block_into, workspace
from .masks import NEG, exp_floor, needs_grad
from .partial import Partial, finalize
from .recurrent import LinearState

#: tokens per block of the causal form (rounded down to a multiple of the chunk size)
DEFAULT_BLOCK_SIZE = 512

_Block = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]


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


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """``[..., N, Dv]`` → ``[..., N, Dv+1]`` with a trailing column of ones (the denominator)."""
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


def _causal_block(
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
    bh, dv1 = b * hkv, va.shape[-1]
    n3 = bh * nc
    if g == 1:
        q3 = qf.reshape(n3, c, f)
    else:  # rows (g, t) of one chunk together
        q3 = qf.reshape(b, hkv, g, nc, c, f).transpose(2, 3).reshape(n3, g * c, f)
    k3 = kf.reshape(n3, c, f)
    v3 = va.reshape(n3, c, dv1)
    grad = needs_grad(qf, kf, lk, va, S)
    dev = qf.device
    keep = torch.ones(c, c, dtype=torch.bool, device=dev).tril()  # s <= t
    drop = ~keep
    scores = torch.bmm(q3, k3.transpose(1, 2)).view(n3, g, c, c)  # [B·Hkv·L, G, C(t), C(s)]
    if lk is None:
        a = scores.masked_fill_(drop, 0.0) if not grad else scores.masked_fill(drop, 0.0)
        U = torch.bmm(k3.transpose(1, 2), v3).view(bh, nc, f * dv1)  # chunk increments
        lower = torch.ones(nc, nc, dtype=U.dtype, device=dev).tril(-1).expand(bh, nc, nc)
        P = torch.bmm(lower, U)
        P = P.add_(S.reshape(bh, 1, f * dv1)) if not grad else P + S.reshape(bh, 1, f * dv1)
        S_out = P[:, -1] + U[:, -1]
        inter = torch.bmm(q3, P.view(n3, f, dv1))  # [B·Hkv·L, G·C, Dv+1]
        out = inter.baddbmm_(a.view(n3, g * c, c), v3)
        out = out.view(b, hkv, nc, g, c, dv1).transpose(2, 3).reshape(b, hkv, g, t, dv1)
        ls = ref[:, :, None, None].expand(b, hkv, g, t)
        return out, ls, S_out.view(b, hkv, f, dv1), ref
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
    upper = torch.ones(nc, nc, dtype=torch.bool, device=dev).triu()  # j >= i: not yet folded
    D = torch.exp(logD.masked_fill(upper, 0.0)).masked_fill_(upper, 0.0)
    carry = torch.exp(ref.reshape(bh, 1) - r_in)  # [B·Hkv, L] ≤ 1
    P = torch.bmm(D, U)
    P = P.addcmul_(carry.unsqueeze(-1), S.reshape(bh, 1, f * dv1)) if not grad else torch.addcmul(P, carry.unsqueeze(-1), S.reshape(bh, 1, f * dv1))
    S_out = P[:, -1] * torch.exp(r_in[:, -1:] - r_end[:, -1:]) + U[:, -1]
    inter = torch.bmm(q3, P.view(n3, f, dv1)).view(n3, g, c, dv1)
    inter = inter.mul_(torch.exp(r_in.reshape(n3, 1) - mtc)[:, None, :, None])  # ≤ 1, no gradient
    out = inter.view(n3, g * c, dv1).baddbmm_(a.view(n3, g * c, c), v3)
    out = out.view(b, hkv, nc, g, c, dv1).transpose(2, 3).reshape(b, hkv, g, t, dv1)
    ls = mt.unsqueeze(2).expand(b, hkv, g, t)
    return out, ls, S_out.view(b, hkv, f, dv1), r_end[:, -1].view(b, hkv)


def _block_step(qf, lq, kf, lk, v, S, ref, chunk: int):
    """:func:`_causal_block` with the ones column appended to ``v`` (the unit compiled by
    :mod:`hf_rfa.ops.backends.kernels` when enabled)."""
    return _causal_block(qf, lq, kf, lk, _with_ones(v.to(qf.dtype)), S, ref, chunk)


def _plan(n: int, chunk_size: int, block_size: int | None) -> list[tuple[int, int]]:
    """Blocks ``(length, chunk)`` covering ``[0, n)``: multiples of the chunk size, then (if any)
    one short last chunk of its own length."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bs = DEFAULT_BLOCK_SIZE if block_size is None else int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    bs = max(chunk_size, bs - bs % chunk_size)
    plan, t0 = [], 0
    while t0 < n:
        full = min(n - t0, bs) // chunk_size * chunk_size
        plan.append((full, chunk_size) if full else (n - t0, n - t0))
        t0 += plan[-1][0]
    return plan


def _split(x: torch.Tensor | None, sizes: list[int], dim: int) -> list | tuple:
    """Split along the token axis once (one O(N) backward, unlike per-block slicing, whose
    backward would scatter every block's gradient into a full-size zero tensor)."""
    return [None] * len(sizes) if x is None else torch.split(x, sizes, dim=dim)


def _causal_scan(
    get: Callable[[int, BlockWorkspace | None], _Block],
    plan: list[tuple[int, int]],
    state: LinearState,
    scaled: bool,
    g: int,
    infer: bool = False,
    dest: torch.Tensor | None = None,
    eps: float = 0.0,
    checkpoint: bool = False,
) -> tuple[Partial | None, LinearState]:
    """Run the block step over the blocks of ``plan``; ``get(i, ws)`` returns block i's
    ``(qf, lq, kf, lk, v)`` (and may write its features into the workspace ``ws`` when one is
    given). ``scaled``: whether ``lk`` is given (else all key log scales are 0). ``infer``: no
    autograd graph is needed — full blocks then run :func:`causal_block_into` on one reused
    workspace (unless the compiled kernels are enabled). ``dest [B,Hkv,G,N,Dv]``: write the
    normalised output ``num / max(den, eps)`` there and return ``None`` for the Partial.
    ``checkpoint``: with autograd, recompute each block's features and products in backward
    instead of saving them (activation memory O(N·(D + Dv)) instead of O(N·F) per layer)."""
    if infer and not kernels.wanted() and not torch.compiler.is_compiling():
        with torch.no_grad():
            return _causal_scan_into(get, plan, state, scaled, g, dest, eps)
    S, ref = _state_matrix(state, scaled)
    outs, lss, lqs = [], [], []
    full = plan[0]

    def block(i: int, c: int, S: torch.Tensor, ref: torch.Tensor):
        qf, lq, kf, lk, v = get(i, None)
        if not scaled:
            lk = None
        # only full-size blocks go to the compiled kernel (one shape: no recompilation)
        step = kernels.maybe_compiled(_block_step, qf, lq, kf, lk, v, S) if plan[i] == full else _block_step
        return (*step(qf, lq, kf, lk, v, S, ref, c), lq)

    for i, (t, c) in enumerate(plan):
        if checkpoint and torch.is_grad_enabled():
            # keep only the block's inputs; features and tiles are recomputed in backward
            out, ls, S, ref, lq = torch.utils.checkpoint.checkpoint(block, i, c, S, ref, use_reentrant=False)
        else:
            out, ls, S, ref, lq = block(i, c, S, ref)
        outs.append(out)
        lss.append(ls)
        lqs.append(lq)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    ls = lss[0] if len(lss) == 1 else torch.cat(lss, dim=-1)
    part, st = _finish(out, ls, lqs, S, ref, state)
    if dest is None:
        return part, st
    dest.copy_(finalize(part, eps))
    return None, st


def _state_matrix(state: LinearState, scaled: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state as one ``[B,Hkv,F,Dv+1]`` matrix ``[S, z]`` (written into ``out`` when given) and
    its reference; unscaled features (``scaled`` False) need a reference ≥ 0."""
    if out is None:
        S = torch.cat([state.S, state.z.unsqueeze(-1)], dim=-1)
    else:
        S = out
        S[..., :-1].copy_(state.S)
        S[..., -1].copy_(state.z)
    ref = state.ref
    if not scaled:  # unscaled features: everything at log scale 0
        new_ref = ref.clamp_min(0.0)
        factor = torch.exp(ref - new_ref)[..., None, None]
        S, ref = (S.mul_(factor) if out is not None else S * factor), new_ref
    return S, ref


def _finish(out, ls, lqs, S, ref, state: LinearState) -> tuple[Partial, LinearState]:
    """Partial and state from the scan's ``out [B,Hkv,G,N,Dv+1]``, ``ls [B,Hkv,G,N]``, the blocks'
    query log scales and the final ``S [B,Hkv,F,Dv+1]``, ``ref``."""
    if lqs and lqs[0] is not None:
        ls = ls + (lqs[0] if len(lqs) == 1 else torch.cat(lqs, dim=-1))
    dv = out.shape[-1] - 1
    part = Partial(out[..., :dv], out[..., dv], ls)
    return part, LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)


def _causal_scan_into(get, plan, state: LinearState, scaled: bool, g: int, dest, eps: float) -> tuple[Partial | None, LinearState]:
    """:func:`_causal_scan` without autograd: full blocks run :func:`causal_block_into` on one
    (cached) :class:`BlockWorkspace` and write into one preallocated result — the Partial's
    ``[num, den]`` buffer, or the normalised output ``dest`` directly."""
    b, hkv, f, dv = state.S.shape
    dv1, dtype, dev = dv + 1, state.S.dtype, state.S.device
    n = sum(t for t, _ in plan)
    t_full, c_full = plan[0]
    out = torch.empty(b, hkv, g, n, dv1, dtype=dtype, device=dev) if dest is None else None
    ls_k = torch.empty(b, hkv, n, dtype=dtype, device=dev) if dest is None else None  # (normalised: not needed)
    ws = workspace(b, hkv, g, t_full, c_full, f, dv1, dtype, dev) if t_full > c_full else None
    S, ref = _state_matrix(state, scaled, ws.S.view(b, hkv, f, dv1) if ws is not None else None)
    lqs, t0 = [], 0
    for i, (t, c) in enumerate(plan):
        full = ws is not None and (t, c) == (t_full, c_full)  # single-chunk blocks gain nothing
        qf, lq, kf, lk, v = get(i, ws if full else None)
        if not scaled:
            lk = None
        o_blk = out[:, :, :, t0 : t0 + t] if dest is None else dest[:, :, :, t0 : t0 + t]
        if full:
            S, ref = causal_block_into(ws, qf, kf, lk, v, S, ref, o_blk, ls_k[:, :, t0 : t0 + t] if dest is None else None, eps if dest is not None else None)
        else:
            o, ls, S, ref = _block_step(qf, lq, kf, lk, v, S, ref, c)
            if dest is None:
                o_blk.copy_(o)
                ls_k[:, :, t0 : t0 + t].copy_(ls[:, :, 0])
            else:
                torch.div(o[..., : dv1 - 1], o[..., dv1 - 1 :].clamp_min(eps), out=o_blk)
        lqs.append(lq)
        t0 += t
    if ws is not None and S.data_ptr() == ws.S.data_ptr():
        S = S.clone()  # the workspace outlives this call
    if dest is not None:
        dv = dv1 - 1
        return None, LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)
    ls = ls_k.unsqueeze(2).expand(b, hkv, g, n)
    return _finish(out, ls, lqs, S, ref, state)


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
    block (default :data:`DEFAULT_BLOCK_SIZE`; bounds the working set, not the result).
    """
    b, hkv, g, n, f = qf.shape
    dv = v.shape[-1]
    if state is None:
        state = LinearState.zeros(b, hkv, f, dv, device=qf.device, dtype=qf.dtype)

    plan = _plan(n, chunk_size, block_size)
    sizes = [p[0] for p in plan]
    qs, lqs, ks, lks, vs = _split(qf, sizes, 3), _split(lq, sizes, -1), _split(kf, sizes, 2), _split(lk, sizes, -1), _split(v, sizes, 2)

    def get(i: int, ws: BlockWorkspace | None) -> _Block:
        return qs[i], lqs[i], ks[i], lks[i], vs[i]

    infer = not needs_grad(qf, lq, kf, lk, v, state.S, state.z, state.ref)
    return _causal_scan(get, plan, state, lk is not None, g, infer)


def causal_feature_attention(
    feature_map,
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    lq_add: torch.Tensor | None = None,
    lk_add: torch.Tensor | None = None,
    chunk_size: int = 64,
    state: LinearState | None = None,
    block_size: int | None = None,
    x_scale: float = 1.0,
    out: torch.Tensor | None = None,
    checkpoint: bool = False,
    backend: str | None = None,
) -> tuple[Partial | None, LinearState]:
    """Fused features + causal linear attention: the feature map is applied block by block.

    xq ``[B, H, N, D]``, xk ``[B, Hkv, N, D]`` (multiplied by ``x_scale`` block by block before the
    feature map: pass √scale here, or 1.0 for inputs already scaled), v ``[B, Hkv, N, Dv]``
    (low-precision q/k/v are converted to float32 block by block, never as a whole),
    key_mask ``[B, N]`` bool (False: key skipped) or None, optional log-scale offsets added to the
    features' (gated maps): ``lq_add [B, Hkv, G, N]``, ``lk_add [B, Hkv, N]``. Equivalent to
    computing ``qf, lq, kf, lk`` over the whole sequence (as ``random_feature_attention`` does),
    masking, and calling :func:`causal_linear`, but never holds ``[N, F]`` features. Requires a
    per-token feature map (every map in this package is). ``checkpoint``: with autograd, save
    only each block's inputs and recompute its features and products in backward. ``backend``:
    the one :func:`hf_rfa.ops.backends.resolve` chose (None: ``"auto"`` for these inputs).
    """
    b, h, n, _ = xq.shape
    hkv = xk.shape[1]
    g = h // hkv
    fdim, dv = feature_map.feature_dim, v.shape[-1]
    if n == 0:
        raise ValueError("causal_feature_attention needs N >= 1")
    ct = torch.float64 if xq.dtype == torch.float64 else torch.float32  # q/k/v may be bf16/fp16
    params = [p for p in feature_map.parameters()] if isinstance(feature_map, torch.nn.Module) else []
    st_t = (state.S, state.z, state.ref) if state is not None else ()
    if backend is None:
        backend = resolve("auto", grad=needs_grad(xq, xk, v, lq_add, lk_add, *st_t, *params), causal=True, device=xq.device, dtype=ct)
    infer = backend != "torch"
    if backend == "native":
        nparams = feature_map.native_params(x_scale)
        if nparams is not None:
            if state is None:
                state = LinearState.zeros(b, hkv, fdim, dv, device=xq.device, dtype=ct)
            return _native_causal(nparams, xq, xk, v, key_mask, lq_add, lk_add, chunk_size, state, out, feature_map.eps)
    probe_k = feature_map.forward_keys(xk[:, :, :1].to(ct) * x_scale)
    scaled = probe_k.log_scale is not None or lk_add is not None
    dtype = probe_k.phi.dtype
    if state is None:
        state = LinearState.zeros(b, hkv, fdim, dv, device=xq.device, dtype=dtype)

    plan = _plan(n, chunk_size, block_size)
    sizes = [p[0] for p in plan]
    xqs, xks, vs = _split(xq, sizes, 2), _split(xk, sizes, 2), _split(v, sizes, 2)
    kms, lqas, lkas = _split(key_mask, sizes, 1), _split(lq_add, sizes, -1), _split(lk_add, sizes, -1)

    def get(i: int, ws: BlockWorkspace | None) -> _Block:
        t = sizes[i]
        xqb, xkb = xqs[i], xks[i]
        if ws is None:
            if x_scale != 1.0:  # (in the compute dtype: bf16/fp16 inputs are not rounded again)
                xqb, xkb = xqb.to(ct) * x_scale, xkb.to(ct) * x_scale
            fq, fk = feature_map.forward_queries(xqb), feature_map.forward_keys(xkb)
        else:  # inference: features straight into the workspace (the map applies x_scale)
            fq = feature_map.features_into(xqb, ws.q_heads, True, x_scale)
            fk = feature_map.features_into(xkb, ws.k, False, x_scale)
        qf = fq.phi.reshape(b, hkv, g, t, -1)
        lq = fq.log_scale.reshape(b, hkv, g, t) if fq.log_scale is not None else None
        kf, lk = fk.phi, fk.log_scale
        if lqas[i] is not None:
            lq = lqas[i] if lq is None else lq + lqas[i]
        if lkas[i] is not None:
            lk = lkas[i] if lk is None else lk + lkas[i]
        if kms[i] is not None:
            km = kms[i][:, None]
            kf = kf.mul_(km.unsqueeze(-1)) if ws is not None else kf * km.unsqueeze(-1)
            if lk is not None:
                lk = torch.where(km, lk, torch.full_like(lk, NEG))
        return qf, lq, kf, lk, vs[i]

    return _causal_scan(get, plan, state, scaled, g, infer, out, feature_map.eps, checkpoint)


def _native_causal(params, xq, xk, v, key_mask, lq_add, lk_add, chunk_size: int, state: LinearState, out, eps: float) -> tuple[Partial | None, LinearState]:
    """:func:`causal_feature_attention` by the compiled CPU kernel (:mod:`hf_rfa.ops.backends.native`;
    its twin is the inference form :func:`_causal_scan_into`)."""
    b, h, n, _ = xq.shape
    hkv, dv = xk.shape[1], v.shape[-1]
    g = h // hkv
    S, ref = _state_matrix(state, True)
    S, ref = S.to(torch.float32).contiguous(), ref.to(torch.float32).clone()  # updated in place
    o, mt, lq = native.causal_positive(xq, xk, v, params, key_mask, lk_add, S, ref, chunk_size, eps if out is not None else None, exp_floor(torch.float32), dest=out)
    st = LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)
    if out is not None:
        return None, st
    o = o.view(b, hkv, g, n, dv + 1)
    ls = mt.unsqueeze(2) + lq.view(b, hkv, g, n)
    if lq_add is not None:
        ls = ls + lq_add
    return Partial(o[..., :dv], o[..., dv], ls), st


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
