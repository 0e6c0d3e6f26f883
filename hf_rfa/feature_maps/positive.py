"""Positive random features for the softmax kernel.

``positive`` / ``favor+`` (Choromanski et al. 2021, "Rethinking Attention with Performers"):

    φ(x) = exp(ωᵀx − ‖x‖²/2) / √m,   E[φ(x)·φ(y)] = exp(x·y)

with i.i.d. Gaussian ω (``positive``) or block-orthogonal ω (``favor+``).

``favor++`` (Likhosherstov et al. 2022, "Chefs' Random Tables", optimised positive random
features, OPRF): φ(x) = (1−4A)^{d/4} exp(A‖ω‖² + √(1−4A)·ωᵀx − ‖x‖²/2) / √m, also unbiased for
any A < 1/8, with the variance-minimising

    A* = (1 − 2ρ − √((2ρ+1)² + 8ρ)) / 16,   ρ = mean ‖x_i + y_j‖² / d.

ρ is a buffer: set it from data with :meth:`FavorPlusPlus.calibrate` (conversion does this on
calibration text); the default ``rho=1.0`` is used otherwise. A is fixed during attention so
the estimator is streaming-safe.

All features are returned as ``exp(ωᵀx − max_j ωᵀx)`` with the per-token max and the per-token
terms (−‖x‖²/2, constants) in ``log_scale``, so they never overflow whatever the input norm.
"""

from __future__ import annotations

import math

import torch

from ..ops.backends.kernels import active as _kernel_active, compiled as _compiled
from ..ops.masks import exp_floor, needs_grad
from .base import Features, upcast
from .random_projections import RandomProjectionMap
from .registry import register_feature_map


def _positive_features(proj: torch.Tensor, token_term: torch.Tensor) -> Features:
    """Bounded features from log-features ``proj + token_term``.

    proj ``[B,H,N,m]`` (the part that varies over features), token_term ``[B,H,N]`` (the part
    that only varies per token, e.g. −‖x‖²/2 − ½ log m). The per-token max of ``proj`` is taken
    out (detached: the product phi·exp(log_scale) is unchanged) and the token term goes straight
    into ``log_scale`` — one pass over the features fewer than subtracting it first.
    """
    if _kernel_active(proj, token_term):
        return _compiled(_bounded_exp)(proj, token_term)
    c = proj.amax(dim=-1).detach()
    if needs_grad(proj, token_term):
        return Features(torch.exp(proj - c.unsqueeze(-1)), c + token_term)
    return Features(proj.sub_(c.unsqueeze(-1)).exp_(), c + token_term)  # no graph: in place


def _half_sq_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖²/2 over the last axis without a temporary of x's size."""
    return torch.linalg.vector_norm(x, dim=-1).square_().mul_(0.5) if not needs_grad(x) else 0.5 * x.pow(2).sum(-1)


def _bounded_exp(proj: torch.Tensor, token_term: torch.Tensor) -> Features:
    """The pure form of :func:`_positive_features` that :mod:`hf_rfa.ops.backends.kernels` compiles."""
    c = proj.amax(dim=-1)
    return Features(torch.exp(proj - c.unsqueeze(-1)), c + token_term)


