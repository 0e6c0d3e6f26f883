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
:func:`_run`, serves both prefill (:func:`memory_attention`, called by
``random_feature_attention(memory=M)``) and cached decoding (:func:`continue_memory_attention`,
used by ``RFACache``): a call processes its queries period by period (refresh boundaries) and
within a period in chunks of ``chunk_size`` queries.

State bound per (batch row, kv head): M memory keys/values (+ position, norm, flag), at most
``W + E`` buffered keys/values (the window and the pending keys), S sinks and the ``F × Dv``
feature state — independent of the context length (:meth:`MemoryState.nbytes`).

Scores (``memory_score``, :data:`MEMORY_SCORES`, :mod:`hf_rfa.ops.memory_scores`): ``"value_norm"`` (above, the default) or
``"feature_error"`` — the error with which the feature state recalls the key's value when the key
is the query, measured once, against the state at the key's first refresh (before that refresh's
keys are folded; :func:`feature_error`), as LoLA (arXiv 2505.23666) caches the keys the linear
state represents worst. A key's score never changes after its first refresh, so "a key not chosen
at its first refresh never will be" holds for both (twin: ``reference.memory_membership``).

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
run the period-parallel form :func:`hf_rfa.ops.memory_periods.run_periods` (choose sequentially,
answer every period's queries batched; under autograd it recomputes each block of periods in
backward); decoding steps run :func:`_run`, its twin.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..backends import native
from ..decode.continuation import DecodeState, _exact_part, _join_sinks
from ..band.exact import exact_local
from ..masks import MAX_CHUNK, MAX_SINKS, NEG, check_feature_inputs, check_feature_map, check_int, check_scale, exp_floor, guard_continuation, no_autocast, sink_positions, to_output_dtype, validate_qkv
from ..partial import Partial, finalize, merge
from .scores import MEMORY_SCORES, feature_error, recall_error, value_norm
from ..recurrent import LinearState, decay, fold, read

#: largest ``memory`` (keys per kv head)
MAX_MEMORY = 65536



def check_memory_args(memory, memory_every, causal: bool, feature_map, memory_score: str = "value_norm") -> tuple[int, int]:
    """``(memory, memory_every)`` checked with ``memory_score`` (ValueError naming the argument)."""
    memory = check_int("memory", memory, 0, MAX_MEMORY)
    memory_every = check_int("memory_every", memory_every, 1, MAX_CHUNK)
    if memory_score not in MEMORY_SCORES:
        raise ValueError(f"memory_score must be one of {list(MEMORY_SCORES)}, got {memory_score!r}")
    if memory > 0 and not causal:
        raise ValueError("memory > 0 needs causal attention: the exact memory is chosen over the past (use memory=0 for bidirectional layers)")
    if memory > 0 and memory_score == "feature_error" and getattr(feature_map, "null", False):
        raise ValueError("memory_score='feature_error' needs a feature state to score keys against; feature_map='none' has none (use memory_score='value_norm')")
    return memory, memory_every


