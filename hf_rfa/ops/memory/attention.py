"""A bounded exact global memory for causal attention (``RFAConfig.memory``).

Besides the exact window (the last W keys) and the sinks (the first S real tokens), each kv head
keeps at most ``memory`` = M older keys *exactly*: they get ``exp(q·k·scale)`` weights under the
same normaliser, and the feature part (or, with ``feature_map="none"``, nothing) answers only
the keys outside window, sinks and memory.

Definition (its brute-force twin is :func:`hf_rfa.ops.reference.memory_membership`): the memory
is re-chosen at every position r that is a multiple of E = ``memory_every``, *before* query r is
answered, and queries ``r … r+E−1`` use it. It is the M keys with the largest ``‖v‖`` (compared
at a resolution of 0.07 %, :func:`value_norm`; ties: the older key) among the real, non-sink keys ``s ≤ r − W`` — those older than the window of query
r (which is ``(r − W, r]``; with W = 0 every key ``s ≤ r``). Keys in the memory are exact; keys
that left the window but are not in the memory are feature keys.

Incremental form (this module), with no subtraction from the feature state: the candidates at r
are the previous memory plus the keys ``r − E − W < s ≤ r − W`` (a top-M of a union is the top-M
of the old top-M and the new keys), so

- a key that leaves the window between refreshes (``r − W < s ≤ t − W`` for query t of the period
  starting at r) is a *pending* feature key until the next refresh (queries read
  pending keys directly: a causal ``[C, ≤E]`` product per query chunk, like the intra-chunk part
  of the chunkwise form);
- at the refresh it either enters the memory or is folded into the linear feature state ``S, z``
  for good (a key that is not chosen at its first refresh never will be); a memory key that is
  displaced is folded at that refresh (it never comes back).

So the feature state only ever *adds* keys (``recurrent.fold``): each query's feature part is
exactly the sum over its non-memory keys, without cancellation. One implementation,
:func:`run_sequential`, serves both prefill (:func:`memory_attention`, called by
``random_feature_attention(memory=M)``) and cached decoding (:func:`continue_memory_attention`,
used by ``RFACache``): a call processes its queries period by period (refresh boundaries) and
within a period in chunks of ``chunk_size`` queries.

State bound per (batch row, kv head): M memory keys/values (+ position, norm, flag), at most
``W + E`` buffered keys/values (the window and the pending keys), S sinks and the ``F × Dv``
feature state — independent of the context length (:meth:`MemoryState.nbytes`).

Scores (``memory_score``, :data:`MEMORY_SCORES`, :mod:`hf_rfa.ops.memory.scores`): ``"value_norm"`` (above, the default) or
``"feature_error"`` — the error with which the feature state recalls the key's value when the key
is the query, measured once, against the state at the key's first refresh (before that refresh's
keys are folded; :func:`feature_error`), as LoLA (arXiv 2505.23666) caches the keys the linear
state represents worst — or ``"query_mass"`` — the attention the key received from the queries of
its exact window (the softmax over window and sinks, summed over those queries and the query heads
of its kv head; :func:`hf_rfa.ops.memory.scores.window_mass`; the state carries the buffered keys'
partial sums, ``MemoryState.buf_mass``), complete when the key leaves the window. A key's score never changes after its first refresh, so "a key not chosen
at its first refresh never will be" holds for every score (twin: ``reference.memory_membership``).

Gated maps and decays (``RFAConfig(decay=H)``, RFA's gate): a feature key s weighs
``exp(G_t − G_s) (1 − g_s)`` for query t, G the cumulative log gate, as in the op without memory.
The state is kept *anchored* at the position before the buffer's first key: a key folded at a
refresh enters with its weight as of the anchor (``G_anchor − G_s + log(1 − g_s)``, computed from
the buffer's cumulative gate; memory keys carry theirs, ``MemoryState.mem_lg``), a query adds
the decay from the anchor to itself, pending keys get both, and at the end of a call the state and
the memory's weights move to the new anchor (:func:`recurrent.decay`). Exact keys (window, sinks,
memory) are never decayed.

Scope: causal only; refresh positions are absolute positions (padding
included), like the window, so a left-padded row refreshes at other token counts than the same
row unpadded. The selection is a non-differentiable choice of indices; gradients flow through
q, k, v of the chosen keys. Runs plain PyTorch (autograd and inference alike) whatever the
backend; ``checkpoint_blocks`` does not apply. Calls of more than one period (prefill, long chunks)
run the period-parallel form :func:`hf_rfa.ops.memory.periods.run_periods` (choose sequentially,
answer every period's queries batched; under autograd it recomputes each block of periods in
backward); decoding steps run :func:`run_sequential`, its twin.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..masks import MAX_CHUNK, MAX_SINKS, check_feature_inputs, check_feature_map, check_int, check_scale, guard_continuation, no_autocast, to_output_dtype, validate_qkv
from . import periods
from .scores import MEMORY_SCORES, feature_error, value_norm
from .sequential import run_sequential
from .state import MAX_MEMORY, MemoryCall, MemoryState, check_far, check_memory_args


def _dispatch(state: MemoryState, q, k, v, km, feature_map, settings: MemoryCall, features: tuple) -> tuple[torch.Tensor, MemoryState]:
    """:func:`run_sequential`'s arguments → its result, by the period-parallel form
    (:func:`hf_rfa.ops.memory.periods.run_periods`) for calls of more than one period's tokens
    and by the sequential form for shorter ones (decoding steps)."""
    if q.shape[2] > settings.memory_every:
        return periods.run_periods(state, q, k, v, km, feature_map, settings, features)
    return run_sequential(state, q, k, v, km, feature_map, settings, features)


def memory_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map,
    key_mask: torch.Tensor | None,
    call,
    feature_q: torch.Tensor | None = None,
    feature_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal hybrid attention with an exact memory over a whole sequence (the prefill form;
    ``random_feature_attention(memory=M)`` calls it on checked, finite inputs). ``call``: the
    :class:`~hf_rfa.ops.spec.CallPlan` — window, sinks, scale, and its spec's memory, memory_every,
    memory_score (how the memory ranks its candidates, :data:`MEMORY_SCORES`) and chunk size;
    ``call.native_band``: the exact window/sink part runs the compiled CPU kernel, as the op without
    memory does. ``feature_q``/``feature_k``: what the feature part reads, shapes of q/k, e.g.
    un-rotated.

    q ``[B, H, Nq, D]`` (the last Nq of the Nk positions), k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk,
    Dv]``, key_mask ``[B, Nk]`` bool or None → ``[B, H, Nq, Dv]`` in q's dtype.
    """
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    if nq < nk:  # queries are the last Nq positions
        q = torch.cat([q.new_zeros(b, h, nk - nq, d), q], dim=2)
        if feature_q is not None:
            feature_q = torch.cat([feature_q.new_zeros(b, h, nk - nq, d), feature_q], dim=2)
    km = torch.ones(b, nk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    spec = call.spec
    settings = MemoryCall(call.window, call.sinks, spec.memory, spec.memory_every, call.scale, spec.chunk_size, call.native_band, spec.memory_score, spec.memory_distance, call.memory_rope)
    state = MemoryState.empty((b, hkv, d, dv, feature_map.feature_dim), call.sinks, spec.memory, k.dtype, q.device, ct, feature_keys=feature_k is not None)
    out, _ = _dispatch(state, q, k, v, km, feature_map, settings, (feature_q, feature_k))
    return to_output_dtype(out[:, :, nk - nq :], q.dtype)


def _check(state, q, k, v, feature_map, attention_mask, settings: MemoryCall, features: tuple):
    """Arguments of :func:`continue_memory_attention` (its settings as one :class:`MemoryCall`,
    ``features = (feature_q, feature_k, key_fn)``) against each other and the state (ValueError
    naming the argument); returns ``(B, H, n, D, Hkv, Dv)``."""
    window, sinks, memory, memory_every, scale = settings.window, settings.sinks, settings.memory, settings.memory_every, settings.scale
    chunk_size, memory_score = settings.chunk_size, settings.memory_score
    feature_q, feature_k, key_fn = features
    check_far(settings.distance, settings.far_rope, q.shape[-1], feature_k is not None)
    if not isinstance(state, MemoryState):
        raise ValueError(f"state must be a MemoryState (MemoryState.empty before the first token), got {type(state).__name__}")
    b, h, n, d, hkv, nk = validate_qkv(q, k, v, causal=True)
    if nk != n:
        raise ValueError(f"k and v must hold the n={n} new tokens of q, got {nk}")
    check_feature_map(feature_map, d)
    check_int("window", window)
    check_int("sinks", sinks, 0, MAX_SINKS)
    check_int("chunk_size", chunk_size, 1, MAX_CHUNK)
    check_memory_args(memory, memory_every, True, feature_map, memory_score)
    check_scale(scale)
    if memory < 1:
        raise ValueError(f"memory must be >= 1 for a MemoryState (memory=0: ops.decode.continue_attention), got {memory}")
    if getattr(feature_map, "null", False) and window == 0 and sinks == 0:
        raise ValueError("feature_map='none' needs window > 0 or sinks > 0 (otherwise no key is attended)")
    sb, shkv, fdim, sdv = state.base.linear.S.shape
    if (sb, shkv) != (b, hkv):
        raise ValueError(f"state has batch {sb} and {shkv} kv heads; q has batch {b}, k has {hkv} kv heads")
    if state.base.win_k.shape[-1] != d or sdv != v.shape[-1]:
        raise ValueError(f"state holds head dim D={state.base.win_k.shape[-1]} and value dim Dv={sdv}; k has D={d}, v has Dv={v.shape[-1]}")
    if fdim != feature_map.feature_dim:
        raise ValueError(f"state holds feature_dim={fdim} but the feature map has feature_dim={feature_map.feature_dim}")
    if state.base.sink_k.shape[2] != sinks:
        raise ValueError(f"state keeps {state.base.sink_k.shape[2]} sinks but sinks={sinks}")
    if state.memory != memory:
        raise ValueError(f"state keeps memory={state.memory} slots but memory={memory}")
    check_feature_inputs(q, k, feature_q, feature_k)
    if key_fn is not None:
        if not callable(key_fn):
            raise ValueError(f"key_fn must be a callable (keys [B, Hkv, L, D], positions) -> [B, Hkv, L, D] or None, got {type(key_fn).__name__}")
        if feature_k is None:
            raise ValueError("key_fn derives the kept keys' feature inputs; the new tokens' feature_q and feature_k must be given with it")
        if state.mem_kf is not None or state.base.win_kf is not None:
            raise ValueError("key_fn: the state keeps feature keys (mem_kf); build it with MemoryState.empty(feature_keys=False)")
    elif (feature_k is None) != (state.mem_kf is None):
        raise ValueError(
            "feature_q/feature_k must be given exactly when the state keeps feature keys "
            f"(MemoryState.empty(feature_keys=True)); state keeps them: {state.mem_kf is not None}, given: {feature_k is not None}"
        )
    if state.base.linear.S.device != q.device:
        raise ValueError(f"state is on {state.base.linear.S.device} but q is on {q.device}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, n)):
        raise ValueError(f"attention_mask must be [B, n] = [{b}, {n}] for the new tokens, got {tuple(getattr(attention_mask, 'shape', ()))}")
    return b, h, n, d, hkv, v.shape[-1]


@no_autocast
def continue_memory_attention(
    state: MemoryState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map,
    attention_mask: torch.Tensor | None = None,
    settings: MemoryCall | None = None,
    features: tuple = (None, None),
) -> tuple[torch.Tensor, MemoryState]:
    """Causal attention of ``n`` new tokens with an exact memory, given the summarised past —
    :func:`hf_rfa.ops.decode.continue_attention` for ``memory > 0`` (the same robustness: checks
    before any computation, padded keys change nothing, non-finite inputs poison the rows softmax
    would).

    q ``[B, H, n, D]``, k ``[B, Hkv, n, D]``, v ``[B, Hkv, n, Dv]``, attention_mask ``[B, n]`` →
    ``(out [B, H, n, Dv]`` in q's dtype, new state). ``settings``: the layer's window, sinks,
    memory, memory_every, memory_score, chunk size and the logit scale (None: ``D ** -0.5``) as one
    :class:`~hf_rfa.ops.memory.state.MemoryCall` (None: its defaults; ``native_band`` is a
    prefill's and ignored here). Any split of a sequence into calls gives the outputs of one
    :func:`memory_attention` over it (up to float rounding). ``features = (feature_q,
    feature_k)`` (shapes of q/k): the feature part's inputs, given at every call exactly when the
    state was built with ``feature_keys=True``. Or ``(feature_q, feature_k, key_fn)`` with a state
    built with ``feature_keys=False``: the state keeps no copy of its keys' feature inputs, and
    ``key_fn(keys, positions)`` derives them from the kept keys where a call reads them
    (:func:`derive_feature_keys`) — the same outputs and states as the kept copies when ``key_fn``
    returns what ``feature_k`` was for those positions.
    """
    if settings is not None and not isinstance(settings, MemoryCall):
        raise ValueError(f"settings must be a MemoryCall (window, sinks, memory, memory_every, scale, chunk_size, memory_score) or None, got {type(settings).__name__}")
    settings = replace(MemoryCall() if settings is None else settings, native_band=False)
    if not isinstance(features, (tuple, list)) or len(features) not in (2, 3):
        raise ValueError(f"features must be (feature_q, feature_k) or (feature_q, feature_k, key_fn), got {type(features).__name__} of length {len(features) if isinstance(features, (tuple, list)) else '-'}")
    scale, (feature_q, feature_k, key_fn) = settings.scale, (*features, None)[:3]
    b, h, n, d, hkv, dv = _check(state, q, k, v, feature_map, attention_mask, settings, (feature_q, feature_k, key_fn))
    if b == 0 or n == 0:
        return q.new_zeros(b, h, n, dv), replace(state, base=replace(state.base, seen=state.seen + n))
    if key_fn is not None:  # the kept keys' feature inputs for this call only; the new state keeps none
        state = derive_feature_keys(state, key_fn, settings, n)
    settings = replace(settings, scale=d**-0.5 if scale is None else float(scale))
    km = torch.ones(b, n, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask.to(q.device).bool()
    q, k, v, poison, nonfinite = guard_continuation(q, k, v, km, state.base.nonfinite)
    if feature_q is not None:  # un-rotated q/k are non-finite where q/k are (poisoned above): kept out of the state
        feature_q, feature_k = (torch.where(torch.isfinite(x), x, torch.zeros_like(x)) for x in (feature_q, feature_k))
    out, new = _dispatch(state, q, k, v, km, feature_map, settings, (feature_q, feature_k))
    new = replace(new, base=replace(new.base, nonfinite=nonfinite))
    if key_fn is not None:  # the derived feature inputs are not kept
        new = replace(new, mem_kf=None, base=replace(new.base, win_kf=None))
    if poison is not None:
        out = out.masked_fill(poison[..., None], float("nan"))
    return to_output_dtype(out, q.dtype), new


def reads_memory_features(state: MemoryState, settings: MemoryCall, n: int) -> bool:
    """Whether a call of ``n`` new tokens reads the feature inputs of the memory's keys: it
    refreshes the memory (a displaced key is folded), runs the period-parallel form, or reads keys
    beyond ``settings.distance``. Otherwise only the buffer's are read."""
    p0, lb, e = state.seen, state.base.win_k.shape[2], settings.memory_every
    start = max(p0, settings.window + p0 - lb)  # a refresh at a > W + pos0 - 1 has a candidate
    refresh = -(-start // e) * e < p0 + n
    far = settings.distance > 0 and p0 + n - 1 > settings.distance
    return refresh or far or n > e


def derive_feature_keys(state: MemoryState, key_fn, settings: MemoryCall | None = None, n: int = 0) -> MemoryState:
    """``state`` (built with ``feature_keys=False``) with the feature inputs of its buffer
    (``win_kf``, positions ``[seen − Lb, seen)`` as a 1-D tensor) and of its memory (``mem_kf``,
    positions ``mem_pos`` ``[B, Hkv, M]``) derived by ``key_fn(keys, positions)``, in the keys'
    dtype as kept copies are: a state that keeps them (``settings`` None), or for one call of ``n``
    tokens, which gets the memory's only when it reads them (:func:`reads_memory_features`;
    otherwise the memory's keys in their place: carried through the call, never read)."""
    base = state.base
    lb = base.win_k.shape[2]
    pos = torch.arange(state.seen - lb, state.seen, device=base.win_k.device)
    win_kf = _derived(key_fn, base.win_k, pos)
    reads = settings is None or reads_memory_features(state, settings, n)
    mem_kf = _derived(key_fn, state.mem_k, state.mem_pos) if reads else state.mem_k
    return replace(state, mem_kf=mem_kf, base=replace(base, win_kf=win_kf))


def _derived(key_fn, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = key_fn(keys, positions)
    if not isinstance(out, torch.Tensor) or out.shape != keys.shape or not out.is_floating_point():
        raise ValueError(f"key_fn must return a floating tensor of the kept keys' shape {tuple(keys.shape)}, got {tuple(getattr(out, 'shape', ()))}")
    return out.to(keys.dtype)


__all__ = ["MAX_MEMORY", "derive_feature_keys", "reads_memory_features", "MEMORY_SCORES", "MemoryCall", "MemoryState", "feature_error", "check_memory_args", "continue_memory_attention", "memory_attention", "value_norm"]
