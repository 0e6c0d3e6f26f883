"""The causal scan over blocks: the block plan, the state matrix, and the scan driver.

The sequence is processed in *blocks* of several chunks (``block_size`` tokens, default
:data:`DEFAULT_BLOCK_SIZE`); each block is one call of the block step
(:func:`hf_rfa.ops.feature.chunkwise.block_step`, autograd form) or, without autograd, of its inference
form (:func:`hf_rfa.ops.backends.causal_infer.causal_block_into` on one reused workspace). The
state between blocks is one ``[B, Hkv, F, Dv+1]`` matrix ``[S, z]`` relative to a reference log
scale ``ref [B, Hkv]``. Memory is O(N·F + block·(C + F·Dv/C)) per head, never N×N.

The block's inputs come from a callback ``get(i, ws)``: precomputed features
(:func:`hf_rfa.ops.feature.linear.causal_linear`) or features computed block by block
(:func:`hf_rfa.ops.feature.fused.causal_feature_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..backends import kernels
from ..backends.causal_infer import BlockWorkspace, causal_block_into, workspace
from .chunkwise import Block, block_step
from ..partial import Partial, finalize
from ..recurrent import LinearState

#: tokens per block of the causal form (rounded down to a multiple of the chunk size)
DEFAULT_BLOCK_SIZE = 512


@dataclass
class ScanSpec:
    """What the recomputing scan (:class:`hf_rfa.ops.feature.recompute.ScanFunction`) needs besides tensors;
    ``names``: the feature map's parameters passed as the Function's ``*params``, in that order
    (:func:`hf_rfa.ops.autograd.map_params`)."""

    feature_map: object
    plan: list[tuple[int, int]]
    x_scale: float
    scaled: bool
    g: int
    ct: torch.dtype
    names: tuple[str, ...] = ()


def plan_blocks(n: int, chunk_size: int, block_size: int | None) -> list[tuple[int, int]]:
    """Blocks ``(length, chunk)`` covering ``[0, n)``: multiples of the chunk size, then (if any)
    one short last chunk of its own length."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bs = DEFAULT_BLOCK_SIZE if block_size is None else int(block_size)
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    bs = max(chunk_size, bs - bs % chunk_size)
    plan, t0 = [], 0
    while t0 < n:
        full = min(n - t0, bs) // chunk_size * chunk_size
        plan.append((full, chunk_size) if full else (n - t0, n - t0))
        t0 += plan[-1][0]
    return plan


def split_tokens(x: torch.Tensor | None, sizes: list[int], dim: int) -> list | tuple:
    """Split along the token axis once (one O(N) backward, unlike per-block slicing, whose
    backward would scatter every block's gradient into a full-size zero tensor)."""
    return [None] * len(sizes) if x is None else torch.split(x, sizes, dim=dim)


