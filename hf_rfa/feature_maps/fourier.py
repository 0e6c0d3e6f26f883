"""Trigonometric random features: ``rff`` (Rahimi & Recht) and ``rfa`` (Peng et al. 2021).

``rff``: the Gaussian kernel ``exp(−‖x−y‖²/2) = E[cos(ωᵀ(x−y))]``, ω ~ N(0, I), estimated with
sin/cos pairs ``[sin(Ωx), cos(Ωx)]/√m``; the softmax kernel follows from
``exp(x·y) = exp(‖x‖²/2)·exp(‖y‖²/2)·k_gauss(x, y)`` — the ``exp(‖x‖²/2)`` factor is returned
as ``log_scale``.

These features are *not* non-negative: estimated normalisers can be ≤ 0 (increasingly so for
peaked attention). The ops clamp such normalisers to a small positive floor (``eps`` of the map,
relative to the running stabilisation scale), so outputs stay finite but can be far from
softmax where the estimate is bad. Prefer positive maps for conversion.

``rfa``: random features of L2-normalised q, k with a learned per-(kv-)head scale σ:
``φ(x) = exp(σ²/2)·[sin(σΩx̂), cos(σΩx̂)]/√m`` estimates ``exp(σ² x̂·ŷ)`` — a softmax over cosine
similarities with learned temperature σ². With ``gate=True`` (causal attention only) a learned
sigmoid gate ``g_t = σ(w·k_t + b)`` makes the state decay: S_t = g_t S_{t−1} + (1−g_t) φ(k_t)v_tᵀ.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import Features, per_head, upcast
from .random_projections import RandomProjectionMap
from .registry import register_feature_map


class _TrigFeatures(RandomProjectionMap):
    positive = False
    #: floor for normalisers that can cross zero (see module docstring)
    eps = 1e-4

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    def _sincos(self, proj: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.sin(proj), torch.cos(proj)], dim=-1) / math.sqrt(self.num_features)


@register_feature_map("rff")
class RandomFourierFeatures(_TrigFeatures):
    """Random Fourier features of the Gaussian kernel, turned into the softmax kernel."""

    def forward_queries(self, x: torch.Tensor) -> Features:
        x = upcast(x)
        # ||x||²/2 overflows for a finite |x| >~ 1.8e19 (float32): bounded, so that one huge key
        # cannot make inf − inf in a shared offset (NaN in rows that never see it)
        half_sq = (0.5 * x.pow(2).sum(-1)).clamp_max(torch.finfo(x.dtype).max / 8)
        return Features(self._sincos(x @ self.omega.to(x.dtype).T), half_sq)

    forward_keys = forward_queries


@register_feature_map("rfa")
class RandomFeatureAttentionMap(_TrigFeatures):
    """RFA: sin/cos features of L2-normalised inputs with learned scale σ (and optional gate)."""

    def __init__(
        self,
        head_dim: int,
        num_features: int,
        seed: int = 0,
        orthogonal: bool = False,
        gate: bool = False,
        init_sigma: float = 1.0,
        init_gate_bias: float = 4.0,
        **kw,
    ) -> None:
        super().__init__(head_dim, num_features, seed, orthogonal, **kw)
        if init_sigma <= 0:
            raise ValueError(f"init_sigma must be > 0, got {init_sigma}")
        hk = self.num_kv_heads or 1
        self.log_sigma = nn.Parameter(torch.full((hk,), math.log(init_sigma)))
        self.has_gate = bool(gate)
        if self.has_gate:
            self.gate_weight = nn.Parameter(torch.zeros(hk, head_dim))
            self.gate_bias = nn.Parameter(torch.full((hk,), float(init_gate_bias)))

    def _sigma(self, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """σ for ``num_heads`` heads ``[num_heads]`` (query heads share their kv head's σ)."""
        sigma = self.log_sigma.to(dtype).exp()
        if sigma.shape[0] == 1 or sigma.shape[0] == num_heads:
            return sigma.expand(num_heads) if sigma.shape[0] == 1 else sigma
        if num_heads % sigma.shape[0]:
            raise ValueError(f"rfa map has σ for {sigma.shape[0]} kv heads, input has {num_heads} heads")
        return sigma.repeat_interleave(num_heads // sigma.shape[0])

    def _features(self, x: torch.Tensor) -> Features:
        x = upcast(x)
        xhat = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        sigma = self._sigma(x.shape[1], x.dtype).view(1, -1, 1, 1)
        phi = self._sincos((xhat @ self.omega.to(x.dtype).T) * sigma)
        log_scale = (0.5 * sigma.squeeze(-1) ** 2).expand(x.shape[:-1])
        return Features(phi, log_scale)

    forward_queries = _features
    forward_keys = _features

    def log_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, "gate_weight"):
            if getattr(self, "decay_log_rate", None) is not None:
                return super().log_gate(x)
            raise ValueError("this rfa map was built with gate=False")
        x = upcast(x)
        w = per_head(self.gate_weight.to(x.dtype), x.shape[1])  # [1,H,1,D]
        b = self.gate_bias.to(x.dtype)
        b = b.expand(x.shape[1]) if b.shape[0] == 1 else b
        z = (x * w).sum(-1) + b.view(1, -1, 1)
        return F.logsigmoid(z), F.logsigmoid(-z)
