"""``random_feature_attention``: the public entry point over the ops in this package.

Shapes: q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` → ``[B, H, Nq, Dv]``.
Features, states and sums are float32 (float64 inputs stay float64, for gradcheck); the output
has q's dtype.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .backends import honoured, native, resolve
from .feature.bidirectional import bidirectional_feature_attention
from .feature.fused import causal_feature_attention, fold_keys
from .band.exact import exact_local, exact_local_last
from .hybrid.function import hybrid_attention
from .feature.linear import bidirectional_linear, causal_linear, shift_keys
from .masks import MAX_CHUNK, MAX_SINKS, NEG, check_feature_inputs, check_feature_map, check_int, check_scale, exp_floor, guard_feature_inputs, guard_inputs, key_mask_bool, needs_grad, no_autocast, sink_mask, sink_positions, to_output_dtype, validate_qkv
from .memory import check_memory_args, memory_attention
from .partial import Partial, finalize, last_rows, merge
from .recurrent import LinearState
from .rotary import check_rope, unrotate

if TYPE_CHECKING:  # type only: ops import nothing from feature_maps at run time
    from ..feature_maps.base import FeatureMap

logger = logging.getLogger(__name__)


@no_autocast
def random_feature_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    window: int = 0,
    sinks: int = 0,
    scale: float | None = None,
    chunk_size: int = 64,
    checkpoint_blocks: bool = True,
    backend: str = "auto",
    memory: int = 0,
    memory_every: int = 64,
    memory_score: str = "value_norm",
    feature_q: torch.Tensor | None = None,
    feature_k: torch.Tensor | None = None,
    feature_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Linear-time attention with a feature map, optionally hybrid with exact local attention.

    Args:
        q: ``[B, H, Nq, D]`` queries.
        k: ``[B, Hkv, Nk, D]`` keys (H must be a multiple of Hkv: grouped-query attention).
        v: ``[B, Hkv, Nk, Dv]`` values.
        feature_map: a :class:`hf_rfa.feature_maps.FeatureMap` with ``head_dim == D``.
        causal: query i (the last Nq of the Nk positions) sees keys up to its own position.
        attention_mask: ``[B, Nk]`` padding mask (1/True = real token) or None.
        window: W exact-softmax keys — causal: the last W keys (incl. itself); bidirectional:
            keys at distance < W. ``window >= N`` gives exact softmax.
        sinks: the first S real (non-padded) tokens also get exact softmax weights.
        scale: logit scale, default ``D ** -0.5``.
        chunk_size: chunk length of the causal chunkwise-parallel form.
        checkpoint_blocks: training memory (default on): the causal feature scan and the exact
            band/sinks of a hybrid keep only their inputs (and the scan's state per 512-token
            block) and recompute each block in backward (:mod:`hf_rfa.ops.recompute`):
            activation memory O(N·D) instead of O(N·(m + W)); ~one extra forward of compute.
            A causal hybrid (window and/or sinks with the feature part) runs as one Function
            that keeps q, k, v (and feature_q/feature_k when given) once and recomputes band,
            scan and merge per block (:mod:`hf_rfa.ops.hybrid_recompute`). False: the autograd
            forms (everything saved).
        backend: ``"auto"`` or a name in :data:`hf_rfa.ops.backends.BACKENDS` (``"torch"``,
            ``"inference"``, ``"compiled"``, ``"native"``); the rule and the refusals are
            :func:`hf_rfa.ops.backends.resolve`'s. Logged at DEBUG level.
        memory, memory_every: causal only: at most ``memory`` older keys per kv head answered
            exactly, re-chosen at multiples of ``memory_every`` (:mod:`hf_rfa.ops.memory`, which
            runs its own PyTorch form whatever the backend). 0: off.
        memory_score: how the memory ranks candidate keys, ``"value_norm"`` (largest ‖v‖) or
            ``"feature_error"`` (worst recalled by the feature state, LoLA-style; not with
            ``feature_map="none"``) — :data:`hf_rfa.ops.memory.MEMORY_SCORES`.
        feature_q, feature_k: what the feature part reads instead of q and k (shapes of q and k),
            e.g. the queries/keys before the rotary embedding (``RFAConfig(feature_input=
            "unrotated")``): the exact window and sinks still score q·k; the feature part scores
            φ(feature_q)·φ(feature_k). Both or neither. None: q and k. With ``memory > 0`` the
            memory is exact on q·k and only its folded / pending keys read feature_k.
        feature_rope: ``(cos, sin)`` ``[B or 1, N, Dr]`` (Nq == Nk == N): the feature part reads q
            and k with this rotary embedding undone (:func:`hf_rfa.ops.rotary.unrotate`), i.e.
            ``feature_q = unrotate(q, cos, sin)`` and likewise for k — not with feature_q/feature_k. Same result as passing those; in training with
            ``checkpoint_blocks`` a causal hybrid un-rotates block by block in forward and
            backward and keeps nothing un-rotated (the memory of two more q/k per layer).

    Exact and feature weights share one normaliser. Gated maps (RFA ``gate=True``) decay the
    feature state in causal mode; the gate is ignored in bidirectional mode.

    Robustness: every argument is checked before any kernel runs (ValueError naming it); zero
    B, N or Dv give an empty (or, with no keys, zero) result; padded keys change nothing, and a
    non-finite query/key/value makes NaN exactly the rows softmax would make NaN (see
    :func:`~hf_rfa.ops.masks.guard_inputs`); a float16 output is clamped to float16's range.
    """
    b, h, nq, d, hkv, nk = validate_qkv(q, k, v, causal)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if not isinstance(checkpoint_blocks, bool):
        raise ValueError(f"checkpoint_blocks must be True or False, got {checkpoint_blocks!r}")
    check_feature_map(feature_map, d)
    window, sinks = check_int("window", window), check_int("sinks", sinks, 0, MAX_SINKS)
    check_int("chunk_size", chunk_size, 1, MAX_CHUNK)
    scale = check_scale(scale)
    memory, memory_every = check_memory_args(memory, memory_every, causal, feature_map, memory_score)
    if not causal and window > 0 and nq != nk:
        raise ValueError(f"a bidirectional window needs Nq == Nk, got Nq={nq}, Nk={nk}")
    null = getattr(feature_map, "null", False)
    if null and window == 0 and sinks == 0:
        raise ValueError("feature_map='none' needs window > 0 or sinks > 0 (otherwise no key is attended)")
    feature_q, feature_k = check_feature_inputs(q, k, feature_q, feature_k)
    if feature_rope is not None:
        if feature_q is not None:
            raise ValueError("give either feature_q/feature_k or feature_rope, not both")
        feature_rope = check_rope(feature_rope, q, k)
        if memory > 0:  # the memory's form un-rotates once, up front
            feature_q, feature_k = unrotate(q, *feature_rope), unrotate(k, *feature_rope)
            feature_rope = None
    km = key_mask_bool(attention_mask, b, nk, q.device)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    params = tuple(feature_map.parameters()) if isinstance(feature_map, torch.nn.Module) else ()
    extra = (feature_q, feature_k) if feature_q is not None else ()
    be = resolve(backend, grad=needs_grad(q, k, v, *extra, *params), causal=causal, device=q.device, dtype=ct)
    # the exact window/sink band has no feature-map parameters: under "auto" its own inputs decide
    band_be = resolve("auto", grad=needs_grad(q, k, v), causal=causal, device=q.device, dtype=ct) if backend == "auto" else be
    if not torch.compiler.is_compiling():  # dynamo cannot trace logging calls (fullgraph compile)
        logger.debug("random_feature_attention: backend %s (exact band: %s; requested %s)", be, band_be, backend)
    if b == 0 or nq == 0 or nk == 0 or v.shape[-1] == 0:  # nothing to attend: no kernel call
        return q.new_zeros(b, h, nq, v.shape[-1]) + q.flatten()[:0].sum()  # (still in the graph)
    q, k, v, poison = guard_inputs(q, k, v, km, causal)
    if feature_q is not None:  # a non-finite feature input is poisoned like its q/k (rows NaN below)
        feature_q, feature_k, poison = guard_feature_inputs(feature_q, feature_k, km, causal, poison)
    if memory > 0:  # exact memory: its own PyTorch form (hf_rfa.ops.memory)
        out = memory_attention(q, k, v, feature_map, km, min(window, nk), min(sinks, nk), memory, memory_every, d**-0.5 if scale is None else scale, chunk_size, band_be == "native", memory_score, feature_q, feature_k)
        return out.masked_fill(poison[..., None], float("nan")) if poison is not None else out
    with honoured(backend):  # (another backend asked: no compiled kernel even where enabled)
        out = _attention(q, k, v, feature_map, causal, km, min(window, nk), min(sinks, nk), d**-0.5 if scale is None else scale, chunk_size, checkpoint_blocks, be, band_be == "native", feature_q, feature_k, feature_rope, native_forward=backend == "auto")
    if poison is not None:
        out = out.masked_fill(poison[..., None], float("nan"))
    return out


