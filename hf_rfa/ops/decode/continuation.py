"""Incremental causal random feature attention: a constant-size state continued by new tokens.

:func:`continue_attention` takes a :class:`DecodeState` (the past, summarised) and ``n ≥ 1`` new
tokens and returns their attention output and the new state. It computes exactly what
``random_feature_attention(causal=True)`` computes for those rows over the whole sequence (up
to float rounding), with the same hybrid split:

- keys older than the exact window go through the feature map and live only in the linear state
  ``S = Σ φ(k) vᵀ``, ``z = Σ φ(k)`` (``recurrent.LinearState``; gated maps decay it);
- the last ``W`` keys/values (the exact window) are kept as they are, with their padding flags;
- the first ``S`` real tokens (attention sinks) are kept with their positions.

The new tokens and the kept window form one short *local block*. Its keys that leave the window
in this call are folded into the state: one key by ``recurrent.fold`` + ``read`` (a decoding
step), many by ``fused.causal_feature_attention`` continued from the state (a long prompt's
prefill or a multi-token chunk), so each query reads exactly the keys older than its window. The
exact part (window band + sinks) is computed for the new queries in chunks. Memory is
``O(F·Dv + (W + S)·D)`` per kv head whatever the context length.

Feature inputs (``feature_q``/``feature_k``, e.g. q/k before the rotary embedding): the state
either keeps the window's feature keys (``win_kf``) or keeps nothing more and derives them from the
kept keys in every call (``feature_key_fn``; the caller knows the positions, the op does not).

Gated RFA: a kept window key stores its accumulated log decay ``win_decay`` (the sum of the log
gates since it arrived), so it enters the state with the same weight ``Π g`` the full form gives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from ..backends import honoured, resolve
from ..feature.fused import ScanRun, causal_feature_attention
from ..masks import MAX_CHUNK, MAX_SINKS, NEG, check_feature_inputs, check_feature_map, check_int, check_scale, guard_continuation, needs_grad, no_autocast, to_output_dtype, validate_qkv
from ..partial import Partial, finalize, merge
from ..recurrent import LinearState, fold, read
from .state import DecodeState, exact_part, join_sinks

logger = logging.getLogger(__package__)  # "hf_rfa.ops.decode"


def _check_continuation(state, q, k, v, feature_map, attention_mask, settings: tuple) -> tuple[int, int, int, int, int, int]:
    """Every argument of :func:`continue_attention` checked against the others and the state
    (ValueError naming it, before any computation; ``settings = (window, sinks, scale,
    chunk_size)``); returns ``(B, H, n, D, Hkv, Dv)``."""
    window, sinks, scale, chunk_size = settings
    if not isinstance(state, DecodeState):
        raise ValueError(f"state must be a DecodeState (DecodeState.empty before the first token), got {type(state).__name__}")
    b, h, n, d, hkv, nk = validate_qkv(q, k, v, causal=True)
    if nk != n:
        raise ValueError(f"k and v must hold the n={n} new tokens of q, got {nk}")
    check_feature_map(feature_map, d)
    window, sinks = check_int("window", window), check_int("sinks", sinks, 0, MAX_SINKS)
    check_int("chunk_size", chunk_size, 1, MAX_CHUNK)
    check_scale(scale)
    if getattr(feature_map, "null", False) and window == 0 and sinks == 0:
        raise ValueError("feature_map='none' needs window > 0 or sinks > 0 (otherwise no key is attended)")
    dv = v.shape[-1]
    sb, shkv, fdim, sdv = state.linear.S.shape
    if (sb, shkv) != (b, hkv):
        raise ValueError(f"state has batch {sb} and {shkv} kv heads; q has batch {b}, k has {hkv} kv heads")
    if state.win_k.shape[-1] != d or sdv != dv:
        raise ValueError(f"state holds head dim D={state.win_k.shape[-1]} and value dim Dv={sdv}; k has D={d}, v has Dv={dv}")
    if fdim != feature_map.feature_dim:
        raise ValueError(f"state holds feature_dim={fdim} but the feature map has feature_dim={feature_map.feature_dim}")
    if state.sink_k.shape[2] != sinks:
        raise ValueError(f"state keeps {state.sink_k.shape[2]} sinks but sinks={sinks}")
    if state.win_k.shape[2] > window:
        raise ValueError(f"state keeps a window of {state.win_k.shape[2]} keys but window={window} (it must not shrink between calls)")
    if state.linear.S.device != q.device:
        raise ValueError(f"state is on {state.linear.S.device} but q is on {q.device}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, n)):
        raise ValueError(f"attention_mask must be [B, n] = [{b}, {n}] for the new tokens, got {tuple(getattr(attention_mask, 'shape', ()))}")
    return b, h, n, d, hkv, dv



def _feature_part(feature_map, linear: LinearState, blk: "_Block", gates: tuple, e: int, chunk_size: int, backends: tuple):
    """The feature part of the ``n`` new queries (the block's feature queries ``blk.xq_f [B, H, n,
    D]``) when the ``e`` oldest local keys (``blk.xk_f [B, Hkv, L, D]``, local 0..e-1) leave the
    window in this call: early queries (the window still filling) read the state; a single
    decoding step folds the evicted key and reads; a prefill / multi-token chunk runs the
    chunkwise-parallel scan continued from the state. ``gates = (cl, log1mg, win_decay)`` (Nones
    ungated); ``backends = (resolved or "auto", grad, requested)``. Returns ``(Partial, new linear
    state)``."""
    xq, xk, vv, feat, g = blk.xq_f, blk.xk_f, blk.vv, blk.feat, blk.h // blk.hkv
    cl, log1mg, win_decay = gates
    be, grad, backend = backends
    b, hkv, n, d = xq.shape[0], xk.shape[1], xq.shape[2], xq.shape[3]
    early = n - e  # > 0 only while the window is filling (the state is still empty)
    nq_feat = n if e == 1 else early
    qf = lq = None
    if nq_feat > 0:
        fq = feature_map.forward_queries(xq[:, :, :nq_feat])
        qf = fq.phi.reshape(b, hkv, g, nq_feat, -1)
        lq = fq.log_scale.reshape(b, hkv, g, nq_feat) if fq.log_scale is not None else None
        if cl is not None:
            lq = (lq if lq is not None else 0.0) + cl[:, :, None, :nq_feat]
    lk_add = log1mg[..., :e] + win_decay[..., :e] if cl is not None else None
    fe = feat[:, None, :e]
    feats = [read(linear, qf[:, :, :, :early], lq[..., :early] if lq is not None else None)] if early > 0 else []
    if e == 1:  # one decoding step: fold the evicted key, then read
        fk = feature_map.forward_keys(xk[:, :, :e])
        kf, lk = fk.phi, fk.log_scale
        if lk_add is not None:
            lk = (lk if lk is not None else 0.0) + lk_add
        kf = kf * fe.unsqueeze(-1)
        if lk is not None:
            lk = torch.where(fe, lk, torch.full_like(lk, NEG))
        linear = fold(linear, kf, lk, vv[:, :, :1])
        feats.append(read(linear, qf[:, :, :, early:], lq[..., early:] if lq is not None else None))
    else:  # prefill / multi-token chunk: chunkwise-parallel form, continued from the state
        lq_add = cl[:, :, None, early:].expand(b, hkv, g, e) if cl is not None else None
        be = resolve(be, grad=grad, causal=True, device=xq.device, dtype=xq.dtype)
        if not torch.compiler.is_compiling():  # dynamo cannot trace logging calls
            logger.debug("continue_attention: feature scan of %d key(s) by backend %s (requested %s)", e, be, backend)
        part, linear = causal_feature_attention(
            feature_map, xq[:, :, early:], xk[:, :, :e], vv[:, :, :e], (feat[:, :e], lq_add, lk_add), ScanRun(chunk_size, backend=be), state=linear,
        )
        feats.append(part)
    part = Partial(
        torch.cat([p.num for p in feats], dim=-2),
        torch.cat([p.den for p in feats], dim=-1),
        torch.cat([p.log_scale for p in feats], dim=-1),
    )
    return part, linear



@dataclass(frozen=True)
class DecodeCall:
    """The settings of :func:`continue_attention` (as in ``random_feature_attention``): the exact
    window W, the sinks S, the logit ``scale`` (None: ``D ** -0.5``), the chunk length and the
    requested backend. Checked by the call (ValueError naming the field)."""

    window: int = 0
    sinks: int = 0
    scale: float | None = None
    chunk_size: int = 64
    backend: str = "auto"


@no_autocast
def continue_attention(
    state: DecodeState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map,
    attention_mask: torch.Tensor | None = None,
    settings: DecodeCall | None = None,
    features: tuple = (None, None, None),
) -> tuple[torch.Tensor, DecodeState]:
    """Causal attention of ``n`` new tokens given the summarised past.

    Args:
        state: the past (:meth:`DecodeState.empty` before the first token).
        q: ``[B, H, n, D]`` new queries; k ``[B, Hkv, n, D]``, v ``[B, Hkv, n, Dv]`` new keys/values.
        feature_map: the layer's :class:`~hf_rfa.feature_maps.FeatureMap`.
        attention_mask: ``[B, n]`` padding mask of the new tokens (1/True = real) or None.
        settings: the layer's :class:`DecodeCall` (None: its defaults) — window, sinks, scale,
            chunk_size as in ``random_feature_attention``, and backend as there (the same rule and
            refusals, :func:`hf_rfa.ops.backends.resolve`; logged at DEBUG): it runs the feature
            scan of a prefill / multi-token chunk; a single decoding step is the recurrent form.
        features: ``(feature_q, feature_k, feature_key_fn)``, each or all None:
        feature_q, feature_k: the feature part's inputs for the new tokens (shapes of q, k), as in
            ``random_feature_attention``; the state must then keep them for its window
            (``DecodeState.empty(..., feature_keys=True)``), and every call must give them.
        feature_key_fn: instead of ``feature_k`` and a kept copy of it: a function mapping the raw
            keys of the *local block* — the ``Wc`` kept keys (``state.win_k``) followed by the ``n``
            new ones, ``[B, Hkv, Wc + n, D]`` in the state's key dtype, local index ``i`` at
            absolute position ``state.seen - Wc + i`` — to the feature part's keys of those
            positions (same shape), e.g. undoing the rotary embedding with the rotations of
            those ``Wc + n`` positions, which the caller closes over. The op stays
            position-agnostic and the state keeps nothing more than without feature inputs
            (``DecodeState.empty(..., feature_keys=False)``); ``feature_q`` (the new queries'
            feature inputs) is required with it and ``feature_k`` must be None. It must give
            the same result for a position in every call (a key's feature key is derived again
            while it is kept).
    Returns:
        ``(out [B, H, n, Dv], new_state)``; out has q's dtype.

    Robustness, as for ``random_feature_attention``: every argument is checked against the others
    and the state before any computation (ValueError naming it); B = 0 or n = 0 give an empty
    result; padded keys change nothing; a non-finite query makes its own row NaN and a non-finite
    real key/value every row of its head from that position on, in this call and every later one
    (:func:`~hf_rfa.ops.masks.guard_continuation`: the state itself stays finite); a float16
    output is clamped to float16's range.
    """
    settings = DecodeCall() if settings is None else settings
    if not isinstance(settings, DecodeCall):
        raise ValueError(f"settings must be a DecodeCall (window, sinks, scale, chunk_size, backend) or None, got {type(settings).__name__}")
    with honoured(settings.backend):  # (another backend asked: no compiled kernel even where enabled)
        return _continue(state, (q, k, v), feature_map, attention_mask, settings, features)


def _continue(state: DecodeState, qkv: tuple, feature_map, attention_mask, settings: DecodeCall, features: tuple) -> tuple[torch.Tensor, DecodeState]:
    """:func:`continue_attention` (its arguments, ``qkv = (q, k, v)``)."""
    q, k, v = qkv
    window, sinks, scale, chunk_size, backend = settings.window, settings.sinks, settings.scale, settings.chunk_size, settings.backend
    feature_q, feature_k, feature_key_fn = features
    b, h, n, d, hkv, dv = _check_continuation(state, q, k, v, feature_map, attention_mask, (window, sinks, scale, chunk_size))
    feature_q, feature_k = _check_feature_inputs(state, q, k, feature_q, feature_k, feature_key_fn)
    if b == 0 or n == 0:  # nothing to attend: the state only counts the positions
        return q.new_zeros(b, h, n, dv), replace(state, seen=state.seen + n)
    scale = d**-0.5 if scale is None else float(scale)
    km = torch.ones(b, n, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask.to(q.device).bool()
    q, k, v, poison, nonfinite = guard_continuation(q, k, v, km, state.nonfinite)
    blk = _local_block(state, (q, k, v), km, (feature_q, feature_k, feature_key_fn), (poison, nonfinite), sinks, scale**0.5)
    params = tuple(feature_map.parameters()) if isinstance(feature_map, torch.nn.Module) else ()
    grad = needs_grad(q, k, v, *state.tensors().values(), *params)
    # a named backend is checked (and refused) here, as by the prefill op; "auto" is resolved
    # only where a feature scan runs (a decoding step is the recurrent form: no kernel to choose)
    be = resolve(backend, grad=grad, causal=True, device=q.device, dtype=blk.ct) if backend != "auto" else backend
    out, linear, win_decay = _attend(state, blk, feature_map, window, sinks, chunk_size, (be, grad, backend))
    if blk.poison is not None:
        out = out.masked_fill(blk.poison[..., None], float("nan"))
    return to_output_dtype(out, q.dtype), _next_state(state, blk, linear, win_decay, window, feature_key_fn is not None)


@dataclass
class _Block:
    """The local block of a call: the kept window followed by the ``n`` new tokens (local index i
    at absolute position ``pos0 + i``), scaled for the scores, with the sinks after the new tokens
    joined and the rows to poison."""

    b: int
    h: int
    n: int
    hkv: int
    wc: int
    pos0: int
    ct: torch.dtype
    km: torch.Tensor  # [B, n] bool
    lk_raw: torch.Tensor  # [B, Hkv, L, D] keys (state dtype)
    lv_raw: torch.Tensor  # [B, Hkv, L, Dv]
    lkf_raw: torch.Tensor | None  # [B, Hkv, L, D] the feature part's keys, or None
    real: torch.Tensor  # [B, L] bool
    feat: torch.Tensor  # [B, L] bool: real, not a sink
    sink: tuple  # (sink_k, sink_v, sink_pos, sink_exists)
    xq: torch.Tensor  # [B, H, n, D] queries · √scale (compute dtype)
    xk: torch.Tensor  # [B, Hkv, L, D] keys · √scale
    vv: torch.Tensor  # [B, Hkv, L, Dv] values (compute dtype)
    xq_f: torch.Tensor  # the feature part's queries · √scale
    xk_f: torch.Tensor  # the feature part's keys · √scale
    root: float
    poison: torch.Tensor | None  # [B, H, n] rows made NaN
    nonfinite: torch.Tensor  # [B, Hkv] the head saw a non-finite key/value


def _check_feature_inputs(state: DecodeState, q, k, feature_q, feature_k, feature_key_fn) -> tuple:
    """``(feature_q, feature_k)`` of :func:`continue_attention` checked against each other, the
    state and ``feature_key_fn`` (ValueError naming the argument)."""
    if feature_key_fn is not None:
        if not callable(feature_key_fn):
            raise ValueError(f"feature_key_fn must be a callable [B, Hkv, L, D] -> [B, Hkv, L, D] or None, got {type(feature_key_fn).__name__}")
        if feature_k is not None:
            raise ValueError("feature_k must be None with feature_key_fn (the feature keys are derived from the local block's keys by feature_key_fn)")
        if feature_q is None:
            raise ValueError("feature_key_fn needs feature_q (the new queries' feature inputs, shape of q)")
        if state.win_kf is not None:
            raise ValueError("feature_key_fn: the state keeps feature keys (win_kf); build it with DecodeState.empty(feature_keys=False)")
        feature_q, _ = check_feature_inputs(q, k, feature_q, k)
        return feature_q, None
    feature_q, feature_k = check_feature_inputs(q, k, feature_q, feature_k)
    if (feature_k is None) != (state.win_kf is None):
        raise ValueError(
            "feature_q/feature_k must be given exactly when the state keeps feature keys "
            f"(DecodeState.empty(feature_keys=True)); state keeps them: {state.win_kf is not None}, given: {feature_k is not None}"
            + ("; or pass feature_key_fn= (the third of features) with a state without them" if feature_k is None else "")
        )
    return feature_q, feature_k


def _local_feature_keys(state: DecodeState, lk_raw, feature_k, feature_key_fn):
    """The local block's feature keys ``[B, Hkv, L, D]`` (from ``feature_key_fn`` or the kept
    ``win_kf`` + ``feature_k``), or None when the feature part reads the keys themselves."""
    if feature_key_fn is not None:
        lkf_raw = feature_key_fn(lk_raw)
        if not isinstance(lkf_raw, torch.Tensor) or lkf_raw.shape != lk_raw.shape or not lkf_raw.is_floating_point() or lkf_raw.device != lk_raw.device:
            raise ValueError(
                f"feature_key_fn must return a floating tensor of the local block's shape {tuple(lk_raw.shape)} on {lk_raw.device}, "
                f"got {getattr(lkf_raw, 'dtype', type(lkf_raw).__name__)} {tuple(getattr(lkf_raw, 'shape', ()))}"
            )
        return lkf_raw
    if feature_k is not None:
        return torch.cat([state.win_kf, feature_k.to(state.win_kf.dtype)], dim=2)
    return None


def _guard_feature_inputs(feature_q, lkf_raw, km, wc: int, h: int, poison, nonfinite):
    """Non-finite feature inputs zeroed (padding too), their rows poisoned like a bad q/k: returns
    ``(feature_q, lkf_raw, poison, nonfinite)``. Derived keys are derived again in every call, so
    every position of the block is checked (a kept bad one was counted when it arrived and is only
    zeroed again)."""
    bad_q, bad_any = ~torch.isfinite(feature_q).all(-1), ~torch.isfinite(lkf_raw).all(-1)  # [B,H,n], [B,Hkv,L]
    if bool(bad_q.any()) or bool(bad_any.any()):
        hkv = lkf_raw.shape[1]
        bad_k = bad_any[..., wc:] & km[:, None, :]
        feature_q = torch.where(bad_q[..., None], torch.zeros_like(feature_q), feature_q)
        lkf_raw = torch.where(bad_any[..., None], torch.zeros_like(lkf_raw), lkf_raw)
        seen_bad = (torch.cumsum(bad_k.long(), -1) > 0) | nonfinite[..., None]
        rows = bad_q | seen_bad.repeat_interleave(h // hkv, 1)
        poison = rows if poison is None else poison | rows
        nonfinite = nonfinite | bad_k.any(-1)
    return feature_q, lkf_raw, poison, nonfinite


def _local_block(state: DecodeState, qkv: tuple, km, features: tuple, guards: tuple, sinks: int, root: float) -> _Block:
    """The call's :class:`_Block` from guarded, finite ``qkv = (q, k, v)``, the checked ``features
    = (feature_q, feature_k, feature_key_fn)`` and ``guards = (poison, nonfinite)``."""
    q, k, v = qkv
    feature_q, feature_k, feature_key_fn = features
    poison, nonfinite = guards
    b, h, n, _ = q.shape
    hkv = k.shape[1]
    ct = state.linear.S.dtype
    p0, wc = state.seen, state.win_k.shape[2]
    lk_raw = torch.cat([state.win_k, k.to(state.win_k.dtype)], dim=2)  # [B,Hkv,L,D]
    lkf_raw = _local_feature_keys(state, lk_raw, feature_k, feature_key_fn)
    if feature_q is not None:
        feature_q, lkf_raw, poison, nonfinite = _guard_feature_inputs(feature_q, lkf_raw, km, wc, h, poison, nonfinite)
    sink_k, sink_v, sink_pos, sink_exists, new_sink = join_sinks(state, k, v, km, sinks, p0)
    lv_raw = torch.cat([state.win_v, v.to(state.win_v.dtype)], dim=2)
    real = torch.cat([state.win_real, km], dim=1)  # [B,L]
    feat = torch.cat([state.win_feat, km & ~new_sink], dim=1)
    xq = q.to(ct) * root
    xk = lk_raw.to(ct) * root
    vv = lv_raw.to(ct)
    if lkf_raw is None:
        xq_f, xk_f = xq, xk
    else:
        xq_f, xk_f = feature_q.to(ct) * root, lkf_raw.to(ct) * root
    return _Block(b, h, n, hkv, wc, p0 - wc, ct, km, lk_raw, lv_raw, lkf_raw, real, feat, (sink_k, sink_v, sink_pos, sink_exists),
                  xq, xk, vv, xq_f, xk_f, root, poison, nonfinite)


def _attend(state: DecodeState, blk: _Block, feature_map, window: int, sinks: int, chunk_size: int, backends: tuple) -> tuple:
    """The new queries' output ``[B, H, n, Dv]`` (compute dtype), the new linear state and the kept
    keys' log decays ``[B, Hkv, L]``; ``backends``: ``(resolved or "auto", grad, requested)``."""
    b, hkv, n, ct, dev = blk.b, blk.hkv, blk.n, blk.ct, blk.xq.device
    g = blk.h // hkv
    sink_k, sink_v, sink_pos, sink_exists = blk.sink
    parts: list[Partial] = []
    if window > 0 or sinks > 0:
        xs = sink_k.to(ct) * blk.root if sinks > 0 else None
        sink_terms = (xs, sink_v.to(ct), sink_pos, sink_exists) if sinks > 0 else None
        parts.append(exact_part(blk.xq.reshape(b, hkv, g, n, -1), blk.xk, blk.vv, blk.real, (blk.wc, blk.pos0), window, sink_terms, chunk_size))
    linear = state.linear
    win_decay = torch.cat([state.win_decay, torch.zeros(b, hkv, n, dtype=ct, device=dev)], dim=2)
    cl = log1mg_all = None
    if feature_map.has_gate:  # log decay since the last processed token [B,Hkv,n]; padding never decays
        logg, log1mg_all = feature_map.log_gate(blk.xk_f)  # [B,Hkv,L]
        cl = torch.cumsum(logg[..., blk.wc :] * blk.km[:, None, :], dim=-1)
        # origin: just before the new tokens; kept keys carry the decay they have had so far
        win_decay = torch.cat([state.win_decay, -cl], dim=-1)
    # keys leaving the window in this call (local 0..e-1); new query m sees those up to m + e - n
    e = max(0, blk.wc + n - window) if not getattr(feature_map, "null", False) else 0  # 'none': evicted keys are dropped
    if e > 0:
        part, linear = _feature_part(feature_map, linear, blk, (cl, log1mg_all, win_decay), e, chunk_size, backends)
        parts.append(part)
    if cl is not None:  # re-express state and kept keys relative to the last token
        cl_total = cl[..., -1]
        win_decay = win_decay + cl_total.unsqueeze(-1)
        linear = LinearState(linear.S, linear.z, linear.ref + cl_total, linear.log_gate_sum + cl_total)
    total = parts[0]
    for p in parts[1:]:
        total = merge(total, p)
    return finalize(total, feature_map.eps).reshape(b, blk.h, n, -1), linear, win_decay


def _next_state(state: DecodeState, blk: _Block, linear: LinearState, win_decay, window: int, derive: bool) -> DecodeState:
    """The state after the call: the last ``min(W, L)`` local keys kept, the new sinks and counts."""
    big_l = blk.wc + blk.n
    keep = min(window, big_l)
    sink_k, sink_v, sink_pos, sink_exists = blk.sink
    return DecodeState(
        linear=linear,
        win_k=blk.lk_raw[:, :, big_l - keep:],
        win_v=blk.lv_raw[:, :, big_l - keep:],
        win_real=blk.real[:, big_l - keep:],
        win_feat=blk.feat[:, big_l - keep:],
        win_decay=win_decay[..., big_l - keep:],
        sink_k=sink_k,
        sink_v=sink_v,
        sink_pos=sink_pos,
        sink_exists=sink_exists,
        real_count=state.real_count + blk.km.long().sum(-1),
        nonfinite=blk.nonfinite,
        seen=state.seen + blk.n,
        win_kf=blk.lkf_raw[:, :, big_l - keep:] if blk.lkf_raw is not None and not derive else None,
    )


__all__ = ["DecodeCall", "DecodeState", "continue_attention"]
