"""``random_feature_attention``: the public entry point over the ops in this package, and
:func:`attend`, the same on one :class:`~hf_rfa.ops.spec.AttentionSpec` (what a converted layer calls).

Shapes: q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` → ``[B, H, Nq, Dv]``.
Features, states and sums are float32 (float64 inputs stay float64, for gradcheck); the output
has q's dtype.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .backends import gpu, honoured, native, resolve
from .band.exact import exact_local, exact_local_last
from .band.plan import Band
from .feature.bidirectional import bidirectional_feature_attention, whole_features
from .feature.fused import ScanRun, causal_feature_attention, fold_keys
from .feature.linear import bidirectional_window_parts, shift_keys
from .hybrid.function import HybridArgs, hybrid_attention
from .masks import NEG, check_feature_inputs, check_feature_map, check_scale, exp_floor, guard_feature_inputs, guard_inputs, key_mask_bool, needs_grad, no_autocast, saturate_grad, sink_mask, sink_positions, to_output_dtype, validate_qkv
from .memory import memory_attention
from .memory.state import check_far
from .partial import Partial, finalize, last_rows, merge
from .recurrent import LinearState
from .rotary import check_rope, unrotate
from .spec import AttentionSpec, CallPlan

if TYPE_CHECKING:  # type only: ops import nothing from feature_maps at run time
    from ..feature_maps.base import FeatureMap

logger = logging.getLogger(__name__)


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
    memory_distance: int = 0,
    memory_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
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
            block) and recompute each block in backward (:mod:`hf_rfa.ops.feature.recompute`, :mod:`hf_rfa.ops.band.recompute`):
            activation memory O(N·D) instead of O(N·(m + W)); ~one extra forward of compute.
            A causal hybrid (window and/or sinks with the feature part) runs as one Function
            that keeps q, k, v (and feature_q/feature_k when given) once and recomputes band,
            scan and merge per block (:mod:`hf_rfa.ops.hybrid.function`). False: the autograd
            forms (everything saved).
        backend: ``"auto"`` or a name in :data:`hf_rfa.ops.backends.BACKENDS` (``"torch"``,
            ``"inference"``, ``"compiled"``, ``"native"``, and on GPUs ``"flex"``, ``"fla"``:
            :mod:`hf_rfa.ops.backends.gpu`); the rule and the refusals are
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
        memory_distance, memory_rope: (memory, un-rotated feature inputs) a memory key more than Δ = ``memory_distance`` positions back scores as if Δ back (``memory_rope``: ``(cos, sin)`` ``[Dr]`` of position Δ). 0: off.

    The keywords from ``window`` to ``memory_score`` are one :class:`~hf_rfa.ops.spec.AttentionSpec`,
    built and validated here (:func:`attend` takes one built once). Exact and feature weights share one normaliser. Gated maps (RFA ``gate=True``) decay the
    feature state in causal mode; the gate is ignored in bidirectional mode.

    Robustness: every argument is checked before any kernel runs (ValueError naming it); zero
    B, N or Dv give an empty (or, with no keys, zero) result; padded keys change nothing, and a
    non-finite query/key/value makes NaN exactly the rows softmax would make NaN (see
    :func:`~hf_rfa.ops.masks.guard_inputs`); a float16 output is clamped to float16's range.
    """
    validate_qkv(q, k, v, causal)  # the tensors first, then the settings
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    spec = AttentionSpec(window=window, sinks=sinks, chunk_size=chunk_size, checkpoint_blocks=checkpoint_blocks, backend=backend, memory=memory, memory_every=memory_every, memory_score=memory_score, memory_distance=memory_distance)
    return attend(q, k, v, feature_map, spec, causal=causal, attention_mask=attention_mask, scale=scale, feature_q=feature_q, feature_k=feature_k, feature_rope=feature_rope, memory_rope=memory_rope)


