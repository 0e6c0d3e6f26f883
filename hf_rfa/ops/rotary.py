"""The rotary position embedding undone, and the adjoint of that (for a hand-written backward).

transformers' convention (``apply_rotary_pos_emb`` with ``rotate_half``): the two halves of the
first ``Dr = cos.shape[-1]`` dims form the rotated pairs, dims beyond ``Dr`` are not rotated, and
x is rotated to ``x·cos + rotate_half(x)·sin``. :func:`unrotate` inverts that;
:func:`unrotate_adjoint` is its transpose (the gradient of ``unrotate(x)`` with respect to x,
given the gradient of the result). The recomputing hybrid (:mod:`hf_rfa.ops.hybrid.function`)
un-rotates q and k block by block in forward and backward with these, so nothing un-rotated is
kept for backward (``random_feature_attention(feature_rope=(cos, sin))``).
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for the two halves ``x1, x2`` of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _terms(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cos, sin [B|1, 1, N, Dr]`` in x's dtype and the rotation's squared scale ``cos² + sin²``."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return cos, sin, cos * cos + sin * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo ``x·cos + rotate_half(x)·sin``: x ``[B, H, N, D]``, cos/sin ``[B or 1, N, Dr]`` (Dr ≤ D,
    even) → ``[B, H, N, D]`` in x's dtype. Rotations with a scale (``cos² + sin² ≠ 1``, e.g.
    YaRN's attention factor) are divided out. float16 / bfloat16 inputs are un-rotated and returned
    in float32 (a finite half-precision key can leave float16's range while it is un-rotated)."""
    dr = cos.shape[-1]
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    cos, sin, den = _terms(x, cos, sin)
    xr = x[..., :dr]
    out = (xr * cos - rotate_half(xr) * sin) / den
    return out if dr == x.shape[-1] else torch.cat([out, x[..., dr:]], dim=-1)


def unrotate_adjoint(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`unrotate` applied to ``g [B, H, N, D]`` (the gradient of its input):
    ``(g·cos + rotate_half(g·sin)) / (cos² + sin²)`` on the rotated dims, g itself beyond them."""
    dr = cos.shape[-1]
    cos, sin, den = _terms(g, cos, sin)
    gr = g[..., :dr] / den
    out = gr * cos + rotate_half(gr * sin)
    return out if dr == g.shape[-1] else torch.cat([out, g[..., dr:]], dim=-1)


def far_queries(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Un-rotated queries x ``[..., D]`` (float) turned so that their product with an *un-rotated* key
    scores as a rotated query with a rotated key at distance Δ: ``rope = (cos, sin)`` ``[Dr]`` of
    position Δ. For a rotation with a scale a (``cos² + sin² = a²``, e.g. YaRN's attention
    factor) the product of two rotated vectors carries a²: ``R_Δ(x)·a``. The exact memory reads its
    keys beyond ``memory_distance`` so (:mod:`hf_rfa.ops.memory`)."""
    cos, sin = (t.to(device=x.device, dtype=x.dtype) for t in rope)
    dr = cos.shape[-1]
    xr = x[..., :dr]
    out = (xr * cos + rotate_half(xr) * sin) * (cos * cos + sin * sin).sqrt()
    return out if dr == x.shape[-1] else torch.cat([out, x[..., dr:]], dim=-1)


def check_rope(rope, q: torch.Tensor, k: torch.Tensor, name: str = "feature_rope") -> tuple[torch.Tensor, torch.Tensor]:
    """``rope = (cos, sin)``, each ``[B or 1, N, Dr]`` with N = q's and k's length and Dr ≤ D even;
    ValueError naming ``name`` otherwise."""
    if not isinstance(rope, (tuple, list)) or len(rope) != 2 or not all(isinstance(t, torch.Tensor) for t in rope):
        raise ValueError(f"{name} must be a pair of tensors (cos, sin), got {type(rope).__name__}")
    cos, sin = rope
    b, n, d = q.shape[0], q.shape[2], q.shape[3]
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, b) or cos.shape[1] != n or k.shape[2] != n:
        raise ValueError(f"{name}: cos/sin must be [B or 1, N, Dr] = [{b} or 1, {n}, Dr] with as many keys as queries, got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, {k.shape[2]} keys")
    if cos.shape[-1] > d or cos.shape[-1] % 2 or cos.shape[-1] == 0:
        raise ValueError(f"{name}: rotary dim {cos.shape[-1]} must be even, > 0 and <= the head dim {d}")
    if not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"{name}: cos/sin must be floating point, got {cos.dtype}/{sin.dtype}")
    if not torch.compiler.is_compiling():
        scale = cos.double() ** 2 + sin.double() ** 2
        if not bool(torch.isfinite(scale).all()) or bool((scale < 1e-4).any()):
            raise ValueError(f"{name}: cos/sin must be finite with cos² + sin² > 0 (a rotation, possibly scaled), got cos² + sin² in [{scale.min().item():.3g}, {scale.max().item():.3g}]")
    return cos, sin


__all__ = ["check_rope", "far_queries", "rotate_half", "unrotate", "unrotate_adjoint"]