@register_feature_map("positive")
class PositiveRandomFeatures(RandomProjectionMap):
    """exp(ωᵀx − ‖x‖²/2)/√m with i.i.d. Gaussian ω (``orthogonal=False`` by default)."""

    positive = True
    default_orthogonal = False

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def _affine(self, x_scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, float, float | torch.Tensor]:
        """The map's exponent as ``x Wᵀ + bias`` (per feature) plus ``coef·‖x‖² + c0`` (per token),
        for inputs multiplied by ``x_scale``: ``(W [m,D], bias [m] or None, coef, c0)``. The one
        place the form is written; autograd flows through ω."""
        w = self.omega.to(dtype)
        return (w * x_scale if x_scale != 1.0 else w), None, -0.5 * x_scale**2, -0.5 * math.log(self.num_features)

    def _log_features(self, x: torch.Tensor, out: torch.Tensor | None = None, x_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x Wᵀ + bias [B,H,N,m], coef·‖x‖² + c0 [B,H,N])`` of :meth:`_affine`; ``out``: where to
        write the first (no autograd). The scale multiplies ω and the norm, never x."""
        x = upcast(x)
        W, bias, coef, c0 = self._affine(x_scale, x.dtype)
        proj = torch.matmul(x, W.T, out=out)  # [B,H,N,m]
        if bias is not None:
            proj = proj.add_(bias) if out is not None else proj + bias
        return proj, _half_sq_norm(x).mul_(2 * coef).add_(c0)

    def native_params(self, x_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, float, float]:
        with torch.no_grad():
            W, bias, coef, c0 = self._affine(x_scale, torch.float32)
        return W, bias, coef, float(c0)

    def forward_queries(self, x: torch.Tensor) -> Features:
        return _positive_features(*self._log_features(x))

    forward_keys = forward_queries

    def features_into(self, x: torch.Tensor, out: torch.Tensor, is_query: bool, x_scale: float = 1.0) -> Features:
        with torch.no_grad():
            proj, token_term = self._log_features(x, out, x_scale)
            c = proj.amax(dim=-1)
            # floored exponents: features < 3.2e-38 of the token's largest could become denormals (slow)
            return Features(proj.sub_(c.unsqueeze(-1)).clamp_min_(exp_floor(proj.dtype)).exp_(), c.add_(token_term))


@register_feature_map("favor+")
class FavorPlus(PositiveRandomFeatures):
    """Performer's FAVOR+: positive features with block-orthogonal projections."""

    default_orthogonal = True


@register_feature_map("favor++")
class FavorPlusPlus(PositiveRandomFeatures):
    """Optimised positive random features (OPRF / FAVOR++) with a calibrated A."""

    default_orthogonal = True

    def __init__(self, head_dim: int, num_features: int, seed: int = 0, rho: float = 1.0, **kw) -> None:
        super().__init__(head_dim, num_features, seed, **kw)
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho < 0:
            raise ValueError(f"rho must be a finite number >= 0, got {rho!r}")
        self.register_buffer("rho", torch.tensor(float(rho)), persistent=True)

    @staticmethod
    def optimal_a(rho: torch.Tensor) -> torch.Tensor:
        """A*(ρ) = (1 − 2ρ − √((2ρ+1)² + 8ρ)) / 16 (≤ 0)."""
        return (1 - 2 * rho - torch.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16

    @torch.no_grad()
    def calibrate(self, xq: torch.Tensor, xk: torch.Tensor) -> float:
        """Set ρ = mean_{i,j} ‖x_i + y_j‖² / d from scaled queries/keys ``[..., D]``; returns ρ."""
        xq = xq.reshape(-1, self.head_dim).double()
        xk = xk.reshape(-1, self.head_dim).double()
        mean_pair = xq.pow(2).sum(-1).mean() + xk.pow(2).sum(-1).mean() + 2 * xq.mean(0) @ xk.mean(0)
        rho = float(mean_pair / self.head_dim)
        if not math.isfinite(rho):
            raise ValueError(f"calibrate needs finite queries and keys, got rho={rho}")
        self.rho.fill_(max(rho, 0.0))
        return rho

    def _affine(self, x_scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, float, float | torch.Tensor]:
        # √(1−4A)·ωᵀx + A‖ω_j‖² (the latter varies over features: the bias), const per token
        a = self.optimal_a(self.rho.to(dtype))
        w = self.omega.to(dtype)
        const = 0.25 * self.head_dim * torch.log(1 - 4 * a) - 0.5 * math.log(self.num_features)
        return w * (torch.sqrt(1 - 4 * a) * x_scale), a * w.pow(2).sum(-1), -0.5 * x_scale**2, const

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rho={float(self.rho):.3f}"
