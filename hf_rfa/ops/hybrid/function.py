"""The causal hybrid in training as ONE recomputing :class:`torch.autograd.Function`.

The autograd-connected pieces of a checkpointed causal hybrid (:class:`~hf_rfa.ops.band.recompute.
BandFunction` for the exact window/sinks, :class:`~hf_rfa.ops.feature.recompute.ScanFunction` for the
feature scan, then :func:`~hf_rfa.ops.partial.merge` and :func:`~hf_rfa.ops.partial.finalize`)
each keep their own inputs: the √scale-multiplied queries/keys of the band, the window-shifted
keys/values of the scan, and the two parts' numerators and denominators for the merge — about
three times q, k, v per layer. :class:`HybridFunction` keeps q, k, v once (in their own dtype),
the O(N) masks and gate terms, and the scan's ``[F, Dv+1]`` state entering each block. With
feature inputs (``feature_q``/``feature_k``) the band reads q, k and the scan reads those, each
saved once too. With a rotary embedding to undo instead (``rope = (cos, sin)``, what ``RFAConfig(
feature_input="unrotated")`` trains with) the scan reads q/k un-rotated block by block
(:func:`~hf_rfa.ops.rotary.unrotate`) in both passes and backward maps the scan's gradients back
through :func:`~hf_rfa.ops.rotary.unrotate_adjoint`: nothing more than q, k, v is kept (cos/sin
are the model's, shared by its layers).

Forward runs, block by block without a graph: the exact band (:func:`~hf_rfa.ops.band.recompute.
band_tiles`; on a CPU where the C++ kernel is usable, for every query at once by its twin
:func:`~hf_rfa.ops.backends.native.causal_band` — ``HybridSpec.native_band``), the feature scan (:func:`~hf_rfa.ops.feature.recompute.scan_block`) on keys delayed by
the window (index arithmetic on k and v, no shifted copy), merge and finalize. Backward walks the
blocks in reverse: it recomputes the block's scan with autograd from its saved state (carrying the
state's gradient, as ``ScanFunction``), the band's probabilities, and merge + finalize with
autograd on the band's block-local num/den; the band's input gradients are then the hand-written
ones of :func:`~hf_rfa.ops.band.recompute.band_block_grads`. Both passes evaluate the feature map on
the parameter tensors passed to forward (:func:`~hf_rfa.ops.autograd.with_params`; backward
recomputes on leaves of the saved ones), so ``torch.func.functional_call`` and a parameter
changed between forward and backward (an error, as in the autograd form) are honoured. Features,
states and sums are float32 (float64 inputs stay float64). The reference twin is the autograd
form (``checkpoint_blocks=False``; ``tests/ops/test_hybrid_recompute.py``,
``tests/ops/test_hybrid_recompute_feature_inputs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..autograd import add_grad, grads, leaf, map_params, own_params, param_leaves, with_params
from ..backends import native
from ..band.plan import band_plan
from ..band.recompute import band_block_grads, stack_rows, unstack_rows
from ..feature.scan import ScanSpec, plan_blocks
from ..masks import exp_floor, no_autocast
from ..partial import Partial
from ..rotary import unrotate_adjoint
from ..spec import CallPlan
from .blocks import HybridInputs, HybridSpec, add_window, band_partial, band_unit, block_queries, combine, feature_inputs, feature_unit, initial_state, plan_units, sink_inputs, window_slice


@dataclass(frozen=True)
class HybridArgs:
    """The tensors of a :func:`hybrid_attention` call besides q, k, v: ``key_mask [B,N]`` bool or
    None (padding), ``feat_mask [B,N]`` bool (keys the feature part answers: real and not sinks;
    required with a feature part), gate terms ``lq_add [B,Hkv,1|G,N]`` / ``lk_add [B,Hkv,N]``
    (unshifted; computed by the caller from the keys the feature part reads) or None,
    ``feature_q [B,H,N,D]`` / ``feature_k [B,Hkv,N,D]`` (both or neither; ignored without a
    feature part): what the feature scan reads instead of q/k (the band always reads q, k), and
    ``rope = (cos, sin)`` ``[B|1, N, Dr]`` (not with feature_q/feature_k): the scan reads q/k with
    that rotary embedding undone, recomputed per block (nothing un-rotated is saved)."""

    key_mask: torch.Tensor | None
    feat_mask: torch.Tensor | None
    lq_add: torch.Tensor | None = None
    lk_add: torch.Tensor | None = None
    feature_q: torch.Tensor | None = None
    feature_k: torch.Tensor | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


def _check_args(q, k, call: CallPlan, x: HybridArgs, feature: bool) -> None:
    """The arguments of :func:`hybrid_attention` against each other (ValueError naming them)."""
    b, n = q.shape[0], q.shape[2]
    window, sinks, feat_mask = call.window, call.sinks, x.feat_mask
    if (x.feature_q is None) != (x.feature_k is None):
        raise ValueError("feature_q and feature_k go together")
    if x.rope is not None and x.feature_q is not None:
        raise ValueError("give either feature_q/feature_k or rope, not both")
    if x.feature_q is not None and (x.feature_q.shape != q.shape or x.feature_k.shape != k.shape):
        raise ValueError(f"feature_q/feature_k must have the shapes of q/k {tuple(q.shape)}/{tuple(k.shape)}, got {tuple(x.feature_q.shape)}/{tuple(x.feature_k.shape)}")
    if window < 0 or sinks < 0 or (window == 0 and sinks == 0):
        raise ValueError(f"window and sinks must be >= 0 with at least one > 0, got window={window}, sinks={sinks}")
    if feature and window >= n:
        raise ValueError(f"window must be < N with a feature part, got window={window}, N={n}")
    if feature and (feat_mask is None or tuple(feat_mask.shape) != (b, n) or feat_mask.dtype != torch.bool):
        raise ValueError(f"feat_mask must be a bool [B, N] = [{b}, {n}] tensor with a feature part, got {None if feat_mask is None else (tuple(feat_mask.shape), feat_mask.dtype)}")


def hybrid_attention(q, k, v, feature_map, call: CallPlan, args: HybridArgs, feature: bool = True, block_size: int = 512) -> torch.Tensor:
    """Causal hybrid (exact window + sinks, feature map for the other keys) by
    :class:`HybridFunction`: ``q [B,H,N,D]``, ``k [B,Hkv,N,D]``, ``v [B,Hkv,N,Dv]``; ``call``: the
    :class:`~hf_rfa.ops.spec.CallPlan` (window < N when ``feature``, sinks, scale, its spec's chunk
    size; ``call.native_forward``: forward answers the exact band with the C++ kernel where it is
    usable — CPU, float32 compute, not compiling; see :func:`~hf_rfa.ops.backends.native.usable`
    — else PyTorch); ``args``: the other tensors (:class:`HybridArgs`). ``feature`` False: the
    exact part alone. Returns ``[B,Hkv,G,N,Dv]`` float32 (float64 for float64 q)."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    _check_args(q, k, call, args, feature)
    window, sinks, scale = call.window, call.sinks, call.scale
    feature_q, feature_k, rope = (args.feature_q, args.feature_k, args.rope) if feature else (None, None, None)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    plan = band_plan(q.unflatten(1, (hkv, h // hkv)), args.key_mask, window, sinks, True, call.spec.chunk_size, block_size)
    scan = None
    params: tuple = ()
    cos, sin = rope if rope is not None else (None, None)
    if feature:
        with torch.no_grad():
            probe = feature_map.forward_keys((k if feature_k is None else feature_k)[:, :, :1].to(ct) * scale**0.5)
        scaled = probe.log_scale is not None or args.lk_add is not None
        names, params = map_params(feature_map)
        scan = ScanSpec(feature_map, plan_blocks(n, call.spec.chunk_size, block_size), scale**0.5, scaled, h // hkv, ct, names)
    native_band = call.native_forward and native.usable(q.device, ct)
    spec = HybridSpec(plan, scan, plan_units(plan, scan), window, scale**0.5, feature_map.eps, ct, native_band)
    x = HybridInputs(q, k, v, feature_q, feature_k, cos, sin, args.feat_mask if feature else None, args.lq_add, args.lk_add)
    return HybridFunction.apply(spec, *x, *params)


#: index of the first ``*params`` tensor in :meth:`HybridFunction.forward`'s inputs (after ctx)
_NPOS = 11


class HybridFunction(torch.autograd.Function):
    """Causal hybrid: ``(spec, q [B,H,N,D], k [B,Hkv,N,D], v [B,Hkv,N,Dv], feature_q [B,H,N,D] |
    None, feature_k [B,Hkv,N,D] | None, cos [B|1,N,Dr] | None, sin | None, feat_mask [B,N] |
    None, lq_add [B,Hkv,1|G,N] | None, lk_add [B,Hkv,N] | None, *params)`` → ``[B,Hkv,G,N,Dv]``
    (compute dtype). The band reads q, k; the feature scan reads ``feature_q``/``feature_k``, or
    with ``cos``/``sin`` q/k un-rotated block by block, or else q, k. ``params``: the feature
    map's parameters named ``spec.scan.names`` (:func:`~hf_rfa.ops.autograd.map_params`; none
    without a feature part), which both passes bind (:func:`~hf_rfa.ops.autograd.with_params`).
    Saves q, k, v, the feature inputs, the parameters, the O(N) mask and gate terms, and the
    scan's state entering each block (see the module docstring)."""

    @staticmethod
    def forward(ctx, spec: HybridSpec, *inputs):
        x, params = HybridInputs(*inputs[: _NPOS - 1]), inputs[_NPOS - 1 :]
        q, k, v, feature_q, feature_k, cos, sin, feat_mask, lq_add, lk_add = x
        b, h, n, _ = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        out = torch.empty(b, hkv, h // hkv, n, dv, dtype=spec.ct, device=q.device)
        states, refs = [], []

        def run():
            ks, vs = sink_inputs(spec, k, v)
            S, ref = initial_state(spec, b, hkv, dv, q.device) if spec.scan is not None else (None, None)
            whole = _native_band(spec, q, k, v) if spec.native_band else None
            for unit in spec.units:
                t0, t1 = unit[0], unit[1]
                # the block's queries in the compute dtype, for the PyTorch band and the scan
                xq = q[:, :, t0:t1].to(spec.ct) if whole is None or spec.scan is not None else None
                if whole is not None:
                    band = Partial(whole[0][..., t0:t1, :], whole[1][..., t0:t1], whole[2][..., t0:t1])
                else:
                    pb, ps, r, _, vbu, _, _ = band_unit(spec, unit, xq, k, v, ks, vs)
                    band = Partial(*band_partial(spec, unit, pb, ps, r, vbu, vs))
                feat = None
                if spec.scan is not None:
                    fq = block_queries(spec, xq, feature_q, cos, sin, t0, t1)
                    feat, S, ref, st, rf = feature_unit(spec, unit, S, ref, feature_inputs(spec, unit, fq, x))
                    states.extend(st)
                    refs.extend(rf)
                out[:, :, :, t0:t1] = combine(spec, band, feat)

        with torch.no_grad():
            _bound(spec, params, run)
        ctx.spec = spec
        ctx.own_params = _own_params(spec, params)
        st = (torch.stack(states), torch.stack(refs)) if states else (None, None)
        ctx.save_for_backward(q, k, v, feature_q, feature_k, cos, sin, feat_mask, lq_add, lk_add, *st, *params)
        return out

    @staticmethod
    @no_autocast  # a backward run inside torch.autocast (loss.backward() in the autocast block) stays float32
    def backward(ctx, dout):
        spec: HybridSpec = ctx.spec
        tensors = ctx.saved_tensors  # read once (checkpointing unpacks each saved tensor once)
        inputs, saved = _Saved(*tensors[: len(_Saved._fields)]), tensors[len(_Saved._fields) :]
        k, v = inputs.k, inputs.v
        params = _backward_params(ctx, spec, saved)
        acc = _Grads(spec, inputs, len(params))
        dS = None

        def run():
            nonlocal dS
            ks, vs = sink_inputs(spec, k, v)
            for unit in reversed(spec.units):
                dS = _unit_backward(spec, unit, inputs, (ks, vs), params, dout, dS, acc)

        _bound(spec, params, run)
        return (None, *acc.result(ctx.needs_input_grad, inputs))


def _native_band(spec: HybridSpec, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact band's ``(num [B,Hkv,G,N,Dv], den [B,Hkv,G,N], ls)`` for every query at once, by
    the C++ kernel (float32; forward only: backward recomputes the band per block in PyTorch)."""
    plan = spec.plan
    num, den, ls = native.causal_band(q, k, v, spec.root**2, plan.key_mask, plan.window, (plan.spos, plan.sexists), native.KernelRun(plan.c, exp_floor(torch.float32)))
    shape = (plan.b, plan.hkv, plan.g, plan.n)
    return num.view(*shape, -1), den.view(shape), ls.view(shape)


def _own_params(spec: HybridSpec, params) -> bool:
    """Whether ``params`` are the feature map's own parameter tensors (not substitutes bound by
    ``torch.func.functional_call``)."""
    return spec.scan is not None and bool(params) and own_params(spec.scan.feature_map, spec.scan.names, params)


def _backward_params(ctx, spec: HybridSpec, saved) -> list:
    """The parameter tensors backward recomputes with. When forward ran with the map's own
    parameters and the saved tensors are still those (autograd's version check has already refused
    an in-place change): the parameters themselves — nothing to rebind, so ``torch.compile`` traces
    the backward without a graph break (under compilation the saved tensors are graph values, so
    forward's identity check decides). Otherwise leaves of the saved tensors, bound again for the
    recomputation (:func:`~hf_rfa.ops.autograd.with_params`)."""
    if ctx.own_params:
        fm, names = spec.scan.feature_map, spec.scan.names
        if torch.compiler.is_compiling() or own_params(fm, names, saved):
            own = dict(fm.named_parameters())
            return [own[n] for n in names]
    return param_leaves(saved, ctx.needs_input_grad[_NPOS:])


def _bound(spec: HybridSpec, params, fn) -> None:
    """``fn()`` with the feature map's parameters bound to ``params`` (nothing to bind without a
    feature part)."""
    if spec.scan is None:
        fn()
    else:
        with_params(spec.scan.feature_map, spec.scan.names, params, fn)


class _Grads:
    """Input gradients of :class:`HybridFunction` accumulated over the blocks (compute dtype)."""

    def __init__(self, spec: HybridSpec, x, nparams: int):
        """``x``: the saved inputs (:class:`_Saved`); ``nparams``: how many parameter tensors."""
        q, k, v, fq, fk, lq_add, lk_add, rope = x.q, x.k, x.v, x.fq, x.fk, x.lq_add, x.lk_add, x.cos is not None
        ct = spec.ct
        self.spec = spec
        self.dq = torch.zeros(q.shape, dtype=ct, device=q.device)
        self.dk = torch.zeros(k.shape, dtype=ct, device=k.device)
        self.dv = torch.zeros(v.shape, dtype=ct, device=v.device)
        # the scan's query/key gradients: their own buffers with feature inputs or a rotary
        # embedding undone (mapped back into dq/dk at the end), else dq/dk
        fq, fk = (q, k) if rope else (fq, fk)
        self.dfq = torch.zeros(fq.shape, dtype=ct, device=fq.device) if fq is not None else self.dq
        self.dfk = torch.zeros(fk.shape, dtype=ct, device=fk.device) if fk is not None else self.dk
        self.dlq = torch.zeros_like(lq_add) if lq_add is not None else None
        self.dlk = torch.zeros_like(lk_add) if lk_add is not None else None
        self.dks = self.dvs = None
        self.dparams: list = [None] * nparams

    def result(self, needs, x) -> list:
        """``(dq, dk, dv, dfq, dfk, None, None, None, dlq, dlk, *dparams)`` in the inputs' dtypes
        (the sinks' key and value gradients scattered back to their positions; with ``cos``/``sin``
        the scan's query/key gradients mapped back through the un-rotation into dq/dk; None where
        ``needs``, the Function's ``needs_input_grad``, says no; ``x``: the saved inputs)."""
        q, k, v, fq, fk, cos, sin = x.q, x.k, x.v, x.fq, x.fk, x.cos, x.sin
        plan = self.spec.plan
        if self.dks is not None:
            idx = plan.spos[:, None, :, None]
            self.dk.scatter_add_(2, idx.expand_as(self.dks), self.dks * self.spec.root)
            self.dv.scatter_add_(2, idx.expand_as(self.dvs), self.dvs)
        if cos is not None:
            self.dq += unrotate_adjoint(self.dfq, cos, sin)
            self.dk += unrotate_adjoint(self.dfk, cos, sin)
        dfq = self.dfq.to(fq.dtype) if fq is not None else None
        dfk = self.dfk.to(fk.dtype) if fk is not None else None
        got = [self.dq.to(q.dtype), self.dk.to(k.dtype), self.dv.to(v.dtype), dfq, dfk, None, None, None, self.dlq, self.dlk] + self.dparams
        return [g if g is not None and needs[i + 1] else None for i, g in enumerate(got)]


#: what :meth:`HybridFunction.backward` reads back: the inputs it saved (:class:`HybridInputs`'
#: fields, see its forward) and the scan's state entering each block (``states``/``refs``, None
#: without a feature part)
_Saved = NamedTuple("_Saved", [*HybridInputs.__annotations__.items(), ("states", "torch.Tensor | None"), ("refs", "torch.Tensor | None")])


def _unit_backward(spec: HybridSpec, unit, x: _Saved, sinks: tuple, params, dout, dS, acc: _Grads):
    """One block of :meth:`HybridFunction.backward` (run with the map's parameters bound to the
    leaves ``params``): recompute, differentiate, accumulate into ``acc``; returns the gradient
    of the state entering the block (None without a feature part). ``x.fq``/``x.fk``: the feature
    inputs or None (the scan reads q/k, un-rotated with ``x.cos``/``x.sin`` when given);
    ``sinks``: the sinks' scaled keys and values ``(ks, vs)``."""
    t0, t1 = unit[0], unit[1]
    ks, vs = sinks
    xq = x.q[:, :, t0:t1].to(spec.ct)
    pb, ps, r, kbu, vbu, q6, start = band_unit(spec, unit, xq, x.k, x.v, ks, vs)
    num_b, den_b, ls_b = band_partial(spec, unit, pb, ps, r, vbu, vs)
    num_b, den_b = leaf(num_b), leaf(den_b)
    feat = S_in = S_out = None
    leaves: list = []
    if spec.scan is not None:
        xf = block_queries(spec, xq, x.fq, x.cos, x.sin, t0, t1)
        leaves = [leaf(y) for y in feature_inputs(spec, unit, xf, x)]
        i0 = unit[4][0]
        S_in = x.states[i0].detach().requires_grad_()
        with torch.enable_grad():
            feat, S_out, _, _, _ = feature_unit(spec, unit, S_in, x.refs[i0], leaves)
    with torch.enable_grad():
        out = combine(spec, Partial(num_b, den_b, ls_b), feat)
    live = [y for y in leaves if y is not None and y.is_floating_point()]
    got = grads([out, S_out], [dout[:, :, :, t0:t1], dS], [num_b, den_b, S_in, *params, *live])
    dnum_b, dden_b, dS_in = got[:3]
    acc.dparams = [add_grad(a, g_) for a, g_ in zip(acc.dparams, got[3 : 3 + len(params)])]
    if live:
        _scatter_feature_grads(spec, unit, leaves, got[3 + len(params) :], acc)
    _scatter_band_grads(spec, unit, (pb, ps, q6, kbu, vbu, ks, vs, start), dnum_b, dden_b, acc)
    return dS_in


def _scatter_feature_grads(spec: HybridSpec, unit, leaves: list, grads: list, acc: _Grads) -> None:
    """Add the scan's block gradients (queries, delayed keys/values, gate terms) into ``acc`` at
    their positions (keys and values of query t at key t − W; queries and keys into the feature
    inputs' gradients, which are q's and k's without feature inputs)."""
    t0, t1 = unit[0], unit[1]
    w = spec.window
    it = iter(grads)
    named = {}
    for name, x in zip(("q", "k", "v", "mask", "lq", "lk"), leaves):
        if x is not None and x.is_floating_point():
            named[name] = next(it)
    if named.get("q") is not None:
        acc.dfq[:, :, t0:t1] += named["q"]
    if named.get("k") is not None:
        add_window(acc.dfk, named["k"], t0 - w, 2)
    if named.get("v") is not None:
        add_window(acc.dv, named["v"], t0 - w, 2)
    if named.get("lq") is not None and acc.dlq is not None:
        acc.dlq[..., t0:t1] += named["lq"]
    if named.get("lk") is not None and acc.dlk is not None:
        add_window(acc.dlk, named["lk"], t0 - w, 2)


def _scatter_band_grads(spec: HybridSpec, unit, tiles: tuple, dnum_b, dden_b, acc: _Grads) -> None:
    """The band's hand-written backward (:func:`~hf_rfa.ops.band.recompute.band_block_grads`) from the
    gradients of the block's exact ``num [B,Hkv,G,T,Dv]``/``den [B,Hkv,G,T]``, added into ``acc``;
    ``tiles``: ``(pb, ps, q6, kbu, vbu, ks, vs, start)`` of the block (:func:`~.blocks.band_unit`)."""
    plan = spec.plan
    pb, ps, q6, kbu, vbu, ks, vs, start = tiles
    t0, t1, c0, c1, _ = unit
    L, c, rows = c1 - c0, plan.c, (c1 - c0) * plan.c
    dn6 = stack_rows(window_slice(dnum_b, 0, rows, 3), L, c)
    dd6 = stack_rows(window_slice(dden_b, 0, rows, 3).unsqueeze(-1), L, c)
    dq6, gk, gv, gks, gvs = band_block_grads((pb, ps, q6, kbu, vbu, ks, vs), dn6, dd6, c)
    dq = unstack_rows(dq6, plan.g, c)[..., : t1 - t0, :] * spec.root
    acc.dq[:, :, t0:t1] += dq.flatten(1, 2)
    if gk is not None:
        add_window(acc.dk, gk * spec.root, start, 2)
        add_window(acc.dv, gv, start, 2)
    if gks is not None:
        acc.dks = gks if acc.dks is None else acc.dks.add_(gks)
        acc.dvs = gvs if acc.dvs is None else acc.dvs.add_(gvs)


__all__ = ["HybridArgs", "HybridFunction", "HybridInputs", "HybridSpec", "hybrid_attention"]
