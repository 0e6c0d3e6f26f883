"""The exact memory's period-parallel form: :func:`hf_rfa.ops.memory.sequential.run_sequential` with the queries'
work batched over refresh periods (the prefill speed guard).

The sequential form answers each period of ``E = memory_every`` queries with ~20 small ops
(select, fold, features of the pending keys, memory scores, state read, pending scores) — at
16,384 tokens 256 periods per layer, which made the memory path cost as much as the rest of the
model. This form splits a call in two:

1. **Choose** (sequential, per refresh, small): the features of every key are computed once; at
   each refresh the candidates are scored (``feature_error`` reads the current state), the top-M
   is chosen by index, and the keys not chosen are folded into the state. It records, for every
   period, the memory (indices into ``pool`` = the state's M memory slots followed by the call's
   L local keys) and the feature state after its refresh (``[B, Hkv, P, F, Dv]``).
2. **Answer** (batched over periods, in blocks of ``PERIOD_BLOCK`` periods): the memory part is
   one ``[P, G·E, M]`` product, the state read one ``[P, G·E, F] × [P, F, Dv]`` product, the
   pending keys (those that left the window since the period's refresh: at most E) one
   ``[P, G·E, E]`` product — each with the same terms, masks and per-row scales as the sequential
   form.

Same outputs (up to float rounding: sums are grouped differently) and the same final state, so
a prefill by this form continues by cached decoding exactly as before; the sequential form stays
the twin (``tests/ops/test_memory_periods.py``). Autograd flows as in the sequential form (the
choice of indices is not differentiable; q, k, v of every term are).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..masks import NEG
from .scores import recall_error
from .state import MemoryCall, MemoryState
from .terms import exact_terms, finish_call, gather_slots, map_features, pending_part, prepare_call, select_memory
from ..partial import Partial, merge
from ..recurrent import LinearState, fold

#: periods answered at once in step 2 (bounds its intermediates: ~PERIOD_BLOCK·E·H·(M + F + E) floats)
PERIOD_BLOCK = 8


def _pool_gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x ``[B, Hkv, K, ·]`` or ``[B, Hkv, K]`` at idx ``[B, Hkv, P, J]`` → ``[B, Hkv, P, J, ·]`` / ``[B, Hkv, P, J]``."""
    b, hkv, p, j = idx.shape
    flat = idx.reshape(b, hkv, p * j)
    if x.dim() == 3:
        return torch.gather(x, 2, flat).view(b, hkv, p, j)
    return torch.gather(x, 2, flat.unsqueeze(-1).expand(b, hkv, p * j, x.shape[-1])).view(b, hkv, p, j, x.shape[-1])


def _by_period(x: torch.Tensor, off: int, periods: int, e: int) -> torch.Tensor:
    """Per-query rows ``[B, Hkv, G, n, ·]`` → ``[B, Hkv, P, G·E, ·]`` (query t at slot t mod E of
    its period; ``off`` empty slots before the first query, zeros after the last)."""
    b, hkv, g, n = x.shape[:4]
    tail = x.shape[4:]
    pad = x.new_zeros(b, hkv, g, periods * e, *tail)
    pad[:, :, :, off : off + n] = x
    pad = pad.view(b, hkv, g, periods, e, *tail).transpose(2, 3)
    return pad.reshape(b, hkv, periods, g * e, *tail)