@dataclass
class MemoryState:
    """The past of one causal layer with an exact memory (B rows, Hkv kv heads, M slots).

    base:     :class:`~hf_rfa.ops.decode.DecodeState` whose ``win_*`` hold the *buffer*: every key
              from the oldest pending one to the last (positions ``[seen − Lb, seen)``, Lb ≤ W + E);
              ``linear`` holds every folded key; sinks as there; ``win_decay`` is unused (empty).
    mem_k:    ``[B, Hkv, M, D]`` memory keys (input dtype); ``mem_v [B, Hkv, M, Dv]`` their values.
    mem_pos:  ``[B, Hkv, M]`` long, their positions; ``mem_norm [B, Hkv, M]`` their score
              (:func:`value_norm`).
    mem_ok:   ``[B, Hkv, M]`` bool, the slot holds a key.
    mem_lg:   ``[B, Hkv, M]`` gated / decaying maps: log of each memory key's feature weight as of
              the state's anchor (the position before the buffer's first key), i.e.
              ``G_anchor − G_s + log(1 − g_s)`` — what the key weighs if it is folded (zeros otherwise).
    mem_kf:   ``[B, Hkv, M, D]`` the memory keys as the feature part reads them (feature inputs,
              e.g. un-rotated; needed when a displaced memory key is folded), or None (the feature
              part reads the keys themselves); the base then keeps ``win_kf`` for the buffer.
    """

    base: DecodeState
    mem_k: torch.Tensor
    mem_v: torch.Tensor
    mem_pos: torch.Tensor
    mem_norm: torch.Tensor
    mem_ok: torch.Tensor
    mem_lg: torch.Tensor | None = None
    mem_kf: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        head_dim: int,
        value_dim: int,
        feature_dim: int,
        sinks: int,
        memory: int,
        dtype: torch.dtype,
        device=None,
        compute_dtype: torch.dtype = torch.float32,
        feature_keys: bool = False,
    ) -> "MemoryState":
        """State before the first token (``memory`` empty slots). ``feature_keys``: the calls
        give ``feature_q``/``feature_k`` (the feature part's own inputs), kept for the buffer and
        the memory."""
        b, h, m = batch, kv_heads, memory
        base = DecodeState.empty(b, h, head_dim, value_dim, feature_dim, sinks, dtype, device, compute_dtype, feature_keys=feature_keys)
        return cls(
            base=base,
            mem_k=torch.zeros(b, h, m, head_dim, dtype=dtype, device=device),
            mem_v=torch.zeros(b, h, m, value_dim, dtype=dtype, device=device),
            mem_pos=torch.zeros(b, h, m, dtype=torch.long, device=device),
            mem_norm=torch.zeros(b, h, m, dtype=compute_dtype, device=device),
            mem_ok=torch.zeros(b, h, m, dtype=torch.bool, device=device),
            mem_lg=torch.zeros(b, h, m, dtype=compute_dtype, device=device),
            mem_kf=torch.zeros(b, h, m, head_dim, dtype=dtype, device=device) if feature_keys else None,
        )

    @property
    def seen(self) -> int:
        return self.base.seen

    @property
    def memory(self) -> int:
        return self.mem_k.shape[2]

    def _own(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "base" and getattr(self, f.name) is not None}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state by name (the base's under their own names)."""
        return {**self.base.tensors(), **self._own()}

    def map_batch(self, fn) -> "MemoryState":
        """Apply ``fn`` to the batch axis (dim 0) of every tensor: reorder, select, repeat."""
        return MemoryState(base=self.base.map_batch(fn), **{k: fn(t) for k, t in self._own().items()})

    def memory_nbytes(self) -> int:
        """Bytes of the memory slots alone (keys, values, positions, norms, flags)."""
        return sum(t.numel() * t.element_size() for t in self._own().values())

    def nbytes(self) -> int:
        """Bytes held by the state, memory included (bounded independently of the context)."""
        return self.base.nbytes() + self.memory_nbytes()


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x ``[B, Hkv, K, ·]`` or ``[B, Hkv, K]`` at idx ``[B, Hkv, M]`` along K."""
    if x.dim() == 3:
        return torch.gather(x, 2, idx)
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def _select(mem: dict[str, torch.Tensor], cand: dict[str, torch.Tensor], memory: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
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
    new = {name: _gather(x, top) for name, x in both.items()}
    chosen = torch.zeros_like(ok).scatter_(2, top, new["ok"])
    return new, ok & ~chosen


def _weights(scores_or_logs: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exp(x − r) with masked entries 0, r)`` for logs ``x [..., K]`` and mask ``ok`` (r: the
    row max over ``ok``, detached; NEG where none)."""
    x = torch.where(ok, scores_or_logs, torch.full_like(scores_or_logs, NEG))
    r = x.amax(-1).detach()
    w = torch.exp((x - r.unsqueeze(-1)).clamp(exp_floor(x.dtype), 0.0)).masked_fill(~ok, 0.0)
    return w, r


def _exact_terms(xq: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax terms ``(num, den, row max)`` of queries ``xq [..., R, D]`` over keys ``[..., K, D]``
    (values ``[..., K, Dv]``) where ``ok [..., 1 | R, K]`` (:func:`_weights`'s weights). Without
    autograd the weights are formed in place in the scores (no [R, K] temporaries; the masks are
    skipped when every key is valid) — the same values."""
    scores = xq @ keys.transpose(-1, -2)
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


def _memory_part(xq: torch.Tensor, mk: torch.Tensor, mv: torch.Tensor, ok: torch.Tensor) -> Partial:
    """Exact softmax terms of the memory: xq ``[B, Hkv, G, C, D]``, mk ``[B, Hkv, M, D]`` (both
    scaled by √scale), mv ``[B, Hkv, M, Dv]``, ok ``[B, Hkv, M]``."""
    b, hkv, g, c, d = xq.shape
    num, den, r = _exact_terms(xq.reshape(b, hkv, g * c, d), mk, mv, ok[:, :, None, :])  # G·C rows: no broadcast copies
    return Partial(num.view(b, hkv, g, c, -1), den.view(b, hkv, g, c), r.view(b, hkv, g, c))


def _pending_part(qf: torch.Tensor, lq: torch.Tensor | None, kf: torch.Tensor, lk: torch.Tensor | None, vk: torch.Tensor, vis: torch.Tensor) -> Partial:
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


def _features(feature_map, x: torch.Tensor, queries: bool, hkv: int):
    """``(phi, log_scale)`` of scaled queries ``[B, H, C, D]`` (grouped ``[B, Hkv, G, C, F]``) or
    keys ``[B, Hkv, P, D]``."""
    f = feature_map.forward_queries(x) if queries else feature_map.forward_keys(x)
    if not queries:
        return f.phi, f.log_scale
    b, h, c = f.phi.shape[:3]
    return f.phi.reshape(b, hkv, h // hkv, c, -1), (f.log_scale.reshape(b, hkv, h // hkv, c) if f.log_scale is not None else None)


@dataclass
class _Call:
    """What both forms of a call (:func:`_run`, :func:`hf_rfa.ops.memory_periods.run_periods`)
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
    norms: torch.Tensor | None  # [B,Hkv,L] value_norm scores (None: scored by feature_error)
    exact: Partial | None  # window band + sinks of the n queries


def _prepare(state: MemoryState, q, k, v, km, feature_map, window: int, sinks: int, scale: float, native_band: bool, memory_score: str, fq, fk, chunk_size: int) -> _Call:
    """The shared set-up of a call (see :func:`_run` for the arguments)."""
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

    sink_k, sink_v, sink_pos, sink_exists, new_sink = _join_sinks(base, k, v, km, sinks, p0)
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
    norms = None if memory_score == "feature_error" else value_norm(lv_raw).to(ct)  # [B,Hkv,L]
    xqg = xq.reshape(b, hkv, g, n, d)

    exact = None
    if window > 0 or sinks > 0:  # window band + sinks: independent of the memory
        if p0 == 0 and native_band:  # a prefill: the band of the op without memory (same terms)
            spos, sok = sink_positions(km, b, n, sinks, dev) if sinks > 0 else (None, None)
            num, den, ls = native.causal_band(q, k, v, scale, km, window, spos, sok, chunk_size, exp_floor(torch.float32))
            exact = Partial(num.view(b, hkv, g, n, -1), den.view(b, hkv, g, n), ls.view(b, hkv, g, n))
        elif p0 == 0:
            exact = exact_local(xqg, xk, vv, km, window, sinks, True, chunk_size)
        else:
            xs, vs = (sink_k.to(ct) * root, sink_v.to(ct)) if sinks > 0 else (None, None)
            exact = _exact_part(xqg, xk, vv, real, lb, pos0, window, xs, vs, sink_pos, sink_exists, chunk_size)
    return _Call(b, h, n, hkv, g, ct, root, p0, pos0, (sink_k, sink_v, sink_pos, sink_exists), lk_raw, lv_raw, lkf_raw, real, feat,
                 xqg, xk, vv, xqf, xkf, gated, cg, key_lg, norms, exact)


def _finish(state: MemoryState, c: _Call, total: Partial, linear: LinearState, mem: dict[str, torch.Tensor], lo: int, km: torch.Tensor, eps: float) -> tuple[torch.Tensor, MemoryState]:
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
    return out, MemoryState(new_base, mem["k"], mem["v"], mem["pos"], mem["norm"], mem["ok"], mem["lg"], mem.get("kf"))


def _run(state: MemoryState, q, k, v, km, feature_map, window: int, sinks: int, memory_every: int, scale: float, chunk_size: int, native_band: bool = False, memory_score: str = "value_norm", fq=None, fk=None) -> tuple[torch.Tensor, MemoryState]:
    """The ``n`` new tokens (q ``[B, H, n, D]``, k ``[B, Hkv, n, D]``, v, key mask ``km [B, n]``
    bool; finite) continuing ``state`` → ``(out [B, H, n, Dv]`` in the compute dtype, state), period
    by period and chunk by chunk (the sequential form; :func:`hf_rfa.ops.memory_periods.run_periods`
    batches the periods and is checked against it).
    ``native_band``: a prefill's window/sink part runs the compiled kernel (the op's rule);
    ``memory_score``: how candidates are ranked (:data:`MEMORY_SCORES`); ``fq``/``fk`` (shapes of
    q/k, or None): what the feature part reads (the state keeps them: ``MemoryState.mem_kf``)."""
    c = _prepare(state, q, k, v, km, feature_map, window, sinks, scale, native_band, memory_score, fq, fk, chunk_size)
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
            mem, out_mask = _select(mem, cand, memory)
            if not null:  # the keys not chosen enter the feature state for good
                kf, lkf = _features(feature_map, folded[fname].to(ct) * root, False, hkv)
                if c.gated:  # each key enters with its weight as of the anchor
                    lkf = folded["lg"] if lkf is None else lkf + folded["lg"]
                kf = kf * out_mask.unsqueeze(-1)
                if lkf is not None:
                    lkf = torch.where(out_mask, lkf, torch.full_like(lkf, NEG))
                linear = fold(linear, kf, lkf, folded["v"].to(ct))
            lo = hi
        mk, mv = mem["k"].to(ct) * root, mem["v"].to(ct)
        for c0 in range(a, end, chunk_size):
            c1 = min(end, c0 + chunk_size)
            qi = slice(c0 - p0, c1 - p0)
            part = _memory_part(c.xqg[:, :, :, qi], mk, mv, mem["ok"])
            if not null:
                qf, lq = _features(feature_map, c.xqf[:, :, qi], True, hkv)
                if c.gated:  # the decay from the anchor to each query
                    qg = c.cg[:, :, c0 - pos0 : c1 - pos0].unsqueeze(2).expand(b, hkv, g, c1 - c0)
                    lq = qg if lq is None else lq + qg
                part = merge(part, read(linear, qf, lq))
                top = c1 - window - pos0  # pending keys of this chunk: local [lo, top), s <= t − W
                if top > lo:
                    kf, lkf = _features(feature_map, c.xkf[:, :, lo:top], False, hkv)
                    if c.gated:
                        lkf = c.key_lg[:, :, lo:top] if lkf is None else lkf + c.key_lg[:, :, lo:top]
                    t = torch.arange(c0, c1, device=dev).view(-1, 1)
                    s = torch.arange(pos0 + lo, pos0 + top, device=dev).view(1, -1)
                    vis = (s <= t - window).unsqueeze(0) & c.feat[:, None, lo:top]  # [B,C,P]
                    part = merge(part, _pending_part(qf, lq, kf, lkf, c.vv[:, :, lo:top], vis[:, None]))
            parts.append(part)
        a = end
    total = Partial(torch.cat([p.num for p in parts], dim=-2), torch.cat([p.den for p in parts], dim=-1), torch.cat([p.log_scale for p in parts], dim=-1))
    return _finish(state, c, total, linear, mem, lo, km, feature_map.eps)


def _dispatch(state: MemoryState, q, k, v, km, feature_map, window: int, sinks: int, memory_every: int, scale: float, chunk_size: int, native_band: bool = False, memory_score: str = "value_norm", fq=None, fk=None) -> tuple[torch.Tensor, MemoryState]:
    """:func:`_run`'s arguments → its result, by the period-parallel form
    (:func:`hf_rfa.ops.memory_periods.run_periods`) for calls of more than one period's tokens
    and by the sequential form for shorter ones (decoding steps)."""
    if q.shape[2] > memory_every:
        from .periods import run_periods  # it builds on this module's helpers

        return run_periods(state, q, k, v, km, feature_map, window, sinks, memory_every, scale, chunk_size, native_band, memory_score, fq, fk)
    return _run(state, q, k, v, km, feature_map, window, sinks, memory_every, scale, chunk_size, native_band, memory_score, fq, fk)


def memory_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map,
    key_mask: torch.Tensor | None,
    window: int,
    sinks: int,
    memory: int,
    memory_every: int,
    scale: float,
    chunk_size: int = 64,
    native_band: bool = False,
    memory_score: str = "value_norm",
    feature_q: torch.Tensor | None = None,
    feature_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal hybrid attention with an exact memory over a whole sequence (the prefill form;
    ``random_feature_attention(memory=M)`` calls it on checked, finite inputs; ``native_band``:
    the exact window/sink part runs the compiled CPU kernel, as the op without memory does;
    ``memory_score``: how the memory ranks its candidates, :data:`MEMORY_SCORES`;
    ``feature_q``/``feature_k``: what the feature part reads, shapes of q/k, e.g. un-rotated).

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
    state = MemoryState.empty(b, hkv, d, dv, feature_map.feature_dim, sinks, memory, k.dtype, q.device, ct, feature_keys=feature_k is not None)
    out, _ = _dispatch(state, q, k, v, km, feature_map, window, sinks, memory_every, scale, chunk_size, native_band, memory_score, feature_q, feature_k)
    return to_output_dtype(out[:, :, nk - nq :], q.dtype)


def _check(state, q, k, v, feature_map, attention_mask, window, sinks, memory, memory_every, scale, chunk_size, memory_score="value_norm", feature_q=None, feature_k=None):
    """Arguments of :func:`continue_memory_attention` against each other and the state
    (ValueError naming the argument); returns ``(B, H, n, D, Hkv, Dv)``."""
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
    if (feature_k is None) != (state.mem_kf is None):
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
    window: int = 0,
    sinks: int = 0,
    memory: int = 1,
    memory_every: int = 64,
    scale: float | None = None,
    chunk_size: int = 64,
    memory_score: str = "value_norm",
    feature_q: torch.Tensor | None = None,
    feature_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MemoryState]:
    """Causal attention of ``n`` new tokens with an exact memory, given the summarised past —
    :func:`hf_rfa.ops.decode.continue_attention` for ``memory > 0`` (the same robustness: checks
    before any computation, padded keys change nothing, non-finite inputs poison the rows softmax
    would).

    q ``[B, H, n, D]``, k ``[B, Hkv, n, D]``, v ``[B, Hkv, n, Dv]``, attention_mask ``[B, n]`` →
    ``(out [B, H, n, Dv]`` in q's dtype, new state). Any split of a sequence into calls gives the
    outputs of one :func:`memory_attention` over it (up to float rounding). ``feature_q``/
    ``feature_k`` (shapes of q/k): the feature part's inputs, given at every call exactly when the
    state was built with ``feature_keys=True``.
    """
    b, h, n, d, hkv, dv = _check(state, q, k, v, feature_map, attention_mask, window, sinks, memory, memory_every, scale, chunk_size, memory_score, feature_q, feature_k)
    if b == 0 or n == 0:
        return q.new_zeros(b, h, n, dv), replace(state, base=replace(state.base, seen=state.seen + n))
    scale = d**-0.5 if scale is None else float(scale)
    km = torch.ones(b, n, dtype=torch.bool, device=q.device) if attention_mask is None else attention_mask.to(q.device).bool()
    q, k, v, poison, nonfinite = guard_continuation(q, k, v, km, state.base.nonfinite)
    if feature_q is not None:  # un-rotated q/k are non-finite where q/k are (poisoned above): kept out of the state
        feature_q, feature_k = (torch.where(torch.isfinite(x), x, torch.zeros_like(x)) for x in (feature_q, feature_k))
    out, new = _dispatch(state, q, k, v, km, feature_map, window, sinks, memory_every, scale, chunk_size, memory_score=memory_score, fq=feature_q, fk=feature_k)
    new = replace(new, base=replace(new.base, nonfinite=nonfinite))
    if poison is not None:
        out = out.masked_fill(poison[..., None], float("nan"))
    return to_output_dtype(out, q.dtype), new


__all__ = ["MAX_MEMORY", "MEMORY_SCORES", "MemoryState", "feature_error", "check_memory_args", "continue_memory_attention", "memory_attention", "value_norm"]
