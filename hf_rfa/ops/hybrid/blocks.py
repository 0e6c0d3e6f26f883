"""The blocks of the recomputing causal hybrid (:class:`~hf_rfa.ops.hybrid.function.HybridFunction`):
its spec, the band's and the feature scan's work on one block of queries (shared by forward and by
the recomputation in backward), and the index arithmetic of keys delayed by the window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..band.plan import BandPlan
from ..band.recompute import band_numden, band_tiles, stack_rows, unstack_rows
from ..feature.recompute import scan_block
from ..feature.scan import ScanSpec, state_matrix
from ..partial import Partial, finalize, merge
from ..recurrent import LinearState
from ..rotary import unrotate


@dataclass
class HybridSpec:
    """What :class:`HybridFunction` needs besides tensors: the band's layout ``plan``, the feature
    scan's ``scan`` (None: no feature part — window ≥ N or the ``none`` map), the blocks
    ``units`` as ``(t0, t1, c0, c1, scan block indices)`` (tokens ``[t0, t1)``, query chunks
    ``[c0, c1)`` of the band), the window W, √scale ``root``, the normaliser floor ``eps`` and
    the compute dtype ``ct``."""

    plan: BandPlan
    scan: ScanSpec | None
    units: list[tuple[int, int, int, int, list[int]]]
    window: int
    root: float
    eps: float
    ct: torch.dtype
    native_band: bool = False


def plan_units(plan: BandPlan, scan: ScanSpec | None) -> list[tuple[int, int, int, int, list[int]]]:
    """The band's blocks as token ranges, each with the scan blocks it covers (the two plans cut
    at the same multiples of the block length; the scan may split the last one in two)."""
    starts, t = [], 0
    for size, _ in scan.plan if scan is not None else []:
        starts.append(t)
        t += size
    units = []
    for c0, c1 in plan.blocks():
        t0, t1 = c0 * plan.c, min(c1 * plan.c, plan.n)
        idx = [i for i, s in enumerate(starts) if t0 <= s < t1]
        if idx and starts[idx[-1]] + scan.plan[idx[-1]][0] != t1:
            raise RuntimeError(f"scan blocks {scan.plan} do not align with the band's block [{t0}, {t1})")
        units.append((t0, t1, c0, c1, idx))
    return units


def window_slice(x: torch.Tensor | None, start: int, stop: int, dim: int, fill=0) -> torch.Tensor | None:
    """``x`` at positions ``[start, stop)`` along ``dim``, positions outside ``[0, len)`` filled
    with ``fill`` (a delayed key block: ``start = t0 − W``). A view when nothing is filled."""
    if x is None:
        return None
    n = x.shape[dim]
    lo, hi = min(max(start, 0), n), max(min(stop, n), 0)
    body = x.narrow(dim, lo, max(hi - lo, 0))
    front = max(0, min(stop, 0) - start)  # positions < 0
    back = max(0, stop - max(start, n))  # positions >= len
    if front == 0 and back == 0:
        return body
    pieces = []
    for size in (front, back):
        shape = list(x.shape)
        shape[dim] = size
        pieces.append(torch.full(shape, fill, dtype=x.dtype, device=x.device))
    return torch.cat([pieces[0], body, pieces[1]], dim=dim)


def add_window(dst: torch.Tensor, grad: torch.Tensor, start: int, dim: int) -> None:
    """``dst[start : start + len(grad)] += grad`` along ``dim``, the part outside ``dst`` dropped
    (the backward of :func:`window_slice`)."""
    n = dst.shape[dim]
    lo, hi = max(start, 0), min(start + grad.shape[dim], n)
    if hi > lo:
        dst.narrow(dim, lo, hi - lo).add_(grad.narrow(dim, lo - start, hi - lo))


def band_unit(spec: HybridSpec, unit, xq, k, v, ks, vs):
    """Band tiles of one block: ``xq [B,H,T,D]`` the block's queries (compute dtype, unscaled),
    ``k``/``v`` the whole raw keys/values, ``ks``/``vs`` the sinks' (scaled keys, compute dtype).
    Returns ``(pb, ps, r, kbu, vbu, q6, start)`` of :func:`~hf_rfa.ops.band.recompute.band_tiles`
    with q6 the block's scaled query rows and ``start`` the key position of the band span's first
    entry."""
    plan = spec.plan
    t0, _, c0, c1, _ = unit
    L, c = c1 - c0, plan.c
    rows = window_slice(xq, 0, L * c, 2) * spec.root  # [B,H,L·C,D] (last block: padded rows)
    q6 = stack_rows(rows.unflatten(1, (plan.hkv, plan.g)), L, c)
    kb = vb = None
    start = t0 - plan.left
    if plan.window > 0:
        stop = start + L * c + plan.left + plan.right
        kb = window_slice(k, start, stop, 2).to(spec.ct) * spec.root
        vb = window_slice(v, start, stop, 2).to(spec.ct)
    pb, ps, r, kbu, vbu = band_tiles(plan, c0, c1, q6, kb, vb, ks, vs)
    return pb, ps, r, kbu, vbu, q6, start


def band_partial(spec: HybridSpec, unit, pb, ps, r, vbu, vs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's exact ``(num [B,Hkv,G,T,Dv], den, ls [B,Hkv,G,T])`` from its tiles."""
    t0, t1 = unit[0], unit[1]
    g, c = spec.plan.g, spec.plan.c
    num, den = band_numden(pb, ps, vbu, vs)
    num = unstack_rows(num, g, c)[..., : t1 - t0, :]
    den = unstack_rows(den.unsqueeze(-1), g, c)[..., : t1 - t0, 0]
    ls = unstack_rows(r.unsqueeze(-1), g, c)[..., : t1 - t0, 0]
    return num, den, ls


