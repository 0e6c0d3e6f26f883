"""Deterministic and learned feature maps (no random estimate of softmax; trained instead).

- ``elu``: elu(x) + 1 (Katharopoulos et al. 2020, "Transformers are RNNs"). Feature dim = D.
- ``hedgehog``: softmax over features of ``[xW, −xW]`` (Zhang et al. 2024, "The Hedgehog & the
  Porcupine"), W trainable, identity-initialised; separate W for queries and keys, optionally
  per head. Feature dim = 2m. Used by attention transfer (LoLCATs). With ``hybrid_mix=True`` it
  also learns a per-head log-scale ``mix`` (returned as the queries' ``Features.log_scale``): the
  weight of the feature part relative to the exact window/sinks of a hybrid (LoLCATs' window
  factors). It does not change pure linear attention (a per-query constant cancels).
- ``t2r``: ReLU(xW + b) (Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs"),
  W initialised from the seeded generator. Feature dim = m.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import FeatureMap, Features, upcast, generator_for, per_head
from .registry import register_feature_map


@register_feature_map("elu")
class EluFeatures(FeatureMap):
    """elu(x)+1, no parameters, no randomness; ``num_features`` is ignored (F = D)."""

    positive = True
    eps = 1e-6

    @property
    def feature_dim(self) -> int:
        return self.head_dim

    def forward_queries(self, x: torch.Tensor) -> Features:
        return Features(F.elu(upcast(x)) + 1, None)

    forward_keys = forward_queries


class _LearnedProjection(FeatureMap):
    """Learned per-head (or shared) projections W_q ``[hq, D, m]`` and W_k ``[hk, D, m]``."""

    positive = True
    eps = 1e-6

    def __init__(self, head_dim: int, num_features: int, seed: int = 0, **kw) -> None:
        super().__init__(head_dim, num_features, seed, **kw)
        hq, hk = self.num_heads or 1, self.num_kv_heads or 1
        self.weight_q = nn.Parameter(self._init_weight(hq))
        self.weight_k = nn.Parameter(self._init_weight(hk))

    def _init_weight(self, heads: int) -> torch.Tensor:
        raise NotImplementedError

    def _project(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [B,H,N,D] @ W [h,D,m]`` → ``[B,H,N,m]``."""
        x = upcast(x)
        w = per_head(w.to(x.dtype), x.shape[1]).squeeze(2)  # [1,H,D,m]
        return x @ w


@register_feature_map("hedgehog")
class HedgehogFeatures(_LearnedProjection):
    """softmax([xW, −xW]) over the feature axis; W identity-initialised (F = 2m).

    Args:
        hybrid_mix: learn a per-head log-scale of the feature part (``mix [hq]``), returned as
            the queries' log scale, so a hybrid can weigh feature vs exact (window, sinks) keys.
        mix_init: initial value of ``mix`` (attention transfer re-initialises it from data).
    """

    def __init__(self, head_dim: int, num_features: int, seed: int = 0, hybrid_mix: bool = False, mix_init: float = 0.0, **kw) -> None:
        super().__init__(head_dim, num_features, seed, **kw)
        if not isinstance(hybrid_mix, bool):
            raise ValueError(f"hybrid_mix must be a bool, got {hybrid_mix!r}")
        self.hybrid_mix = hybrid_mix
        if hybrid_mix:
            self.mix = nn.Parameter(torch.full((self.weight_q.shape[0],), float(mix_init)))

    def _init_weight(self, heads: int) -> torch.Tensor:
        return torch.eye(self.head_dim, self.num_features).unsqueeze(0).repeat(heads, 1, 1)

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    def _features(self, x: torch.Tensor, w: torch.Tensor) -> Features:
        p = self._project(x, w)
        return Features(torch.softmax(torch.cat([p, -p], dim=-1), dim=-1), None)

    def forward_queries(self, x: torch.Tensor) -> Features:
        f = self._features(x, self.weight_q)
        if not self.hybrid_mix:
            return f
        mix = per_head(self.mix.to(f.phi.dtype), x.shape[1])  # [1,H,1]
        return Features(f.phi, mix.expand(f.phi.shape[:-1]))

    def forward_keys(self, x: torch.Tensor) -> Features:
        return self._features(x, self.weight_k)


@register_feature_map("t2r")
class T2RFeatures(_LearnedProjection):
    """ReLU(xW + b), W ~ N(0, 1/D) from the seeded generator, b = 0 (F = m)."""

    def __init__(self, head_dim: int, num_features: int, seed: int = 0, **kw) -> None:
        super().__init__(head_dim, num_features, seed, **kw)
        self.bias_q = nn.Parameter(torch.zeros(self.weight_q.shape[0], num_features))
        self.bias_k = nn.Parameter(torch.zeros(self.weight_k.shape[0], num_features))

    def _init_weight(self, heads: int) -> torch.Tensor:
        g = generator_for(self.seed, 0)
        w = torch.randn(self.head_dim, self.num_features, generator=g) / math.sqrt(self.head_dim)
        return w.unsqueeze(0).repeat(heads, 1, 1)

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def forward_queries(self, x: torch.Tensor) -> Features:
        p = self._project(x, self.weight_q)
        b = per_head(self.bias_q.to(p.dtype), x.shape[1])  # [1,H,1,m]
        return Features(F.relu(p + b), None)

    def forward_keys(self, x: torch.Tensor) -> Features:
        p = self._project(x, self.weight_k)
        b = per_head(self.bias_k.to(p.dtype), x.shape[1])
        return Features(F.relu(p + b), None)