def _attention(q, k, v, feature_map, causal: bool, km, window: int, sinks: int, scale: float, chunk_size: int, checkpoint_blocks: bool, be: str, native_band: bool, feature_q=None, feature_k=None, feature_rope=None, native_forward: bool = False) -> torch.Tensor:
    """The computation of :func:`random_feature_attention` on checked arguments once the backend
    is chosen (``km [B, Nk]`` bool or None; ``window``, ``sinks`` at most Nk; ``be``;
    ``native_band``: the exact part of a causal hybrid runs the C++ kernel; ``feature_q/k``: the
    feature part's inputs, or None for q/k; ``feature_rope``: ``(cos, sin)`` to undo (Nq == Nk):
    block by block where :func:`_hybrid_function_applies`, else up front; ``native_forward``: the
    recomputing hybrid's forward may answer its exact band with the C++ kernel, where usable);
    returns ``[B, H, Nq, Dv]`` in q's dtype."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    out_dtype = q.dtype
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = h // hkv

    if causal and nq < nk:  # queries are the last Nq positions: align them with their keys
        q = torch.cat([q.new_zeros(b, h, nk - nq, d), q], dim=2)
        if feature_q is not None:
            feature_q = torch.cat([feature_q.new_zeros(b, h, nk - nq, d), feature_q], dim=2)
    hybrid = _hybrid_function_applies(q, k, v, feature_map, causal, window, sinks, checkpoint_blocks, be, native_band, feature_q, feature_k)
    if feature_rope is not None and not hybrid:  # only the recomputing hybrid un-rotates block by block
        feature_q, feature_k, feature_rope = unrotate(q, *feature_rope), unrotate(k, *feature_rope), None
    fq_in = q if feature_q is None else feature_q  # what the feature map reads
    fk_in = k if feature_k is None else feature_k
    n = q.shape[2]
    root = scale**0.5
    if hybrid:
        out = _hybrid_training(q, k, v, feature_map, km, window, sinks, scale, chunk_size, feature_q, feature_k, feature_rope, native_forward)
        return to_output_dtype(out.reshape(b, h, n, -1)[:, :, n - nq :], out_dtype)
    # causal feature part: features are computed block by block inside causal_feature_attention
    # (which also converts and scales q, k, v block by block), never for the whole sequence at
    # once; with a window the *raw* keys and values are shifted by W first (D wide, not F)
    fused = causal
    # bidirectional without window in inference: keys folded block by block, no [N, F] features
    if not causal and window == 0:
        fused = be != "torch"
    # exact part of a causal hybrid in inference: the compiled CPU kernel reads raw q/k/v
    native_band = native_band and (window > 0 or sinks > 0) and causal
    null = getattr(feature_map, "null", False)
    if null:  # window-only baseline: nothing but the exact part
        fused = True
    if not fused or ((window > 0 or sinks > 0) and not native_band) or (causal and feature_map.has_gate):
        xq, xk = q.to(ct) * root, k.to(ct) * root
        xq_f, xk_f = (xq, xk) if feature_q is None else (fq_in.to(ct) * root, fk_in.to(ct) * root)
    vv = v.to(ct) if not fused or window > 0 or sinks > 0 else v
    qf = lq = kf = lk = lq_add = lk_add = None
    if not fused:
        fq = feature_map.forward_queries(xq_f)
        fk = feature_map.forward_keys(xk_f)
        qf = fq.phi.reshape(b, hkv, g, n, -1)
        lq = fq.log_scale.reshape(b, hkv, g, n) if fq.log_scale is not None else None
        kf, lk = fk.phi, fk.log_scale

    if causal and feature_map.has_gate:
        lk_add, lq_add = _gate_terms(feature_map, xk_f, km)
        if not fused:
            lk, lq = (lk if lk is not None else 0.0) + lk_add, (lq if lq is not None else 0.0) + lq_add
            lk_add = lq_add = None

    # keys answered by the feature map: real, not sinks (window handled by shifting below)
    feat_mask = km
    if sinks > 0:
        sm = sink_mask(km, b, nk, sinks, q.device)
        feat_mask = (km if km is not None else torch.ones_like(sm)) & ~sm
    if feat_mask is not None and not fused:
        kf = kf * feat_mask[:, None, :, None]
        if lk is not None:
            lk = torch.where(feat_mask[:, None, :], lk, torch.full_like(lk, NEG))

    parts: list[Partial] = []
    fused_out = None
    if native_band:
        spos, sok = sink_positions(km, b, nk, sinks, q.device) if sinks > 0 else (None, None)
        num, den, ls = native.causal_band(q, k, v, scale, km, window, spos, sok, chunk_size, exp_floor(torch.float32))
        parts.append(Partial(num.view(b, hkv, g, n, -1), den.view(b, hkv, g, n), ls.view(b, hkv, g, n)))
    elif window > 0 or sinks > 0:
        if causal and nq < n:  # only the last Nq rows, on the keys they see
            parts.append(exact_local_last(xq.reshape(b, hkv, g, n, d), xk, vv, km, window, sinks, nq, chunk_size, recompute=checkpoint_blocks))
        else:
            parts.append(exact_local(xq.reshape(b, hkv, g, n, d), xk, vv, km, window, sinks, causal, chunk_size, recompute=checkpoint_blocks))
    if window < n and not null:
        if fused:
            # alone (no exact part to merge with), the output is normalised straight into place
            fused_out = q.new_empty(b, hkv, g, nq if causal else n, v.shape[-1], dtype=ct) if not parts else None
            if causal:
                ks, vs, kmask, lka = fk_in, vv, feat_mask, lk_add
                if window > 0:  # feature part of a causal window: query t sees keys s <= t - W
                    ks, vs, lka = shift_keys(fk_in, window, 0.0), shift_keys(vv, window, 0.0), (shift_keys(lk_add, window, 0.0) if lk_add is not None else None)
                    real = feat_mask if feat_mask is not None else torch.ones(b, nk, dtype=torch.bool, device=q.device)
                    kmask = shift_keys(real, window, False, dim=1)
                qs, lqs, state = fq_in, lq_add, None
                if nq < n:  # queries are the last Nq: the keys they all see are folded at once
                    p0 = n - nq
                    state = fold_keys(feature_map, ks[:, :, :p0], vs[:, :, :p0], kmask[:, :p0] if kmask is not None else None, lka[..., :p0] if lka is not None else None, x_scale=root)
                    cut = lambda x, dim=2: x.narrow(dim, p0, nq) if x is not None else None  # noqa: E731
                    qs, ks, vs, kmask, lqs, lka = cut(fq_in), cut(ks), cut(vs), cut(kmask, 1), cut(lq_add, -1), cut(lka, -1)
                part = causal_feature_attention(feature_map, qs, ks, vs, kmask, lqs, lka, chunk_size, x_scale=root, out=fused_out, checkpoint=checkpoint_blocks, backend=be, state=state)[0]
            else:
                part = bidirectional_feature_attention(feature_map, fq_in, fk_in, vv, feat_mask, x_scale=root, out=fused_out)
            if part is not None:
                parts.append(part)
        else:
            parts += _bidirectional_feature_parts(qf, lq, kf, lk, vv, window, chunk_size)
    if fused_out is not None:
        return to_output_dtype(fused_out.reshape(b, h, -1, fused_out.shape[-1])[:, :, -nq:], out_dtype)
    parts = [last_rows(p, nq) for p in parts]  # (the causal feature part has only those)
    total = parts[0]
    for p in parts[1:]:
        total = merge(total, p)
    out = finalize(total, feature_map.eps)  # [B,Hkv,G,Nq,Dv]
    out = out.reshape(b, h, nq, -1)
    return to_output_dtype(out, out_dtype)


def _hybrid_function_applies(q, k, v, feature_map, causal: bool, window: int, sinks: int, checkpoint_blocks: bool, be: str, native_band: bool, feature_q=None, feature_k=None) -> bool:
    """Whether the call is a causal hybrid in training with ``checkpoint_blocks``: it then runs as
    one recomputing :class:`~hf_rfa.ops.hybrid_recompute.HybridFunction` (q, k, v — and the
    feature inputs ``feature_q``/``feature_k`` when given — saved once)."""
    if not (causal and checkpoint_blocks and (window > 0 or sinks > 0)) or be != "torch":
        return False
    if native_band:  # the band's inputs need no gradient: its compiled kernel answers it
        return False
    params = tuple(feature_map.parameters()) if isinstance(feature_map, torch.nn.Module) else ()
    return needs_grad(q, k, v, feature_q, feature_k, *params)


def _hybrid_training(q, k, v, feature_map, km, window: int, sinks: int, scale: float, chunk_size: int, feature_q=None, feature_k=None, feature_rope=None, native_forward: bool = False) -> torch.Tensor:
    """:func:`_attention` for a causal hybrid in training (:func:`_hybrid_function_applies`):
    ``[B,Hkv,G,N,Dv]`` in the compute dtype. ``feature_q``/``feature_k`` (or None): what the
    feature part reads, the gate terms included (as in :func:`_attention`); ``feature_rope``
    ``(cos, sin)`` or None: the feature part reads q/k with it undone."""
    b, n = q.shape[0], q.shape[2]
    feature = window < n and not getattr(feature_map, "null", False)
    feat_mask = lq_add = lk_add = None
    if feature:
        feat_mask = km if km is not None else torch.ones(b, n, dtype=torch.bool, device=q.device)
        if sinks > 0:
            feat_mask = feat_mask & ~sink_mask(km, b, n, sinks, q.device)
        if feature_map.has_gate:
            ct = torch.float64 if q.dtype == torch.float64 else torch.float32
            # un-rotated in the compute dtype: cos/sin stay as given (float32) and are saved once for
            # all layers, not as a per-layer copy in k's (autocast) dtype
            gk = unrotate(k.to(ct), *feature_rope) if feature_rope is not None else (k if feature_k is None else feature_k).to(ct)
            lk_add, lq_add = _gate_terms(feature_map, gk * scale**0.5, km)
    else:
        feature_q = feature_k = feature_rope = None
    return hybrid_attention(q, k, v, feature_map, km, feat_mask, window, sinks, scale, chunk_size, lq_add=lq_add, lk_add=lk_add, feature=feature, feature_q=feature_q, feature_k=feature_k, rope=feature_rope, native_band=native_forward)


def _gate_terms(feature_map, xk: torch.Tensor, km: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay terms of a gated map's causal feature part from scaled keys ``xk [B,Hkv,Nk,D]``:
    ``(key term [B,Hkv,Nk], query term [B,Hkv,1,Nk])`` = (log(1−g) − cumulative log g, cumulative
    log g); padded positions never decay."""
    logg, log1mg = feature_map.log_gate(xk)  # [B,Hkv,Nk]
    if km is not None:
        logg = logg * km[:, None, :]
    cum = torch.cumsum(logg, dim=-1)
    return log1mg - cum, cum[:, :, None, :]


def _bidirectional_feature_parts(qf, lq, kf, lk, vv, window: int, chunk_size: int) -> list[Partial]:
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


__all__ = ["random_feature_attention", "LinearState"]