class HybridInputs(NamedTuple):
    """The tensors of :class:`~hf_rfa.ops.hybrid.function.HybridFunction` before its parameters, in
    its input order: q, k, v, the feature inputs ``fq``/``fk`` (or None), the rotary embedding
    ``cos``/``sin`` to undo (or None), the feature mask and the gate terms (or None)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fq: torch.Tensor | None
    fk: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    feat_mask: torch.Tensor | None
    lq_add: torch.Tensor | None
    lk_add: torch.Tensor | None


def feature_inputs(spec: HybridSpec, unit, xq, x) -> list:
    """The scan's inputs for the block's queries ``[t0, t1)``: ``xq`` (the block's queries), keys
    (``x.fk``, else ``x.k``), values, feature mask and key gate term delayed by W (key ``t − W``
    for query ``t``; none for ``t < W``), the block's query gate term. Keys/values in the compute
    dtype; with ``x.cos``/``x.sin`` ``[B|1, N, Dr]`` the delayed keys un-rotated at their own
    positions. ``x``: the call's :class:`HybridInputs` (or anything with those fields)."""
    k = x.k if x.fk is None else x.fk
    v, feat_mask, lq_add, lk_add, cos, sin = x.v, x.feat_mask, x.lq_add, x.lk_add, x.cos, x.sin
    t0, t1 = unit[0], unit[1]
    w, ct = spec.window, spec.ct
    kb = window_slice(k, t0 - w, t1 - w, 2).to(ct)
    if cos is not None:  # (the positions before 0 are zeros, masked: cos 1, sin 0 keeps them finite)
        kb = unrotate(kb, window_slice(cos, t0 - w, t1 - w, 1, 1.0), window_slice(sin, t0 - w, t1 - w, 1, 0.0))
    vb = window_slice(v, t0 - w, t1 - w, 2).to(ct)
    mb = window_slice(feat_mask, t0 - w, t1 - w, 1, False)
    lqb = lq_add[..., t0:t1] if lq_add is not None else None
    lkb = window_slice(lk_add, t0 - w, t1 - w, 2, 0.0)
    return [xq, kb, vb, mb, lqb, lkb]


def feature_unit(spec: HybridSpec, unit, S, ref, inputs: list):
    """Run the scan blocks of one unit from state ``(S, ref)``: ``(part, S', ref', states, refs)``
    with ``part`` the feature Partial of the unit's rows and the states entering each scan block."""
    scan = spec.scan
    idx = unit[4]
    sizes = [scan.plan[i][0] for i in idx]
    cut = [torch.split(x, sizes, dim=dim) if x is not None else [None] * len(sizes) for x, dim in zip(inputs, (2, 2, 2, 1, -1, -1))]
    outs, lss, states, refs = [], [], [], []
    for j, i in enumerate(idx):
        states.append(S)
        refs.append(ref)
        o, ls, S, ref = scan_block(scan, scan.plan[i][1], S, ref, tuple(x[j] for x in cut))
        outs.append(o)
        lss.append(ls)
    o = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    ls = torch.cat(lss, dim=-1) if len(lss) > 1 else lss[0]
    dv = o.shape[-1] - 1
    return Partial(o[..., :dv], o[..., dv], ls), S, ref, states, refs


def combine(spec: HybridSpec, band: Partial, feat: Partial | None) -> torch.Tensor:
    """``finalize(merge(band, feat))`` (the autograd form's order) → ``[B,Hkv,G,T,Dv]``."""
    return finalize(merge(band, feat) if feat is not None else band, spec.eps)


def sink_inputs(spec: HybridSpec, k, v) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sinks' scaled keys and values ``[B,Hkv,S,·]`` in the compute dtype (None without)."""
    plan = spec.plan
    if plan.sinks == 0:
        return None, None
    idx = plan.spos[:, None, :, None]
    ks = torch.gather(k, 2, idx.expand(*k.shape[:2], plan.sinks, k.shape[-1])).to(spec.ct) * spec.root
    vs = torch.gather(v, 2, idx.expand(*v.shape[:2], plan.sinks, v.shape[-1])).to(spec.ct)
    return ks, vs


def initial_state(spec: HybridSpec, b: int, hkv: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty scan state ``(S [B,Hkv,F,Dv+1], ref [B,Hkv])``."""
    fdim = spec.scan.feature_map.feature_dim
    return state_matrix(LinearState.zeros(b, hkv, fdim, dv, device=device, dtype=spec.ct), spec.scan.scaled)


def block_queries(spec: HybridSpec, xq, fq, cos, sin, t0: int, t1: int) -> torch.Tensor:
    """What the scan reads for the queries ``[t0, t1)`` (``xq``: q's rows there, compute dtype):
    the feature input's rows, q's rows un-rotated, or ``xq``."""
    if fq is not None:
        return fq[:, :, t0:t1].to(spec.ct)
    if cos is not None:
        return unrotate(xq, cos[:, t0:t1], sin[:, t0:t1])
    return xq


__all__ = ["HybridInputs", "HybridSpec", "add_window", "band_partial", "band_unit", "block_queries", "combine", "feature_inputs", "feature_unit", "initial_state", "plan_units", "sink_inputs", "window_slice"]
