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


@dataclass
class Partial:
    """num ``[B, Hkv, G, N, Dv]``, den ``[B, Hkv, G, N]``, log_scale ``[B, Hkv, G, N]``."""

    num: torch.Tensor
    den: torch.Tensor
    log_scale: torch.Tensor


def merge(a: Partial | None, b: Partial | None) -> Partial:
    """Sum two Partials of the same rows, rescaled to the larger log scale."""
    if a is None or b is None:
        out = a if b is None else b
        if out is None:
            raise ValueError("merge needs at least one Partial")
        return out
    m = torch.maximum(a.log_scale, b.log_scale).detach()
    fa, fb = torch.exp(a.log_scale - m), torch.exp(b.log_scale - m)
    return Partial(
        a.num * fa.unsqueeze(-1) + b.num * fb.unsqueeze(-1),
        a.den * fa + b.den * fb,
        m,
    )


def finalize(p: Partial, eps: float) -> torch.Tensor:
    """``num / max(den, eps)`` → ``[B, Hkv, G, N, Dv]``.

    For non-negative features ``den > 0`` whenever a key is visible and ``eps`` is only a guard;
    for signed maps (rff, rfa) it is the documented floor of a normaliser that crossed zero.
    """
    return p.num / p.den.clamp_min(eps).unsqueeze(-1)
