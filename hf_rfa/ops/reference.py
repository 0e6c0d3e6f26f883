"""Reference twins (test oracles): exact softmax attention and the quadratic kernelised form.

Both are deliberately simple, O(N²) in memory, and written independently of the fast paths in
``linear.py``/``fused.py``/``hybrid.py``. Shapes: q ``[B, H, Nq, D]``, k/v ``[B, Hkv, Nk, D]``; in causal mode
the queries are the *last* Nq key positions (as with a KV cache).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .masks import NEG, check_feature_inputs, key_mask_bool, no_autocast, sink_mask, validate_qkv
from .memory.scores import round_log2, value_norm

if TYPE_CHECKING:  # type only: ops import nothing from feature_maps at run time
    from ..feature_maps.base import FeatureMap


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, N, D]`` → ``[B, Hkv*groups, N, D]`` (the oracle may materialise repeats)."""
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _positions(nq: int, nk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(nk - nq, nk, device=device).view(-1, 1)
    s = torch.arange(nk, device=device).view(1, -1)
    return t, s


def _exact_region(nq: int, nk: int, causal: bool, window: int, device) -> torch.Tensor:
    """``[Nq, Nk]`` bool: keys in the local window of each query (causal: t−W < s ≤ t; else |t−s| < W)."""
    t, s = _positions(nq, nk, device)
    if window <= 0:
        return torch.zeros(nq, nk, dtype=torch.bool, device=device)
    return ((s <= t) & (s > t - window)) if causal else ((s - t).abs() < window)


@no_autocast
def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention; padded keys (``attention_mask[b, s] == 0``) get no weight.

    Rows with no visible key give 0. Computed in float32 (float64 stays float64).
    Returns ``[B, H, Nq, Dv]`` in q's dtype.
    """
    b, h, nq, d, hkv, nk = validate_qkv(q, k, v, causal)
    scale = d**-0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = h // hkv
    kk, vv = _expand_kv(k.to(ct), g), _expand_kv(v.to(ct), g)
    scores = (q.to(ct) @ kk.transpose(-1, -2)) * scale  # [B,H,Nq,Nk]
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        t, s = _positions(nq, nk, q.device)
        allowed = s <= t
    allowed = allowed.view(1, 1, nq, nk)
    km = key_mask_bool(attention_mask, b, nk, q.device)
    if km is not None:
        allowed = allowed & km.view(b, 1, 1, nk)
    scores = scores.masked_fill(~allowed, NEG)
    p = torch.softmax(scores, dim=-1) * allowed
    return (p @ vv).to(q.dtype)


@no_autocast
def quadratic_kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    window: int = 0,
    sinks: int = 0,
    scale: float | None = None,
    memory: int = 0,
    memory_every: int = 64,
    feature_q: torch.Tensor | None = None,
    feature_k: torch.Tensor | None = None,
    memory_score: str = "value_norm",
    memory_distance: int = 0,
    memory_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The quadratic twin of :func:`hf_rfa.random_feature_attention`.

    Builds the full weight matrix ``W[t, s]``: ``exp(scale·q_t·k_s)`` for keys in the local window
    or among the first ``sinks`` real tokens, ``φ(q_t)·φ(k_s)`` (times the gate's decay, causal
    gated maps only) for all other visible keys, and normalises all of it by one row sum
    (floored at ``feature_map.eps`` relative to the row's log-offset). Returns ``[B, H, Nq, Dv]``.

    ``memory > 0`` (causal only): the keys of :func:`memory_membership` are exact too (and so not
    in the feature part); ``memory_score`` ranks them (:func:`feature_error_scores`, ...). ``feature_q``/``feature_k``: what φ reads instead of q and k.
    ``memory_distance`` Δ > 0, ``memory_rope`` (cos, sin) of Δ: memory key s with t − s > Δ scores ``feature_q_t · R(−Δ) feature_k_s`` (:func:`_turned_back`; the op turns the query instead).
    """
    b, h, nq, d, hkv, nk = validate_qkv(q, k, v, causal)
    feature_q, feature_k = check_feature_inputs(q, k, feature_q, feature_k)
    scale = d**-0.5 if scale is None else scale
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = h // hkv
    qs, ks = q.to(ct) * scale**0.5, k.to(ct) * scale**0.5
    qs_f, ks_f = (qs, ks) if feature_q is None else (feature_q.to(ct) * scale**0.5, feature_k.to(ct) * scale**0.5)
    null = getattr(feature_map, "null", False)  # 'none': no feature part, far keys get zero weight
    if null and window == 0 and sinks == 0:
        raise ValueError("feature_map='none' needs window > 0 or sinks > 0 (otherwise no key is attended)")
    if null:
        dot = logmag = torch.zeros(b, h, nq, nk, dtype=ct, device=q.device)
    else:
        fq, fk = feature_map.forward_queries(qs_f), feature_map.forward_keys(ks_f)
        phi_k = _expand_kv(fk.phi, g)
        lk = _expand_kv(fk.log_scale, g) if fk.log_scale is not None else torch.zeros(phi_k.shape[:-1], dtype=ct, device=q.device)
        lq = fq.log_scale if fq.log_scale is not None else torch.zeros(fq.phi.shape[:-1], dtype=ct, device=q.device)
        dot = fq.phi @ phi_k.transpose(-1, -2)  # [B,H,Nq,Nk], bounded
        logmag = lq.unsqueeze(-1) + lk.unsqueeze(-2)  # log of the feature magnitudes
    t, s = _positions(nq, nk, q.device)
    if causal and feature_map.has_gate:
        logmag = logmag + _gate_log_decay(feature_map, ks_f, attention_mask, nq, g)
    exact = _exact_region(nq, nk, causal, window, q.device).view(1, 1, nq, nk)
    visible = (s <= t) if causal else torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    visible = visible.view(1, 1, nq, nk)
    km = key_mask_bool(attention_mask, b, nk, q.device)
    if km is not None:
        visible = visible & km.view(b, 1, 1, nk)
    if sinks > 0:
        exact = exact | sink_mask(km, b, nk, sinks, q.device).view(b, 1, 1, nk)
    member = None
    if memory > 0:
        member = _expand_kv(_membership(qs, ks, ks_f, v, feature_map, attention_mask, (causal, window, sinks, memory, memory_every, memory_score), nq), g)
        exact = exact | member
    exact = exact & visible
    feat = visible & ~exact & (not null)
    scores = (qs @ _expand_kv(ks, g).transpose(-1, -2))
    if member is not None and memory_distance > 0:  # memory keys beyond Δ: the key turned back by Δ
        far = exact & member & (t - s > memory_distance).view(1, 1, nq, nk)
        scores = torch.where(far, qs_f @ _expand_kv(_turned_back(ks_f, *(x.to(ct) for x in memory_rope)), g).transpose(-1, -2), scores)
    log_w = torch.where(exact, scores, torch.where(feat, logmag, torch.full_like(scores, NEG)))
    if nk == 0:  # no keys: every row is zero (as the op gives)
        return q.new_zeros(b, h, nq, v.shape[-1])
    off = log_w.amax(dim=-1, keepdim=True).detach()
    w_exact = torch.exp(torch.where(exact, scores - off, torch.full_like(scores, NEG)))
    w_feat = dot * torch.exp(torch.where(feat, logmag - off, torch.full_like(scores, NEG)))
    w = w_exact + w_feat
    den = w.sum(-1, keepdim=True).clamp_min(feature_map.eps)
    return ((w @ _expand_kv(v.to(ct), g)) / den).to(q.dtype)


def _membership(qs, ks, ks_f, v, feature_map, attention_mask, settings: tuple, nq: int) -> torch.Tensor:
    """:func:`memory_membership` ``[B, Hkv, Nq, Nk]`` under its score; ``settings = (causal, window,
    sinks, memory, memory_every, memory_score)``."""
    causal, window, sinks, memory, memory_every, memory_score = settings
    if not causal:
        raise ValueError("memory > 0 needs causal attention (the exact memory is chosen over the past)")
    scores_m = None
    if memory_score == "feature_error":
        scores_m = feature_error_scores(ks_f, v, feature_map, attention_mask, window, sinks, memory, memory_every)
    elif memory_score == "query_mass":
        scores_m = query_mass_scores(qs, ks, attention_mask, window, sinks)
    return memory_membership(v, attention_mask, window, sinks, memory, memory_every, nq, scores_m)


def _turned_back(ks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Keys ``[..., D]`` rotated back by the angle of ``(cos, sin)`` ``[Dr]`` (``R(−Δ)``, the first Dr
    dims in halves), times the rotation's squared scale (``cos² + sin²``: the product of two
    rotated vectors carries it; here one factor comes with the rotation, one is multiplied in)."""
    dr = cos.shape[-1]
    kr = ks[..., :dr]
    back = (kr * cos - torch.cat([-kr[..., dr // 2 :], kr[..., : dr // 2]], dim=-1) * sin) * (cos * cos + sin * sin).sqrt()
    return torch.cat([back, ks[..., dr:]], dim=-1)


def _gate_log_decay(feature_map: FeatureMap, ks_f: torch.Tensor, attention_mask: torch.Tensor | None, nq: int, g: int) -> torch.Tensor:
    """A gated map's log decay from key s to query t, ``G_t − G_s + log(1 − g_s)`` ``[B, H, Nq, Nk]``
    (padded keys do not decay the state)."""
    b, _, nk, _ = ks_f.shape
    km0 = key_mask_bool(attention_mask, b, nk, ks_f.device)
    logg, log1mg = feature_map.log_gate(ks_f)  # [B,Hkv,Nk]
    if km0 is not None:
        logg = logg * km0.view(b, 1, nk)
    cg = _expand_kv(torch.cumsum(logg, dim=-1).unsqueeze(-1), g).squeeze(-1)  # [B,H,Nk]
    return cg[..., nk - nq :].unsqueeze(-1) - cg.unsqueeze(-2) + _expand_kv(log1mg.unsqueeze(-1), g).squeeze(-1).unsqueeze(-2)


def _top(cand: torch.Tensor, score: torch.Tensor, memory: int) -> torch.Tensor:
    """The ``memory`` candidates (``cand [B, Hkv, Nk]`` bool) with the largest ``score`` (ties: the
    lower position), as a ``[B, Hkv, Nk]`` bool mask."""
    key = torch.where(cand, score, torch.full_like(score, float("-inf")))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    pos = torch.arange(score.shape[-1], device=score.device)
    rank = torch.empty_like(order).scatter_(-1, order, pos.expand_as(order))
    return cand & (rank < memory)


def memory_membership(
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    window: int,
    sinks: int,
    memory: int,
    memory_every: int,
    nq: int | None = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each causal query answers from the exact memory: ``[B, Hkv, Nq, Nk]`` bool.

    The brute-force definition (the fast path, :mod:`hf_rfa.ops.memory`, keeps it incrementally):
    query t (position ``Nk − Nq + i``) uses the memory chosen at ``r = (t // memory_every) ·
    memory_every``: the ``memory`` keys with the largest ``‖v‖`` (ties: the older key) among the
    keys ``s ≤ r − window`` that are real (``attention_mask``) and not sinks — the keys older than
    the window of query r. v ``[B, Hkv, Nk, Dv]``. Chosen from scratch for every r.
    ``scores`` ``[B, Hkv, Nk]``: rank by these instead of ``‖v‖`` (:func:`feature_error_scores`).
    """
    b, hkv, nk, _ = v.shape
    nq = nk if nq is None else nq
    dev = v.device
    km = key_mask_bool(attention_mask, b, nk, dev)
    eligible = torch.ones(b, nk, dtype=torch.bool, device=dev) if km is None else km.clone()
    if sinks > 0:
        eligible &= ~sink_mask(km, b, nk, sinks, dev)
    norm = value_norm(v) if scores is None else scores  # [B,Hkv,Nk]
    s = torch.arange(nk, device=dev)
    out = torch.zeros(b, hkv, nq, nk, dtype=torch.bool, device=dev)
    t = torch.arange(nk - nq, nk, device=dev)
    refresh = (t // memory_every) * memory_every
    for r in refresh.unique().tolist():
        cand = (eligible & (s <= r - window).view(1, nk)).view(b, 1, nk).expand(b, hkv, nk)
        chosen = _top(cand, norm, memory)  # [B,Hkv,Nk]
        rows = refresh == r
        out[:, :, rows] = chosen.unsqueeze(2).expand(b, hkv, int(rows.sum()), nk)
    return out


def feature_error_scores(
    ks: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    attention_mask: torch.Tensor | None,
    window: int,
    sinks: int,
    memory: int,
    memory_every: int,
) -> torch.Tensor:
    """The ``memory_score="feature_error"`` score of every key, by its definition: ``[B, Hkv, Nk]``.

    Key s (real, not a sink) is first a memory candidate at its first refresh r_s (the smallest
    multiple of ``memory_every`` ≥ s + W). Its score is ``log2 ‖v_s − v̂_s‖`` (rounded like
    ``value_norm``), v̂_s the feature part's answer to the query k_s over the keys folded before
    r_s: every eligible key s' ≤ r_s − E − W that is not in the memory chosen at r_s − E (a
    weighted mean of their values with weights φ_k(k_s)·φ_k(k_s'), key-side features — 0 when
    there are none). Computed
    here from scratch with explicit sums, refresh by refresh, the memory re-chosen by
    :func:`memory_membership`'s rule; the fast path (:func:`hf_rfa.ops.memory.feature_error`)
    keeps the state incrementally. ks ``[B, Hkv, Nk, D]`` keys scaled by √scale, v ``[B, Hkv, Nk, Dv]``.
    Keys that are not eligible or have no refresh before Nk score −inf."""

    b, hkv, nk, _ = ks.shape
    dev, e = ks.device, memory_every
    km = key_mask_bool(attention_mask, b, nk, dev)
    eligible = torch.ones(b, nk, dtype=torch.bool, device=dev) if km is None else km.clone()
    if sinks > 0:
        eligible &= ~sink_mask(km, b, nk, sinks, dev)
    eligible = eligible.view(b, 1, nk).expand(b, hkv, nk)
    pos = torch.arange(nk, device=dev)
    first = -(-(pos + window) // e) * e  # r_s
    with torch.no_grad():
        fk = feature_map.forward_keys(ks.detach())
        lk = fk.log_scale if fk.log_scale is not None else torch.zeros(fk.phi.shape[:-1], dtype=ks.dtype, device=dev)
        if feature_map.has_gate:  # a folded key's weight relative to the others: exp(−G_s') (1 − g_s')
            logg, log1mg = feature_map.log_gate(ks.detach())
            if km is not None:
                logg = logg * km.view(b, 1, nk)
            lk = lk + log1mg - torch.cumsum(logg, dim=-1)
        dot = (fk.phi.double() @ fk.phi.double().transpose(-1, -2)) * torch.exp(lk.double() - lk.double().amax(-1, keepdim=True)).unsqueeze(-2)  # [B,Hkv,Nk(query key),Nk]
        vd = v.detach().double()
        score = torch.full((b, hkv, nk), float("-inf"), dtype=torch.float32, device=dev)
        for r in range(0, nk, e):  # the refreshes some query uses
            new = eligible & (first == r).view(1, 1, nk)
            if not new.any():
                continue
            prev = r - e
            cand_prev = eligible & (pos <= prev - window).view(1, 1, nk)
            if prev >= 0 and cand_prev.any():
                folded = cand_prev & ~_top(cand_prev, score, memory)
            else:
                folded = torch.zeros_like(eligible)
            w = dot * folded.unsqueeze(-2)  # [B,Hkv,Nk,Nk]: row s, column s'
            num, den = w @ vd, w.sum(-1)
            pred = torch.where((den > 0).unsqueeze(-1), num / den.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(num))
            err = round_log2(torch.linalg.vector_norm(vd - pred, dim=-1))
            score = torch.where(new, err, score)
    return score


def query_mass_scores(qs: torch.Tensor, ks: torch.Tensor, attention_mask: torch.Tensor | None, window: int, sinks: int) -> torch.Tensor:
    """The ``memory_score="query_mass"`` score of every key, by its definition: ``[B, Hkv, Nk]``.

    Each query t's softmax over its exact keys (the window ``t − W < s ≤ t`` and the sinks, real
    keys only), the probabilities it gives the keys of its window summed over the real queries
    and over the query heads of each kv head, then ``log2`` rounded like ``value_norm``
    (:func:`hf_rfa.ops.memory.scores.round_log2`). qs ``[B, H, Nq, D]`` / ks ``[B, Hkv, Nk, D]``
    scaled by √scale; with Nq < Nk the missing first queries are zeros (as the op pads them).
    The fast path (:func:`hf_rfa.ops.memory.scores.window_mass`) sums block by block from the
    exact part's row sums and carries the sums of buffered keys across calls."""
    b, h, nq, d = qs.shape
    hkv, nk = ks.shape[1], ks.shape[2]
    g = h // hkv
    qd = torch.cat([qs.new_zeros(b, h, nk - nq, d), qs], dim=2).double()
    t, s = _positions(nk, nk, qs.device)
    km = key_mask_bool(attention_mask, b, nk, qs.device)
    real = torch.ones(b, nk, dtype=torch.bool, device=qs.device) if km is None else km
    in_window = (s <= t) & (s > t - window)
    exact = in_window.view(1, 1, nk, nk)
    if sinks > 0:
        exact = exact | sink_mask(km, b, nk, sinks, qs.device).view(b, 1, 1, nk)
    exact = exact & (s <= t).view(1, 1, nk, nk) & real.view(b, 1, 1, nk)
    scores = qd @ _expand_kv(ks.double(), g).transpose(-1, -2)  # [B,H,Nk,Nk]
    p = torch.softmax(scores.masked_fill(~exact, float("-inf")), dim=-1).nan_to_num(0.0)  # rows without exact keys: 0
    p = p * (in_window.view(1, 1, nk, nk) & real.view(b, 1, nk, 1))
    mass = p.sum(-2).view(b, hkv, g, nk).sum(2)
    return round_log2(mass)
