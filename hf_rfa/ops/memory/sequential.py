"""The exact memory's sequential form: a call answered period by period (refresh boundaries) and,
within a period, chunk by chunk — the twin of the period-parallel form (:mod:`.periods`) and the
form of decoding steps (see :mod:`hf_rfa.ops.memory.attention`)."""

from __future__ import annotations

import torch

from ..masks import NEG
from ..partial import Partial, merge
from ..recurrent import fold, read
from .scores import feature_error
from .state import MemoryCall, MemoryState
from .terms import finish_call, map_features, memory_part, pending_part, prepare_call, select_memory


def run_sequential(state: MemoryState, q, k, v, km, feature_map, settings: MemoryCall, features: tuple = (None, None)) -> tuple[torch.Tensor, MemoryState]:
    """The ``n`` new tokens (q ``[B, H, n, D]``, k ``[B, Hkv, n, D]``, v, key mask ``km [B, n]``
    bool; finite) continuing ``state`` → ``(out [B, H, n, Dv]`` in the compute dtype, state), period
    by period and chunk by chunk (the sequential form; :func:`hf_rfa.ops.memory.periods.run_periods`
    batches the periods and is checked against it). ``settings``: the call's
    :class:`~hf_rfa.ops.memory.state.MemoryCall` (scale resolved; the memory size is the state's);
    ``features = (fq, fk)`` (shapes of q/k, or Nones): what the feature part reads (the state keeps
    them: ``MemoryState.mem_kf``)."""
    window, memory_every, chunk_size, memory_score = settings.window, settings.memory_every, settings.chunk_size, settings.memory_score
    fk = features[1]
    c = prepare_call(state, q, k, v, km, feature_map, settings, features)
    b, hkv, g, n, ct, root, p0, pos0 = c.b, c.hkv, c.g, c.n, c.ct, c.root, c.p0, c.pos0
    dev = q.device
    memory = state.memory
    null = getattr(feature_map, "null", False)
    by_error = memory_score == "feature_error"
    mem = {"k": state.mem_k, "v": state.mem_v, "pos": state.mem_pos, "norm": state.mem_norm, "ok": state.mem_ok, "lg": state.mem_lg}
    if fk is not None:
        mem["kf"] = state.mem_kf
    linear = state.base.linear
    lo = 0  # local index of the oldest key that is not yet a candidate (the buffer's start)
    parts: list[Partial] = []
    a = p0
    while a < p0 + n:
        end = min(p0 + n, (a // memory_every + 1) * memory_every)  # this refresh period's queries: [a, end)
        if a % memory_every == 0 and a - window - pos0 + 1 > lo:  # refresh: keys [lo, a − W] are new candidates
            hi = a - window - pos0 + 1
            cand = {
                "k": c.lk_raw[:, :, lo:hi], "v": c.lv_raw[:, :, lo:hi],
                "pos": torch.arange(pos0 + lo, pos0 + hi, device=dev).expand(b, hkv, hi - lo),
                "norm": feature_error(linear, feature_map, c.xkf[:, :, lo:hi], c.vv[:, :, lo:hi]).to(ct) if by_error else c.norms[:, :, lo:hi],
                "ok": c.feat[:, None, lo:hi].expand(b, hkv, hi - lo),
                "lg": c.key_lg[:, :, lo:hi] if c.gated else state.mem_lg.new_zeros(b, hkv, hi - lo),
            }
            if fk is not None:
                cand["kf"] = c.lkf_raw[:, :, lo:hi]
            fname = "kf" if fk is not None else "k"
            folded = {name: torch.cat([mem[name], cand[name]], dim=2) for name in (fname, "v", "lg")}
            mem, out_mask = select_memory(mem, cand, memory)
            if not null:  # the keys not chosen enter the feature state for good
                kf, lkf = map_features(feature_map, folded[fname].to(ct) * root, False, hkv)
                if c.gated:  # each key enters with its weight as of the anchor
                    lkf = folded["lg"] if lkf is None else lkf + folded["lg"]
                kf = kf * out_mask.unsqueeze(-1)
                if lkf is not None:
                    lkf = torch.where(out_mask, lkf, torch.full_like(lkf, NEG))
                linear = fold(linear, kf, lkf, folded["v"].to(ct))
            lo = hi
        mk, mv = mem["k"].to(ct) * root, mem["v"].to(ct)
        mkf = mem["kf"].to(ct) * root if c.far_q is not None else None
        for c0 in range(a, end, chunk_size):
            c1 = min(end, c0 + chunk_size)
            qi = slice(c0 - p0, c1 - p0)
            far = None
            if mkf is not None:  # memory keys more than `distance` behind the query: read at that distance
                mask = torch.arange(c0, c1, device=dev).view(1, 1, -1, 1) - mem["pos"].unsqueeze(2) > settings.distance
                far = (c.far_q[:, :, :, qi], mkf, mask) if bool(mask.any()) else None
            part = memory_part(c.xqg[:, :, :, qi], mk, mv, mem["ok"], far)
            if not null:
                qf, lq = map_features(feature_map, c.xqf[:, :, qi], True, hkv)
                if c.gated:  # the decay from the anchor to each query
                    qg = c.cg[:, :, c0 - pos0 : c1 - pos0].unsqueeze(2).expand(b, hkv, g, c1 - c0)
                    lq = qg if lq is None else lq + qg
                part = merge(part, read(linear, qf, lq))
                top = c1 - window - pos0  # pending keys of this chunk: local [lo, top), s <= t − W
                if top > lo:
                    kf, lkf = map_features(feature_map, c.xkf[:, :, lo:top], False, hkv)
                    if c.gated:
                        lkf = c.key_lg[:, :, lo:top] if lkf is None else lkf + c.key_lg[:, :, lo:top]
                    t = torch.arange(c0, c1, device=dev).view(-1, 1)
                    s = torch.arange(pos0 + lo, pos0 + top, device=dev).view(1, -1)
                    vis = (s <= t - window).unsqueeze(0) & c.feat[:, None, lo:top]  # [B,C,P]
                    part = merge(part, pending_part(qf, lq, kf, lkf, c.vv[:, :, lo:top], vis[:, None]))
            parts.append(part)
        a = end
    total = Partial(torch.cat([p.num for p in parts], dim=-2), torch.cat([p.den for p in parts], dim=-1), torch.cat([p.log_scale for p in parts], dim=-1))
    return finish_call(state, c, total, linear, mem, lo, km, feature_map.eps)


__all__ = ["run_sequential"]
