"""The terms both forms of an exact-memory call share (:mod:`.sequential`, :mod:`.periods`):
the call's set-up (:func:`prepare_call`: the buffer and the new keys as one local block, scaled
inputs, gates, scores, the exact window/sink part), the top-M choice (:func:`select_memory`), the
exact and pending-key terms, and the new state (:func:`finish_call`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import native
from ..band.exact import exact_local
from ..band.plan import Band
from ..decode.state import DecodeState, exact_part, join_sinks
from ..masks import NEG, exp_floor, sink_positions
from ..partial import Partial, finalize, merge
from ..recurrent import LinearState, decay
from ..rotary import far_queries
from .scores import round_log2, value_norm, window_mass
from .state import MemoryCall, MemoryState


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x ``[B, Hkv, K, ·]`` or ``[B, Hkv, K]`` at idx ``[B, Hkv, M]`` along K."""
    if x.dim() == 3:
        return torch.gather(x, 2, idx)
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def select_memory(mem: dict[str, torch.Tensor], cand: dict[str, torch.Tensor], memory: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Top-``memory`` of the memory slots and new candidates by ``‖v‖`` (ties: older position).

    ``mem``/``cand``: dicts with ``k [B,Hkv,K,D]``, ``v``, ``pos [B,Hkv,K]``, ``norm``, ``ok``
    (bool). Returns the new memory (same keys, M slots) and ``fold [B, Hkv, M + Kc]`` bool: the
    valid entries of ``cat(mem, cand)`` that were not chosen (they go to the feature state)."""
    both = {name: torch.cat([mem[name], cand[name]], dim=2) for name in mem}
    ok = both["ok"]
    by_pos = torch.sort(both["pos"], dim=-1, stable=True).indices
    score = torch.where(ok, both["norm"], torch.full_like(both["norm"], float("-inf")))
    by_norm = torch.sort(torch.gather(score, 2, by_pos), dim=-1, descending=True, stable=True).indices
    top = torch.gather(by_pos, 2, by_norm)[..., :memory]  # [B,Hkv,M]
    new = {name: gather_slots(x, top) for name, x in both.items()}
    chosen = torch.zeros_like(ok).scatter_(2, top, new["ok"])
    return new, ok & ~chosen


def _weights(scores_or_logs: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp(x − r) with masked entries 0, r)`` for logs ``x [..., K]`` and mask ``ok`` (r: the
    row max over ``ok``, detached; NEG where none)."""
    x = torch.where(ok, scores_or_logs, torch.full_like(scores_or_logs, NEG))
    r = x.amax(-1).detach()
    w = torch.exp((x - r.unsqueeze(-1)).clamp(exp_floor(x.dtype), 0.0)).masked_fill(~ok, 0.0)
    return w, r


def exact_terms(xq: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, ok: torch.Tensor, far: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax terms ``(num, den, row max)`` of queries ``xq [..., R, D]`` over keys ``[..., K, D]``
    (values ``[..., K, Dv]``) where ``ok [..., 1 | R, K]`` (:func:`_weights`'s weights). Without
    autograd the weights are formed in place in the scores (no [R, K] temporaries; the masks are
    skipped when every key is valid) — the same values. ``far = (xq2, keys2, mask [..., R, K])``:
    where mask, the score is ``xq2·keys2`` instead (a memory key read at a clamped distance)."""
    scores = xq @ keys.transpose(-1, -2)
    if far is not None:
        scores = torch.where(far[2], far[0] @ far[1].transpose(-1, -2), scores)
    if torch.is_grad_enabled() and (xq.requires_grad or keys.requires_grad or vals.requires_grad):
        w, r = _weights(scores, ok)
        return w @ vals, w.sum(-1), r
    full = bool(ok.all())
    if not full:
        scores.masked_fill_(~ok, NEG)
    r = scores.amax(-1, keepdim=True)
    scores.sub_(r).clamp_(min=exp_floor(scores.dtype)).exp_()
    if not full:
        scores.masked_fill_(~ok, 0.0)
    return scores @ vals, scores.sum(-1), r.squeeze(-1)


def memory_part(xq: torch.Tensor, mk: torch.Tensor, mv: torch.Tensor, ok: torch.Tensor, far: tuple | None = None) -> Partial:
    """Exact softmax terms of the memory: xq ``[B, Hkv, G, C, D]``, mk ``[B, Hkv, M, D]`` (both
    scaled by √scale), mv ``[B, Hkv, M, Dv]``, ok ``[B, Hkv, M]``. ``far = (xq_far [B, Hkv, G, C,
    D], mkf [B, Hkv, M, D], mask [B, Hkv, C, M])``: the memory keys beyond the clamped distance
    (mask) are scored un-rotated (mkf) against the far queries."""
    b, hkv, g, c, d = xq.shape
    if far is not None:
        far = (far[0].reshape(b, hkv, g * c, d), far[1], far[2].unsqueeze(2).expand(b, hkv, g, c, far[2].shape[-1]).reshape(b, hkv, g * c, -1))
    num, den, r = exact_terms(xq.reshape(b, hkv, g * c, d), mk, mv, ok[:, :, None, :], far)  # G·C rows: no broadcast copies
    return Partial(num.view(b, hkv, g, c, -1), den.view(b, hkv, g, c), r.view(b, hkv, g, c))


def pending_part(qf: torch.Tensor, lq: torch.Tensor | None, kf: torch.Tensor, lk: torch.Tensor | None, vk: torch.Tensor, vis: torch.Tensor) -> Partial:
    """Feature terms of the pending keys: qf ``[*L, G, C, F]``, lq ``[*L, G, C]`` or None,
    kf ``[*L, P, F]``, lk ``[*L, P]`` or None, vk ``[*L, P, Dv]``, vis ``[*L, C, P]`` (broadcast;
    key p visible to query c); ``*L`` leading dims, e.g. ``B, Hkv`` (or ``B, Hkv, periods``).
    Streaming-safe: each row's scale is the max over its own keys. Without autograd the weighted
    scores are formed in place."""
    *lead, g, c, f = qf.shape
    p = kf.shape[-2]
    dot = (qf.reshape(*lead, g * c, f) @ kf.transpose(-1, -2)).view(*lead, g, c, p)
    if lk is not None:
        w, m = _weights(lk.unsqueeze(-2).expand(*lead, c, p), vis)  # [*L,C,P], [*L,C]
        ls = m.unsqueeze(-2).expand(*lead, g, c)
    else:
        w = vis.to(dot.dtype).expand(*lead, c, p)
        ls = dot.new_zeros(*lead, g, c)
    grad = torch.is_grad_enabled() and (dot.requires_grad or w.requires_grad)
    a = dot * w.unsqueeze(-3) if grad else dot.mul_(w.unsqueeze(-3))
    if lq is not None:
        ls = ls + lq
    return Partial((a.view(*lead, g * c, p) @ vk).view(*lead, g, c, -1), a.sum(-1), ls)


def map_features(feature_map, x: torch.Tensor, queries: bool, hkv: int):
    """``(phi, log_scale)`` of scaled queries ``[B, H, C, D]`` (grouped ``[B, Hkv, G, C, F]``) or
    keys ``[B, Hkv, P, D]``."""
    f = feature_map.forward_queries(x) if queries else feature_map.forward_keys(x)
    if not queries:
        return f.phi, f.log_scale
    b, h, c = f.phi.shape[:3]
    return f.phi.reshape(b, hkv, h // hkv, c, -1), (f.log_scale.reshape(b, hkv, h // hkv, c) if f.log_scale is not None else None)


@dataclass
class Call:
    """What both forms of a call (:func:`run_sequential`, :func:`hf_rfa.ops.memory.periods.run_periods`)
    share: the state's buffer and the new keys as one *local* block (local index 0 = absolute
    position ``pos0``, the oldest pending key; ``L = Lb + n`` keys), scaled inputs, gates, scores
    and the exact window/sink part of the new queries."""

    b: int
    h: int
    n: int
    hkv: int
    g: int
    ct: torch.dtype
    root: float
    p0: int
    pos0: int
    sink: tuple  # (sink_k, sink_v, sink_pos, sink_exists) after the new tokens joined
    lk_raw: torch.Tensor  # [B,Hkv,L,D] keys (state dtype)
    lv_raw: torch.Tensor  # [B,Hkv,L,Dv]
    lkf_raw: torch.Tensor | None  # [B,Hkv,L,D] feature keys, or None
    real: torch.Tensor  # [B,L] bool
    feat: torch.Tensor  # [B,L] bool: real, not a sink (a memory candidate / feature key)
    xqg: torch.Tensor  # [B,Hkv,G,n,D] queries · √scale (compute dtype)
    xk: torch.Tensor  # [B,Hkv,L,D] keys · √scale
    vv: torch.Tensor  # [B,Hkv,L,Dv] values (compute dtype)
    xqf: torch.Tensor  # [B,H,n,D] the feature part's queries · √scale
    xkf: torch.Tensor  # [B,Hkv,L,D] the feature part's keys · √scale
    gated: bool
    cg: torch.Tensor | None  # [B,Hkv,L] cumulative log gate from the anchor (gated maps)
    key_lg: torch.Tensor | None  # [B,Hkv,L] log weight of each local key as of the anchor
    norms: torch.Tensor | None  # [B,Hkv,L] value_norm / query_mass scores (None: scored by feature_error)
    exact: Partial | None  # window band + sinks of the n queries
    mass: torch.Tensor | None = None  # [B,Hkv,L] float64 query_mass sums (window_mass), None for the other scores
    far_q: torch.Tensor | None = None  # [B,Hkv,G,n,D] the feature queries as read at MemoryCall.distance (far_queries), or None


def prepare_call(state: MemoryState, q, k, v, km, feature_map, settings: MemoryCall, features: tuple) -> Call:
    """The shared set-up of a call (see :func:`run_sequential` for the arguments)."""
    window, sinks, scale, chunk_size = settings.window, settings.sinks, settings.scale, settings.chunk_size
    fq, fk = features
    base = state.base
    b, h, n, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    ct = base.linear.S.dtype
    root = scale**0.5
    dev = q.device
    null = getattr(feature_map, "null", False)
    p0, lb = base.seen, base.win_k.shape[2]
    pos0 = p0 - lb  # absolute position of local index 0 (the oldest pending key)

    sink_k, sink_v, sink_pos, sink_exists, new_sink = join_sinks(base, k, v, km, sinks, p0)
    lk_raw = torch.cat([base.win_k, k.to(base.win_k.dtype)], dim=2)  # [B,Hkv,L,D]
    lv_raw = torch.cat([base.win_v, v.to(base.win_v.dtype)], dim=2)
    real = torch.cat([base.win_real, km], dim=1)  # [B,L]
    feat = torch.cat([base.win_feat, km & ~new_sink], dim=1)  # real, not a sink: memory candidate / feature key
    xq = q.to(ct) * root
    xk = lk_raw.to(ct) * root
    vv = lv_raw.to(ct)
    lkf_raw = torch.cat([base.win_kf, fk.to(base.win_kf.dtype)], dim=2) if fk is not None else None
    xqf = fq.to(ct) * root if fq is not None else xq  # the feature part's queries and keys
    xkf = lkf_raw.to(ct) * root if fk is not None else xk
    gated = getattr(feature_map, "has_gate", False) and not null
    cg = key_lg = None
    if gated:  # the state is anchored at local index −1 (the position before the buffer's first key)
        logg, log1mg = feature_map.log_gate(xkf)  # [B,Hkv,L]
        cg = torch.cumsum(logg * real[:, None, :].to(logg.dtype), dim=-1)  # decay from the anchor to j; padding never decays
        key_lg = log1mg - cg  # log weight of local key s as of the anchor
    xqg = xq.reshape(b, hkv, g, n, d)

    exact = None
    if window > 0 or sinks > 0:  # window band + sinks: independent of the memory
        if p0 == 0 and settings.native_band:  # a prefill: the band of the op without memory (same terms)
            spos, sok = sink_positions(km, b, n, sinks, dev) if sinks > 0 else (None, None)
            num, den, ls = native.causal_band(q, k, v, scale, km, window, (spos, sok), native.KernelRun(chunk_size, exp_floor(torch.float32)))
            exact = Partial(num.view(b, hkv, g, n, -1), den.view(b, hkv, g, n), ls.view(b, hkv, g, n))
        elif p0 == 0:
            exact = exact_local(xqg, xk, vv, km, Band(window, sinks, True, chunk_size))
        else:
            xs, vs = (sink_k.to(ct) * root, sink_v.to(ct)) if sinks > 0 else (None, None)
            exact = exact_part(xqg, xk, vv, real, (lb, pos0), window, (xs, vs, sink_pos, sink_exists) if sinks > 0 else None, chunk_size)
    norms = value_norm(lv_raw).to(ct) if settings.memory_score == "value_norm" else None  # [B,Hkv,L]
    mass = None
    if settings.memory_score == "query_mass":  # the buffer's sums so far plus this call's queries'
        old = state.buf_mass if state.buf_mass is not None else torch.zeros(b, hkv, lb, dtype=torch.float64, device=dev)
        mass = torch.cat([old, old.new_zeros(b, hkv, n)], dim=2)
        if exact is not None:
            mass = mass + window_mass(xqg, xk, (exact.den, exact.log_scale), (km, real), window, p0 - pos0)
        norms = round_log2(mass).to(ct)
    far = settings.distance > 0 and p0 + n - 1 > settings.distance  # (else no key can be that far back in this call)
    far_q = far_queries(xqf, settings.far_rope).reshape(b, hkv, g, n, d) if far else None
    return Call(b, h, n, hkv, g, ct, root, p0, pos0, (sink_k, sink_v, sink_pos, sink_exists), lk_raw, lv_raw, lkf_raw, real, feat,
                 xqg, xk, vv, xqf, xkf, gated, cg, key_lg, norms, exact, mass, far_q)


def finish_call(state: MemoryState, c: Call, total: Partial, linear: LinearState, mem: dict[str, torch.Tensor], lo: int, km: torch.Tensor, eps: float) -> tuple[torch.Tensor, MemoryState]:
    """Merge the exact part, normalise, and build the new state (buffer from local index ``lo``;
    a gated state is re-anchored before it)."""
    base = state.base
    if c.exact is not None:
        total = merge(c.exact, total)
    out = finalize(total, eps).reshape(c.b, c.h, c.n, -1)
    if c.gated and lo > 0:  # re-anchor the state and the memory's weights at the new buffer's start
        shift = c.cg[:, :, lo - 1]  # [B,Hkv]
        linear = decay(linear, shift)
        mem = {**mem, "lg": mem["lg"] + shift.unsqueeze(-1)}
    sink_k, sink_v, sink_pos, sink_exists = c.sink
    new_base = DecodeState(
        linear=linear,
        win_k=c.lk_raw[:, :, lo:],
        win_v=c.lv_raw[:, :, lo:],
        win_kf=c.lkf_raw[:, :, lo:] if c.lkf_raw is not None else None,
        win_real=c.real[:, lo:],
        win_feat=c.feat[:, lo:],
        win_decay=base.win_decay,
        sink_k=sink_k,
        sink_v=sink_v,
        sink_pos=sink_pos,
        sink_exists=sink_exists,
        real_count=base.real_count + km.long().sum(-1),
        nonfinite=base.nonfinite,
        seen=c.p0 + c.n,
    )
    mass = c.mass[:, :, lo:] if c.mass is not None else None
    return out, MemoryState(new_base, mem["k"], mem["v"], mem["pos"], mem["norm"], mem["ok"], mem["lg"], mem.get("kf"), mass)


__all__ = ["Call", "exact_terms", "finish_call", "gather_slots", "map_features", "memory_part", "pending_part", "prepare_call", "select_memory"]