@no_autocast
def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    spec: AttentionSpec,
    *,
    causal: bool = True,
    attention_mask: torch.Tensor | None = None,
    scale: float | None = None,
    feature_q: torch.Tensor | None = None,
    feature_k: torch.Tensor | None = None,
    feature_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    memory_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`random_feature_attention` with the layer's settings as one validated
    :class:`~hf_rfa.ops.spec.AttentionSpec` (``spec.feature_input`` is the caller's: it passes
    ``feature_rope`` or the feature inputs); the other arguments, the result and the checks as
    there."""
    b, h, nq, d, hkv, nk = validate_qkv(q, k, v, causal)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if not isinstance(spec, AttentionSpec):
        raise ValueError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    check_feature_map(feature_map, d)
    scale = check_scale(scale)
    spec.check_call(causal, feature_map, nq, nk)
    feature_q, feature_k, feature_rope = _check_feature_args(q, k, spec, feature_q, feature_k, feature_rope)
    km = key_mask_bool(attention_mask, b, nk, q.device)
    # float16 gradients: a true gradient beyond 65504 (an ill-conditioned normaliser) saturates, not inf
    q, k, v, feature_q, feature_k = (saturate_grad(t) for t in (q, k, v, feature_q, feature_k))
    call = _plan(spec, q, k, v, feature_map, causal, d**-0.5 if scale is None else scale, (feature_q, feature_k) if feature_q is not None else ())
    if spec.memory > 0 and spec.memory_distance > 0:
        check_far(spec.memory_distance, memory_rope, d, feature_q is not None)
        call = replace(call, memory_rope=memory_rope)
    if b == 0 or nq == 0 or nk == 0 or v.shape[-1] == 0:  # nothing to attend: no kernel call
        return q.new_zeros(b, h, nq, v.shape[-1]) + q.flatten()[:0].sum()  # (still in the graph)
    q, k, v, poison = guard_inputs(q, k, v, km, causal)
    if feature_q is not None:  # a non-finite feature input is poisoned like its q/k (rows NaN below)
        feature_q, feature_k, poison = guard_feature_inputs(feature_q, feature_k, km, causal, poison)
    if call.backend in gpu.GPU_ORDER:  # FlexAttention band / fla scan (hf_rfa.ops.backends.gpu)
        grad = _grad(q, k, v, feature_map, feature_q, feature_k)
        out = gpu.attention(q, k, v, feature_map, km, call, grad=grad, features=(feature_q, feature_k, feature_rope))
    elif spec.memory > 0:  # exact memory: its own PyTorch form (hf_rfa.ops.memory)
        out = memory_attention(q, k, v, feature_map, km, call, feature_q, feature_k)
    else:
        with honoured(spec.backend):  # (another backend asked: no compiled kernel even where enabled)
            out = _attention(q, k, v, feature_map, km, call, (feature_q, feature_k, feature_rope))
    if poison is not None:
        out = out.masked_fill(poison[..., None], float("nan"))
    return out


def _check_feature_args(q, k, spec: AttentionSpec, feature_q, feature_k, feature_rope) -> tuple:
    """``(feature_q, feature_k, feature_rope)`` checked (ValueError); with a memory a rotary
    embedding to undo is undone once, up front (the memory's form reads feature_q/feature_k)."""
    feature_q, feature_k = check_feature_inputs(q, k, feature_q, feature_k)
    if feature_rope is not None:
        if feature_q is not None:
            raise ValueError("give either feature_q/feature_k or feature_rope, not both")
        feature_rope = check_rope(feature_rope, q, k)
        if spec.memory > 0:
            feature_q, feature_k = unrotate(q, *feature_rope), unrotate(k, *feature_rope)
            feature_rope = None
    return feature_q, feature_k, feature_rope


def _grad(q, k, v, feature_map, *extra) -> bool:
    """Whether the call records a graph: any input that may need a gradient (``extra``: the feature
    inputs, None where absent) or the feature map's parameters."""
    params = tuple(feature_map.parameters()) if isinstance(feature_map, torch.nn.Module) else ()
    return needs_grad(q, k, v, *(t for t in extra if t is not None), *params)


def _plan(spec: AttentionSpec, q, k, v, feature_map, causal: bool, scale: float, extra: tuple) -> CallPlan:
    """The call's :class:`~hf_rfa.ops.spec.CallPlan`: the backends by :func:`~hf_rfa.ops.backends.resolve`
    (the feature part's from every input that may need a gradient — ``extra``: the feature inputs —
    and the feature map's parameters; under ``"auto"`` the exact band's from q, k, v alone: it has no
    feature-map parameters), logged at DEBUG; window and sinks clipped to the Nk keys."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    grad = _grad(q, k, v, feature_map, *extra)
    be = resolve(spec.backend, grad=grad, causal=causal, device=q.device, dtype=ct, whole_call=True)
    be = gpu.settle(be, spec.backend, grad=grad, causal=causal, window=spec.window, sinks=spec.sinks, memory=spec.memory, nq=q.shape[2], nk=k.shape[2], feature_map=feature_map, device=q.device, dtype=ct)
    band_be = resolve("auto", grad=needs_grad(q, k, v), causal=causal, device=q.device, dtype=ct) if spec.backend == "auto" else be
    if not torch.compiler.is_compiling():  # dynamo cannot trace logging calls (fullgraph compile)
        logger.debug("random_feature_attention: backend %s (exact band: %s; requested %s)", be, band_be, spec.backend)
    nk = k.shape[2]
    if spec.window > nk or spec.sinks > nk:
        spec = spec.replace(window=min(spec.window, nk), sinks=min(spec.sinks, nk))
    return CallPlan(spec, causal, scale, be, band_be == "native", spec.backend == "auto")


def _attention(q, k, v, feature_map, km, call: CallPlan, inputs: tuple) -> torch.Tensor:
    """The computation of :func:`attend` on checked, guarded arguments: ``km [B, Nk]`` bool or
    None; ``call`` the :class:`~hf_rfa.ops.spec.CallPlan`; ``inputs = (feature_q, feature_k,
    feature_rope)``: the feature part's inputs (or None for q/k) and a rotary embedding ``(cos, sin)``
    to undo (Nq == Nk) — block by block where :func:`_hybrid_function_applies`, else up front.
    Returns ``[B, H, Nq, Dv]`` in q's dtype."""
    feature_q, feature_k, feature_rope = inputs
    b, h, nq, d = q.shape
    nk = k.shape[2]
    if call.causal and nq < nk:  # queries are the last Nq positions: align them with their keys
        q = torch.cat([q.new_zeros(b, h, nk - nq, d), q], dim=2)
        if feature_q is not None:
            feature_q = torch.cat([feature_q.new_zeros(b, h, nk - nq, d), feature_q], dim=2)
    hybrid = _hybrid_function_applies(q, k, v, feature_map, call, feature_q, feature_k)
    if feature_rope is not None and not hybrid:  # only the recomputing hybrid un-rotates block by block
        feature_q, feature_k, feature_rope = unrotate(q, *feature_rope), unrotate(k, *feature_rope), None
    if hybrid:
        n = q.shape[2]
        out = _hybrid_training(q, k, v, feature_map, km, call, (feature_q, feature_k, feature_rope))
        return to_output_dtype(out.reshape(b, h, n, -1)[:, :, n - nq :], q.dtype)
    return _blockwise(q, k, v, feature_map, km, call, (feature_q, feature_k), nq)


def _blockwise(q, k, v, feature_map, km, call: CallPlan, inputs: tuple, nq: int) -> torch.Tensor:
    """:func:`_attention` outside the recomputing hybrid: the exact part (C++ kernel or
    :func:`~hf_rfa.ops.band.exact.exact_local`) and the feature part — causal: features computed
    block by block inside :func:`~hf_rfa.ops.feature.fused.causal_feature_attention` (never for
    the whole sequence at once; with a window the *raw* keys and values are shifted by W first, D
    wide, not F); bidirectional: keys folded block by block in inference, else the autograd forms
    on whole-sequence features — merged under one normaliser. ``q`` aligned (``[B, H, N, D]``),
    ``inputs = (feature_q, feature_k)`` or Nones; returns the last ``nq`` rows in q's dtype."""
    feature_q, feature_k = inputs
    b, h, n, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = h // hkv
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    causal, window, sinks, root = call.causal, call.window, call.sinks, call.scale**0.5
    fq_in = q if feature_q is None else feature_q  # what the feature map reads
    fk_in = k if feature_k is None else feature_k
    # bidirectional without window in inference: keys folded block by block, no [N, F] features
    fused = causal or (window == 0 and call.backend != "torch")
    # exact part of a causal hybrid in inference: the compiled CPU kernel reads raw q/k/v
    native_band = call.native_band and call.exact and causal
    null = getattr(feature_map, "null", False)
    fused = fused or null  # window-only baseline: nothing but the exact part
    xq = xk = xq_f = xk_f = None
    if not fused or (call.exact and not native_band) or (causal and feature_map.has_gate):
        xq, xk = q.to(ct) * root, k.to(ct) * root
        xq_f, xk_f = (xq, xk) if feature_q is None else (fq_in.to(ct) * root, fk_in.to(ct) * root)
    vv = v.to(ct) if not fused or call.exact else v
    # keys answered by the feature map: real, not sinks (window handled by shifting below)
    feat_mask = km
    if sinks > 0:
        sm = sink_mask(km, b, nk, sinks, q.device)
        feat_mask = (km if km is not None else torch.ones_like(sm)) & ~sm
    whole = None  # bidirectional autograd forms: whole-sequence features, before the exact part (the graph's order)
    if not fused and window < n:
        whole = whole_features(feature_map, xq_f, xk_f, feat_mask)
    lq_add = lk_add = None
    if causal and feature_map.has_gate:
        lk_add, lq_add = _gate_terms(feature_map, xk_f, km)
    parts: list[Partial] = []
    if native_band:
        spos, sok = sink_positions(km, b, nk, sinks, q.device) if sinks > 0 else (None, None)
        num, den, ls = native.causal_band(q, k, v, call.scale, km, window, (spos, sok), native.KernelRun(call.spec.chunk_size, exp_floor(torch.float32)))
        parts.append(Partial(num.view(b, hkv, g, n, -1), den.view(b, hkv, g, n), ls.view(b, hkv, g, n)))
    elif call.exact:
        parts.append(_exact_band(xq.reshape(b, hkv, g, n, d), xk, vv, km, call, nq))
    fused_out = None
    if window < n and not null:
        if not fused:
            parts += bidirectional_window_parts(*whole, vv, window, call.spec.chunk_size)
        else:
            # alone (no exact part to merge with), the output is normalised straight into place
            fused_out = q.new_empty(b, hkv, g, nq if causal else n, v.shape[-1], dtype=ct) if not parts else None
            if causal:
                part = _causal_feature_part(feature_map, (fq_in, fk_in, vv), feat_mask, (lq_add, lk_add), call, nq, fused_out)
            else:
                part = bidirectional_feature_attention(feature_map, fq_in, fk_in, vv, feat_mask, x_scale=root, out=fused_out)
            if part is not None:
                parts.append(part)
    if fused_out is not None:
        return to_output_dtype(fused_out.reshape(b, h, -1, fused_out.shape[-1])[:, :, -nq:], q.dtype)
    parts = [last_rows(p, nq) for p in parts]  # (the causal feature part has only those)
    total = parts[0]
    for p in parts[1:]:
        total = merge(total, p)
    out = finalize(total, feature_map.eps)  # [B,Hkv,G,Nq,Dv]
    return to_output_dtype(out.reshape(b, h, nq, -1), q.dtype)


def _exact_band(xq, xk, vv, km, call: CallPlan, nq: int) -> Partial:
    """The exact window/sinks in PyTorch (``xq [B,Hkv,G,N,D]``, scaled): a causal call with fewer
    queries than keys computes only the last Nq rows, on the keys they see."""
    n = xq.shape[3]
    recompute = call.spec.checkpoint_blocks
    if call.causal and nq < n:
        return exact_local_last(xq, xk, vv, km, Band(call.window, call.sinks, True, call.spec.chunk_size), nq, recompute=recompute)
    return exact_local(xq, xk, vv, km, Band(call.window, call.sinks, call.causal, call.spec.chunk_size), recompute=recompute)


def _causal_feature_part(feature_map, inputs: tuple, feat_mask, gates: tuple, call: CallPlan, nq: int, out) -> Partial | None:
    """The causal feature part by :func:`~hf_rfa.ops.feature.fused.causal_feature_attention`:
    query t sees keys s <= t − W (keys, values, mask and key gate term shifted by W); with fewer
    queries than keys the keys they all see are folded at once (:func:`~hf_rfa.ops.feature.fused.fold_keys`).
    ``inputs = (fq_in, fk_in, vv)``: what the feature map reads and the values; ``gates =
    (lq_add, lk_add)`` or Nones; ``out``: where to normalise into (or None)."""
    fq_in, fk_in, vv = inputs
    lq_add, lk_add = gates
    window, root, n = call.window, call.scale**0.5, fk_in.shape[2]
    ks, vs, kmask, lka = fk_in, vv, feat_mask, lk_add
    if window > 0:  # feature part of a causal window: query t sees keys s <= t - W
        ks, vs, lka = shift_keys(fk_in, window, 0.0), shift_keys(vv, window, 0.0), (shift_keys(lk_add, window, 0.0) if lk_add is not None else None)
        real = feat_mask if feat_mask is not None else torch.ones(fk_in.shape[0], n, dtype=torch.bool, device=fk_in.device)
        kmask = shift_keys(real, window, False, dim=1)
    qs, lqs, state = fq_in, lq_add, None
    if nq < n:  # queries are the last Nq: the keys they all see are folded at once
        p0 = n - nq
        state = fold_keys(feature_map, ks[:, :, :p0], vs[:, :, :p0], kmask[:, :p0] if kmask is not None else None, lka[..., :p0] if lka is not None else None, x_scale=root)
        cut = lambda x, dim=2: x.narrow(dim, p0, nq) if x is not None else None  # noqa: E731
        qs, ks, vs, kmask, lqs, lka = cut(fq_in), cut(ks), cut(vs), cut(kmask, 1), cut(lq_add, -1), cut(lka, -1)
    run = ScanRun(call.spec.chunk_size, x_scale=root, checkpoint=call.spec.checkpoint_blocks, backend=call.backend)
    return causal_feature_attention(feature_map, qs, ks, vs, (kmask, lqs, lka), run, state=state, out=out)[0]


def _hybrid_function_applies(q, k, v, feature_map, call: CallPlan, feature_q=None, feature_k=None) -> bool:
    """Whether the call (its :class:`~hf_rfa.ops.spec.CallPlan`) is a causal hybrid in training
    with ``checkpoint_blocks``: it then runs as one recomputing
    :class:`~hf_rfa.ops.hybrid.function.HybridFunction` (q, k, v — and the feature inputs
    ``feature_q``/``feature_k`` when given — saved once)."""
    if not (call.causal and call.spec.checkpoint_blocks and call.exact) or call.backend != "torch":
        return False
    if call.native_band:  # the band's inputs need no gradient: its compiled kernel answers it
        return False
    params = tuple(feature_map.parameters()) if isinstance(feature_map, torch.nn.Module) else ()
    return needs_grad(q, k, v, feature_q, feature_k, *params)


def _hybrid_training(q, k, v, feature_map, km, call: CallPlan, inputs: tuple) -> torch.Tensor:
    """:func:`_attention` for a causal hybrid in training (:func:`_hybrid_function_applies`):
    ``[B,Hkv,G,N,Dv]`` in the compute dtype. ``inputs = (feature_q, feature_k, feature_rope)``:
    what the feature part reads, the gate terms included (as in :func:`_blockwise`), and
    ``(cos, sin)`` or None: the feature part reads q/k with it undone."""
    feature_q, feature_k, feature_rope = inputs
    window, sinks, scale = call.window, call.sinks, call.scale
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
    args = HybridArgs(km, feat_mask, lq_add, lk_add, feature_q, feature_k, feature_rope)
    return hybrid_attention(q, k, v, feature_map, call, args, feature)


def _gate_terms(feature_map, xk: torch.Tensor, km: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay terms of a gated map's causal feature part from scaled keys ``xk [B,Hkv,Nk,D]``:
    ``(key term [B,Hkv,Nk], query term [B,Hkv,1,Nk])`` = (log(1−g) − cumulative log g, cumulative
    log g); padded positions never decay."""
    logg, log1mg = feature_map.log_gate(xk)  # [B,Hkv,Nk]
    if km is not None:
        logg = logg * km[:, None, :]
    cum = torch.cumsum(logg, dim=-1)
    return log1mg - cum, cum[:, :, None, :]


__all__ = ["LinearState", "attend", "random_feature_attention"]
