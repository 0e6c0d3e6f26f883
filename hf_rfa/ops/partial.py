"""Partial attention results in log space, merged under ONE normaliser.

A :class:`Partial` holds a numerator, a denominator and the log scale they are expressed in:
the true numerator is ``num · exp(log_scale)``. Exact softmax over a local window and feature
estimates over the rest both produce Partials; :func:`merge` rescales them to their common
maximum (streaming-safe: each row's scale depends only on what that row sees) and
:func:`finalize` divides. This is how exp scores and feature estimates share one consistent
scale without overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import NEG


@dataclass
class Partial:
    """num ``[B, Hkv, G, N, Dv]``, den ``[B, Hkv, G, N]``, log_scale ``[B, Hkv, G, N]``."""

    num: torch.Tensor
    den: torch.Tensor
    log_scale: torch.Tensor


def last_rows(part: Partial, rows: int) -> Partial:
    """The Partial of the last ``rows`` query positions (itself when it has no more)."""
    if part.num.shape[-2] == rows:
        return part
    return Partial(part.num[..., -rows:, :], part.den[..., -rows:], part.log_scale[..., -rows:])


def merge(a: Partial | None, b: Partial | None) -> Partial:
    """Sum two Partials of the same rows, rescaled to the larger log scale."""
    if a is None or b is None:
        out = a if b is None else b
        if out is None:
            raise ValueError("merge needs at least one Partial")
        return out
    la, lb = _effective_scale(a), _effective_scale(b)
    m = torch.maximum(la, lb).detach()
    fa, fb = torch.exp(la - m), torch.exp(lb - m)
    return Partial(
        a.num * fa.unsqueeze(-1) + b.num * fb.unsqueeze(-1),
        a.den * fa + b.den * fb,
        m,
    )


def _effective_scale(p: Partial) -> torch.Tensor:
    """``p.log_scale`` with rows that hold nothing (den and num exactly 0: no key seen yet, e.g.
    the feature part of the first W + S causal rows of a map without log scales) set to NEG, so an
    empty part never sets the common scale of the merge (which would push the other part's
    normaliser under the eps floor)."""
    empty = (p.den == 0) & (p.num.detach().abs().amax(-1) == 0) if p.num.shape[-1] else p.den == 0
    return torch.where(empty, torch.full_like(p.log_scale, NEG), p.log_scale)


def finalize(p: Partial, eps: float) -> torch.Tensor:
    """``num / max(den, eps)`` → ``[B, Hkv, G, N, Dv]``.

    For non-negative features ``den > 0`` whenever a key is visible and ``eps`` is only a guard;
    for signed maps (rff, rfa) it is the documented floor of a normaliser that crossed zero.

    Gradients: the floor is relative to the row's stabilisation scale, which is a constant for
    differentiation everywhere in the ops (and in the quadratic twin, ``reference.py``): ``num``
    and ``den`` are re-expressed relative to ``log_scale.detach()`` before the floor. Where the
    log scale carries a gradient (a Partial that was never merged: the causal feature part alone,
    whose log scale holds the query's feature log scale and a gated map's cumulative log gate)
    this factor is 1 in value and only moves that gradient into ``num``/``den``, so that rows on
    the floor get the same gradient as in the twin and in merged hybrids. (Unfloored rows do not
    depend on the scale at all.)
    """
    if p.log_scale.requires_grad:
        unit = torch.exp(p.log_scale - p.log_scale.detach())  # == 1, carries d(log_scale)
        return (p.num * unit.unsqueeze(-1)) / (p.den * unit).clamp_min(eps).unsqueeze(-1)
    return p.num / p.den.clamp_min(eps).unsqueeze(-1)