def state_matrix(state: LinearState, scaled: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The state as one ``[B,Hkv,F,Dv+1]`` matrix ``[S, z]`` (written into ``out`` when given) and
    its reference; unscaled features (``scaled`` False) need a reference ≥ 0."""
    if out is None:
        S = torch.cat([state.S, state.z.unsqueeze(-1)], dim=-1)
    else:
        S = out
        S[..., :-1].copy_(state.S)
        S[..., -1].copy_(state.z)
    ref = state.ref
    if not scaled:  # unscaled features: everything at log scale 0
        new_ref = ref.clamp_min(0.0)
        factor = torch.exp(ref - new_ref)[..., None, None]
        S, ref = (S.mul_(factor) if out is not None else S * factor), new_ref
    return S, ref


def causal_scan(
    get: Callable[[int, BlockWorkspace | None], Block],
    plan: list[tuple[int, int]],
    state: LinearState,
    scaled: bool,
    g: int,
    infer: bool = False,
    dest: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[Partial | None, LinearState]:
    """Run the block step over the blocks of ``plan``; ``get(i, ws)`` returns block i's
    ``(qf, lq, kf, lk, v)`` (and may write its features into the workspace ``ws`` when one is
    given). ``scaled``: whether ``lk`` is given (else all key log scales are 0). ``infer``: no
    autograd graph is needed — full blocks then run :func:`causal_block_into` on one reused
    workspace (unless the compiled kernels are enabled). ``dest [B,Hkv,G,N,Dv]``: write the
    normalised output ``num / max(den, eps)`` there and return ``None`` for the Partial.
    (Training memory: :class:`hf_rfa.ops.feature.recompute.ScanFunction` runs these blocks and
    recomputes them in backward instead.)"""
    if infer and not kernels.wanted() and not torch.compiler.is_compiling():
        with torch.no_grad():
            return _causal_scan_into(get, plan, state, scaled, g, dest, eps)
    S, ref = state_matrix(state, scaled)
    outs, lss, lqs = [], [], []
    full = plan[0]
    for i, (t, c) in enumerate(plan):
        qf, lq, kf, lk, v = get(i, None)
        if not scaled:
            lk = None
        # only full-size blocks go to the compiled kernel (one shape: no recompilation)
        step = kernels.maybe_compiled(block_step, qf, lq, kf, lk, v, S) if plan[i] == full else block_step
        out, ls, S, ref = step(qf, lq, kf, lk, v, S, ref, c)
        outs.append(out)
        lss.append(ls)
        lqs.append(lq)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    ls = lss[0] if len(lss) == 1 else torch.cat(lss, dim=-1)
    part, st = _finish(out, ls, lqs, S, ref, state)
    if dest is None:
        return part, st
    dest.copy_(finalize(part, eps))
    return None, st


def _finish(out, ls, lqs, S, ref, state: LinearState) -> tuple[Partial, LinearState]:
    """Partial and state from the scan's ``out [B,Hkv,G,N,Dv+1]``, ``ls [B,Hkv,G,N]``, the blocks'
    query log scales and the final ``S [B,Hkv,F,Dv+1]``, ``ref``."""
    if lqs and lqs[0] is not None:
        ls = ls + (lqs[0] if len(lqs) == 1 else torch.cat(lqs, dim=-1))
    dv = out.shape[-1] - 1
    part = Partial(out[..., :dv], out[..., dv], ls)
    return part, LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)


def _causal_scan_into(get, plan, state: LinearState, scaled: bool, g: int, dest, eps: float) -> tuple[Partial | None, LinearState]:
    """:func:`causal_scan` without autograd: full blocks run :func:`causal_block_into` on one
    (cached) :class:`BlockWorkspace` and write into one preallocated result — the Partial's
    ``[num, den]`` buffer, or the normalised output ``dest`` directly."""
    b, hkv, f, dv = state.S.shape
    dv1, dtype, dev = dv + 1, state.S.dtype, state.S.device
    n = sum(t for t, _ in plan)
    t_full, c_full = plan[0]
    out = torch.empty(b, hkv, g, n, dv1, dtype=dtype, device=dev) if dest is None else None
    ls_k = torch.empty(b, hkv, n, dtype=dtype, device=dev) if dest is None else None  # (normalised: not needed)
    ws = workspace((b, hkv, g, t_full, c_full, f, dv1), dtype, dev) if t_full > c_full else None
    S, ref = state_matrix(state, scaled, ws.S.view(b, hkv, f, dv1) if ws is not None else None)
    lqs, t0 = [], 0
    for i, (t, c) in enumerate(plan):
        full = ws is not None and (t, c) == (t_full, c_full)  # single-chunk blocks gain nothing
        qf, lq, kf, lk, v = get(i, ws if full else None)
        if not scaled:
            lk = None
        o_blk = out[:, :, :, t0 : t0 + t] if dest is None else dest[:, :, :, t0 : t0 + t]
        if full:
            S, ref = causal_block_into(ws, qf, kf, lk, v, (S, ref), (o_blk, ls_k[:, :, t0 : t0 + t] if dest is None else None, eps if dest is not None else None))
        else:
            o, ls, S, ref = block_step(qf, lq, kf, lk, v, S, ref, c)
            if dest is None:
                o_blk.copy_(o)
                ls_k[:, :, t0 : t0 + t].copy_(ls[:, :, 0])
            else:
                torch.div(o[..., : dv1 - 1], o[..., dv1 - 1 :].clamp_min(eps), out=o_blk)
        lqs.append(lq)
        t0 += t
    if ws is not None and S.data_ptr() == ws.S.data_ptr():
        S = S.clone()  # the workspace outlives this call
    if dest is not None:
        dv = dv1 - 1
        return None, LinearState(S[..., :dv], S[..., dv], ref, state.log_gate_sum)
    ls = ls_k.unsqueeze(2).expand(b, hkv, g, n)
    return _finish(out, ls, lqs, S, ref, state)


__all__ = ["DEFAULT_BLOCK_SIZE", "ScanSpec", "causal_scan", "plan_blocks", "split_tokens", "state_matrix"]
