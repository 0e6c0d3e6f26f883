"""Fused features + causal linear attention: the feature map is applied block by block.

:func:`causal_feature_attention` is the form ``random_feature_attention`` and the decode path
(:mod:`hf_rfa.ops.decode`) use for the causal feature part: the ``[N, F]`` feature tensors are
never materialised (cache-resident blocks, O(N·Dv) extra memory in inference). It runs, by the
backend chosen (:func:`hf_rfa.ops.backends.resolve`):

- ``torch``: the autograd block step (:func:`hf_rfa.ops.feature.chunkwise.block_step`) over the scan of
  :mod:`hf_rfa.ops.feature.scan`, or, with ``checkpoint``, the recomputing
  :class:`hf_rfa.ops.feature.recompute.ScanFunction`;
- ``inference``/``compiled``: the same scan without autograd, features written straight into the
  reused workspace;
- ``native``: the C++ CPU kernel for maps that expose native parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import native, resolve
from ..backends.causal_infer import BlockWorkspace
from .chunkwise import Block, Tokens, assemble_block, block_features, key_terms
from ..masks import exp_floor, needs_grad
from ..partial import Partial, finalize
from ..autograd import map_params
from ..recurrent import LinearState, fold
from .recompute import ScanFunction
from .scan import ScanSpec, causal_scan, plan_blocks, split_tokens, state_matrix


@dataclass(frozen=True)
class ScanRun:
    """How :func:`causal_feature_attention` runs: the ``chunk_size`` of the chunkwise form, the
    ``block_size`` of the scan (None: :data:`~hf_rfa.ops.feature.scan.DEFAULT_BLOCK_SIZE`), the
    factor ``x_scale`` applied to q/k before the feature map, ``checkpoint`` (the recomputing
    training Function) and the ``backend`` chosen (None: ``"auto"`` for the inputs)."""

    chunk_size: int = 64
    block_size: int | None = None
    x_scale: float = 1.0
    checkpoint: bool = False
    backend: str | None = None


def causal_feature_attention(
    feature_map,
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    terms: tuple = (None, None, None),
    run: ScanRun | None = None,
    state: LinearState | None = None,
    out: torch.Tensor | None = None,
) -> tuple[Partial | None, LinearState]:
    """Fused features + causal linear attention: the feature map is applied block by block.

    xq ``[B, H, N, D]``, xk ``[B, Hkv, N, D]`` (multiplied by ``run.x_scale`` block by block before the
    feature map: pass √scale there, or 1.0 for inputs already scaled), v ``[B, Hkv, N, Dv]``
    (low-precision q/k/v are converted to float32 block by block, never as a whole), ``terms =
    (key_mask, lq_add, lk_add)`` (each or all None): key_mask ``[B, N]`` bool (False: key skipped),
    optional log-scale offsets added to the features' (gated maps): ``lq_add [B, Hkv, G, N]``,
    ``lk_add [B, Hkv, N]``; ``run``: chunk and block sizes, ``x_scale``, ``checkpoint`` and
    ``backend`` (:class:`ScanRun`; None: its defaults). Equivalent to
    computing ``qf, lq, kf, lk`` over the whole sequence (as ``random_feature_attention`` does),
    masking, and calling :func:`hf_rfa.ops.feature.linear.causal_linear`, but never holds ``[N, F]``
    features. Requires a per-token feature map (every map in this package is). ``run.checkpoint``:
    with autograd (and a state that needs no gradient), save only the inputs and each block's
    incoming state, and recompute the block's features and products in backward
    (:mod:`hf_rfa.ops.feature.recompute`). ``run.backend``: the one :func:`hf_rfa.ops.backends.resolve`
    chose (None: ``"auto"`` for these inputs). ``state``: the state to continue (None: empty).
    ``out [B, Hkv, G, N, Dv]``: write the normalised output there and return None for the Partial.
    """
    run = ScanRun() if run is None else run
    key_mask, lq_add, lk_add = terms
    chunk_size, block_size, x_scale, checkpoint, backend = run.chunk_size, run.block_size, run.x_scale, run.checkpoint, run.backend
    b, h, n, _ = xq.shape
    hkv = xk.shape[1]
    g = h // hkv
    fdim, dv = feature_map.feature_dim, v.shape[-1]
    if n == 0:
        raise ValueError("causal_feature_attention needs N >= 1")
    ct = torch.float64 if xq.dtype == torch.float64 else torch.float32  # q/k/v may be bf16/fp16
    params = [p for p in feature_map.parameters()] if isinstance(feature_map, torch.nn.Module) else []
    st_t = (state.S, state.z, state.ref) if state is not None else ()
    if backend is None:
        backend = resolve("auto", grad=needs_grad(xq, xk, v, lq_add, lk_add, *st_t, *params), causal=True, device=xq.device, dtype=ct)
    infer = backend != "torch"
    if backend == "native":
        nparams = feature_map.native_params(x_scale)
        if nparams is not None:
            if state is None:
                state = LinearState.zeros(b, hkv, fdim, dv, device=xq.device, dtype=ct)
            return _native_causal(nparams, (xq, xk, v, key_mask, lq_add, lk_add), chunk_size, state, out, feature_map.eps)
    probe_k = feature_map.forward_keys(xk[:, :, :1].to(ct) * x_scale)
    scaled = probe_k.log_scale is not None or lk_add is not None
    if state is None:
        state = LinearState.zeros(b, hkv, fdim, dv, device=xq.device, dtype=probe_k.phi.dtype)
    plan = plan_blocks(n, chunk_size, block_size)
    if checkpoint and not infer and not needs_grad(*st_t):
        names, tensors = map_params(feature_map)
        spec = ScanSpec(feature_map, plan, x_scale, scaled, g, ct, names)
        return _checkpointed(spec, state, (xq, xk, v, key_mask, lq_add, lk_add), tensors, out)
    sizes = [p[0] for p in plan]
    cuts = [split_tokens(xq, sizes, 2), split_tokens(xk, sizes, 2), split_tokens(v, sizes, 2)]
    cuts += [split_tokens(key_mask, sizes, 1), split_tokens(lq_add, sizes, -1), split_tokens(lk_add, sizes, -1)]

    def get(i: int, ws: BlockWorkspace | None) -> Block:
        tokens = tuple(x[i] for x in cuts)
        if ws is None:
            return block_features(feature_map, tokens, x_scale, ct, hkv)
        return _features_into(ws, feature_map, tokens, x_scale, hkv)

    return causal_scan(get, plan, state, scaled, g, infer, out, feature_map.eps)


def fold_keys(feature_map, xk: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None, lk_add: torch.Tensor | None = None, x_scale: float = 1.0) -> LinearState:
    """The state :func:`causal_feature_attention` reaches after the keys ``xk [B, Hkv, N, D]``
    (multiplied by ``x_scale`` before the map), values ``v [B, Hkv, N, Dv]``, key mask ``[B, N]``
    bool or None and gate offsets ``lk_add [B, Hkv, N]`` or None, from the empty state — folded at
    once (:func:`~hf_rfa.ops.recurrent.fold`, autograd form), with no query: what a call whose
    queries are the last positions needs of the keys before them (:func:`hf_rfa.ops.attention.
    random_feature_attention` with Nq < Nk)."""
    ct = torch.float64 if xk.dtype == torch.float64 else torch.float32
    kf, lk = key_terms(feature_map.forward_keys(xk.to(ct) * x_scale), key_mask, lk_add)
    b, hkv = xk.shape[:2]
    state = LinearState.zeros(b, hkv, kf.shape[-1], v.shape[-1], device=xk.device, dtype=kf.dtype)
    return fold(state, kf, lk, v.to(kf.dtype))


def _checkpointed(spec: ScanSpec, state: LinearState, tokens: Tokens, params, out) -> tuple[Partial | None, LinearState]:
    """:func:`causal_feature_attention` by the recomputing :class:`ScanFunction` (training memory);
    ``tokens = (xq, xk, v, key_mask, lq_add, lk_add)``; ``params``: the map's parameters named
    ``spec.names``."""
    xq, xk, v, key_mask, lq_add, lk_add = tokens
    dv = v.shape[-1]
    S0, ref0 = state_matrix(state, spec.scaled)
    o, ls, S, ref = ScanFunction.apply(spec, S0, ref0, key_mask, xq, xk, v, lq_add, lk_add, *params)
    part, st = Partial(o[..., :dv], o[..., dv], ls), LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)
    if out is None:
        return part, st
    out.copy_(finalize(part, spec.feature_map.eps))
    return None, st


def _features_into(ws: BlockWorkspace, feature_map, tokens: Tokens, x_scale: float, hkv: int) -> Block:
    """Inference: one block's features written straight into the workspace ``ws`` (the map applies
    ``x_scale``); same result as :func:`block_features` (``tokens`` as there)."""
    xqb, xkb, vb, kmb, lqab, lkab = tokens
    fq = feature_map.features_into(xqb, ws.q_heads, True, x_scale)
    fk = feature_map.features_into(xkb, ws.k, False, x_scale)
    return assemble_block(fq, fk, vb, kmb, lqab, lkab, hkv, in_place=True)


def _native_causal(params, tokens: Tokens, chunk_size: int, state: LinearState, out, eps: float) -> tuple[Partial | None, LinearState]:
    """:func:`causal_feature_attention` by the compiled CPU kernel (:mod:`hf_rfa.ops.backends.native`;
    its twin is the inference form of :func:`hf_rfa.ops.feature.scan.causal_scan`); ``tokens =
    (xq, xk, v, key_mask, lq_add, lk_add)``."""
    xq, xk, v, key_mask, lq_add, lk_add = tokens
    b, h, n, _ = xq.shape
    hkv, dv = xk.shape[1], v.shape[-1]
    g = h // hkv
    S, ref = state_matrix(state, True)
    S, ref = S.to(torch.float32).contiguous(), ref.to(torch.float32).clone()  # updated in place
    run = native.KernelRun(chunk_size, exp_floor(torch.float32), eps if out is not None else None)
    o, mt, lq = native.causal_positive(xq, xk, v, params, (key_mask, lk_add), (S, ref), run, dest=out)
    st = LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)
    if out is not None:
        return None, st
    o = o.view(b, hkv, g, n, dv + 1)
    ls = mt.unsqueeze(2) + lq.view(b, hkv, g, n)
    if lq_add is not None:
        ls = ls + lq_add
    return Partial(o[..., :dv], o[..., dv], ls), st


__all__ = ["ScanRun", "causal_feature_attention", "fold_keys"]