def _from_period(x: torch.Tensor, g: int, off: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_by_period` for ``[B, Hkv, P, G·E, ·]`` → ``[B, Hkv, G, n, ·]``."""
    b, hkv, periods, ge = x.shape[:4]
    tail = x.shape[4:]
    e = ge // g
    y = x.view(b, hkv, periods, g, e, *tail).transpose(2, 3).reshape(b, hkv, g, periods * e, *tail)
    return y[:, :, :, off : off + n]


def _answer_block(g: int, e: int, exact: tuple, feature: tuple | None = None):
    """The Partial ``(num, den, log_scale)`` of a block of pp periods' query slots
    ``[B, Hkv, pp, G·E, ·]``: the memory's exact terms, then (maps with features) the state read and
    the pending keys, merged in the sequential form's order. ``exact = (xq, idx, ok, pk, pool_v)``;
    ``feature = (qf, lq, kf_pool, lk_pool, S, z, ref, sidx, vis)`` or None (no feature part):

    xq ``[B, Hkv, pp, G·E, D]`` queries · √scale; idx / ok ``[B, Hkv, pp, M]`` each period's memory
    (pool indices, filled); pk / pool_v ``[B, Hkv, K, D|Dv]`` the pool's keys · √scale and values;
    qf ``[B, Hkv, pp, G·E, F]``, lq ``[B, Hkv, pp, G·E]`` or None; kf_pool ``[B, Hkv, K, F]``, lk_pool
    ``[B, Hkv, K]`` or None; S ``[B, Hkv, pp, F, Dv]``, z ``[B, Hkv, pp, F]``, ref ``[B, Hkv, pp]`` the
    state after each period's refresh; sidx ``[pp, width]`` the pending keys' pool indices, vis
    ``[B, pp, E, width]`` pending key visible to the query slot."""
    xq, idx, ok, pk, pool_v = exact[:5]
    b, hkv, pp, ge, _ = xq.shape
    far = None
    if len(exact) > 5:  # (far queries, the pool's un-rotated keys, their positions, each row's query position, distance)
        xq_far, pkf, ppos, t_rows, dist = exact[5]
        mask = t_rows[:, :, None] - _pool_gather(ppos, idx).unsqueeze(-2) > dist
        if bool(mask.any()):  # (no key that far yet: the true distances, and no second product)
            far = (xq_far, _pool_gather(pkf, idx), mask)
    part = Partial(*exact_terms(xq, _pool_gather(pk, idx), _pool_gather(pool_v, idx), ok.unsqueeze(-2), far))
    if feature is None:
        return part.num, part.den, part.log_scale
    qf, lq, kf_pool, lk_pool, S, z, ref, sidx, vis = feature
    ls = ref.unsqueeze(-1).expand(b, hkv, pp, ge)
    if lq is not None:
        ls = ls + lq
    part = merge(part, Partial(qf @ S, (qf @ z.unsqueeze(-1)).squeeze(-1), ls))
    sidx = sidx.expand(b, hkv, *sidx.shape)
    lk = _pool_gather(lk_pool, sidx) if lk_pool is not None else None  # [B,Hkv,pp,width]
    pend = pending_part(qf.view(b, hkv, pp, g, e, -1), lq.view(b, hkv, pp, g, e) if lq is not None else None,
                         _pool_gather(kf_pool, sidx), lk, _pool_gather(pool_v, sidx), vis[:, None])
    part = merge(part, Partial(pend.num.view(b, hkv, pp, ge, -1), pend.den.view(b, hkv, pp, ge), pend.log_scale.reshape(b, hkv, pp, ge)))
    return part.num, part.den, part.log_scale


def run_periods(state: MemoryState, q, k, v, km, feature_map, settings: MemoryCall, features: tuple = (None, None)) -> tuple[torch.Tensor, MemoryState]:
    """:func:`hf_rfa.ops.memory.sequential.run_sequential` (same arguments, outputs and final
    state) with the queries' work batched over refresh periods (module docstring)."""
    fk = features[1]
    c = prepare_call(state, q, k, v, km, feature_map, settings, features)
    b, hkv, ct, root = c.b, c.hkv, c.ct, c.root
    null = getattr(feature_map, "null", False)
    nloc = c.lk_raw.shape[2]

    # pool = the state's memory slots [0, M) then the local keys [M, M + L)
    pool = {
        "k": torch.cat([state.mem_k, c.lk_raw], dim=2),
        "v": torch.cat([state.mem_v, c.lv_raw], dim=2),
        "lg": torch.cat([state.mem_lg, c.key_lg if c.gated else state.mem_lg.new_zeros(b, hkv, nloc)], dim=2),
    }
    if fk is not None:
        pool["kf"] = torch.cat([state.mem_kf, c.lkf_raw], dim=2)
    pool_v = pool["v"].to(ct)
    kf_pool = lk_pool = None
    if not null:  # every key's features once (memory slots included: a displaced one is folded)
        kf_pool, lk_pool = map_features(feature_map, pool["kf" if fk is not None else "k"].to(ct) * root, False, hkv)
        if c.gated:
            lk_pool = pool["lg"] if lk_pool is None else lk_pool + pool["lg"]
    chosen = _choose(state, c, (kf_pool, lk_pool, pool_v), settings, null)
    sel, linear, lo = chosen[0], chosen[1], chosen[2]
    far = None
    if c.far_q is not None:  # memory keys read at a clamped distance: the pool's un-rotated keys and positions
        far = (settings.distance, pool["kf"].to(ct) * root, torch.cat([state.mem_pos, (c.pos0 + torch.arange(nloc, device=q.device)).expand(b, hkv, nloc)], dim=2))
    total = _answer(c, feature_map, chosen, pool["k"].to(ct) * root, pool_v, kf_pool, lk_pool, (settings.window, settings.memory_every, state.memory, null, (q, k, v), far))
    final = {"ok": sel["ok"], "pos": sel["pos"], "norm": sel["norm"], **{name: gather_slots(x, sel["idx"]) for name, x in pool.items()}}
    return finish_call(state, c, total, linear, final, lo, km, feature_map.eps)


def _choose(state: MemoryState, c, pool: tuple, settings: MemoryCall, null: bool):
    """Step 1: per refresh, the memory (pool indices) and the feature state after it; ``pool =
    (kf_pool, lk_pool, pool_v)``. Returns ``(sel, linear, lo, mem_idx, mem_ok, los, states)``: the
    final choice, state and buffer start, and per period its memory indices / flags, buffer start
    and state."""
    kf_pool, lk_pool, pool_v = pool
    window, e, by_error = settings.window, settings.memory_every, settings.memory_score == "feature_error"
    b, hkv, n, ct, p0, pos0 = c.b, c.hkv, c.n, c.ct, c.p0, c.pos0
    dev = pool_v.device
    memory = state.memory
    sel = {"idx": torch.arange(memory, device=dev).expand(b, hkv, memory), "pos": state.mem_pos, "norm": state.mem_norm, "ok": state.mem_ok}
    linear = state.base.linear
    lo = 0
    j0, j1 = p0 // e, (p0 + n - 1) // e
    mem_idx, mem_ok, los, states = [], [], [], []
    for j in range(j0, j1 + 1):
        a = max(p0, j * e)
        if a % e == 0 and a - window - pos0 + 1 > lo:  # refresh: local keys [lo, hi) are new candidates
            hi = a - window - pos0 + 1
            cidx = torch.arange(memory + lo, memory + hi, device=dev).expand(b, hkv, hi - lo)
            cand = {
                "idx": cidx,
                "pos": torch.arange(pos0 + lo, pos0 + hi, device=dev).expand(b, hkv, hi - lo),
                "norm": recall_error(linear, kf_pool[:, :, memory + lo : memory + hi], c.vv[:, :, lo:hi]).to(ct) if by_error else c.norms[:, :, lo:hi],
                "ok": c.feat[:, None, lo:hi].expand(b, hkv, hi - lo),
            }
            both_idx = torch.cat([sel["idx"], cidx], dim=2)
            sel, out_mask = select_memory(sel, cand, memory)
            if not null:  # the keys not chosen enter the feature state for good
                kf = gather_slots(kf_pool, both_idx) * out_mask.unsqueeze(-1)
                lkf = None
                if lk_pool is not None:
                    lkf = torch.where(out_mask, gather_slots(lk_pool, both_idx), torch.full(out_mask.shape, NEG, dtype=ct, device=dev))
                linear = fold(linear, kf, lkf, gather_slots(pool_v, both_idx))
            lo = hi
        mem_idx.append(sel["idx"])
        mem_ok.append(sel["ok"])
        los.append(lo)
        states.append(linear)
    return sel, linear, lo, mem_idx, mem_ok, los, states


def _answer(c, feature_map, chosen, pk, pool_v, kf_pool, lk_pool, settings) -> Partial:
    """Step 2: every period's queries at once, in blocks of periods → the call's Partial
    ``[B, Hkv, G, n, ·]``. ``chosen``: :func:`_choose`'s result; ``pk``: the pool's keys · √scale;
    ``settings``: ``(window, memory_every, memory, null, (q, k, v), far)``, ``far = (distance,
    pool keys un-rotated · √scale, pool positions)`` or None."""
    window, e, memory, null, qkv, far = settings
    _, _, _, mem_idx, mem_ok, los, states = chosen
    b, hkv, g, n, p0, pos0 = c.b, c.hkv, c.g, c.n, c.p0, c.pos0
    dev = pool_v.device
    nloc = c.lk_raw.shape[2]
    j0, j1 = p0 // e, (p0 + n - 1) // e
    periods = j1 - j0 + 1
    off = p0 - j0 * e
    xq_p = _by_period(c.xqg, off, periods, e)  # [B,Hkv,P,G·E,D]
    if far is not None:
        far_p = _by_period(c.far_q, off, periods, e)
        t_rows = torch.arange(j0 * e, (j1 + 1) * e, device=dev).view(periods, e).repeat(1, g)  # [P,G·E]: row g·E + e is query slot e
    if not null:
        qf, lq = map_features(feature_map, c.xqf, True, hkv)  # [B,Hkv,G,n,F], [B,Hkv,G,n] | None
        if c.gated:  # the decay from the anchor to each query
            qg = c.cg[:, :, p0 - pos0 :].unsqueeze(2).expand(b, hkv, g, n)
            lq = qg if lq is None else lq + qg
        qf_p = _by_period(qf, off, periods, e)
        lq_p = _by_period(lq.unsqueeze(-1), off, periods, e).squeeze(-1) if lq is not None else None
        # pending keys of period j: local [lo_j, lo_j + width), visible to query t iff s ≤ t − W
        width = max(1, max(min(p0 + n, (j + 1) * e) - window - pos0 - l for j, l in zip(range(j0, j1 + 1), los)))
        t_abs = torch.arange(j0 * e, (j1 + 1) * e, device=dev).view(periods, e)
        t_ok = (t_abs >= p0) & (t_abs < p0 + n)
        lo_t = torch.tensor(los, device=dev).view(periods, 1)
        s_loc = lo_t + torch.arange(width, device=dev).view(1, width)  # [P,width] local index
        s_ok = s_loc < nloc
        s_loc = s_loc.clamp_max(nloc - 1)
    ckpt = torch.is_grad_enabled() and any(x.requires_grad for x in (*qkv, *(() if null else (kf_pool,))))
    parts = []
    for p_lo in range(0, periods, PERIOD_BLOCK):
        p_hi = min(periods, p_lo + PERIOD_BLOCK)
        exact = (xq_p[:, :, p_lo:p_hi], torch.stack(mem_idx[p_lo:p_hi], dim=2), torch.stack(mem_ok[p_lo:p_hi], dim=2), pk, pool_v)
        if far is not None:
            exact = (*exact, (far_p[:, :, p_lo:p_hi], far[1], far[2], t_rows[p_lo:p_hi], far[0]))
        args = [exact]
        if not null:
            blk = states[p_lo:p_hi]
            sl = s_loc[p_lo:p_hi]  # [pp,width]
            vis = (sl.unsqueeze(1) + pos0 <= t_abs[p_lo:p_hi].unsqueeze(-1) - window) & s_ok[p_lo:p_hi].unsqueeze(1) & t_ok[p_lo:p_hi].unsqueeze(-1)  # [pp,E,width]
            args.append((qf_p[:, :, p_lo:p_hi], lq_p[:, :, p_lo:p_hi] if lq_p is not None else None, kf_pool, lk_pool,
                         torch.stack([st.S for st in blk], dim=2), torch.stack([st.z for st in blk], dim=2), torch.stack([st.ref for st in blk], dim=2),
                         sl + memory, vis.unsqueeze(0) & c.feat[:, sl].unsqueeze(2)))  # pool indices, [B,pp,E,width]
        if ckpt:  # training: keep the block's inputs only, recompute its scores in backward
            out = torch.utils.checkpoint.checkpoint(_answer_block, g, e, *args, use_reentrant=False)
        else:
            out = _answer_block(g, e, *args)
        parts.append(Partial(*out))
    total = Partial(*(torch.cat([getattr(p, f) for p in parts], dim=2) for f in ("num", "den", "log_scale")))
    return Partial(_from_period(total.num, g, off, n), _from_period(total.den.unsqueeze(-1), g, off, n).squeeze(-1), _from_period(total.log_scale.unsqueeze(-1), g, off, n).squeeze(-1))


__all__ = ["PERIOD_BLOCK", "run_periods"]
