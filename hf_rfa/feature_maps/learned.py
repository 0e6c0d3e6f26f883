"""Deterministic and learned feature maps (no random estimate of softmax; trained instead).

- ``elu``: elu(x) + 1 (Katharopoulos et al. 2020, "Transformers are RNNs"). Feature dim = D.
- ``hedgehog``: softmax over features of ``[xW, −xW]`` (Zhang et al. 2024, "The Hedgehog & the
  Porcupine"), W trainable, identity-initialised; separate W for queries and keys, optionally
  per head. Feature dim = 2m. Used by attention transfer (LoLCATs). With ``hybrid_mix=True`` it
  also learns a per-head log-scale ``mix`` (returned as the queries' ``Features.log_scale``): the
  weight of the feature part relative to the exact window/sinks of a hybrid (LoLCATs' window
  factors). It does not change pure linear attention (a per-query constant cancels). With
  ``norm_preserving=True`` (after STILL's norm-preserved feature map, arXiv 2602.02180: the
  feature's direction from the learned map, its magnitude the input's) the feature of ``x`` is
  ``‖x‖ · h(x) / ‖h(x)‖`` (h the softmax features): its 2-norm is the (scaled) query's or key's
  own, which the softmax features (summing to 1 whatever the input) discard.
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


def norm_preserved(h: torch.Tensor, x: torch.Tensor) -> Features:
    """The norm-preserving features of inputs ``x [..., D]`` with learned features ``h [..., F]``
    in the ops' bounded form: ``phi = h / ‖h‖`` (unit rows) and ``log_scale = log ‖x‖``, so that
    ``phi · exp(log_scale)`` is :func:`norm_preserved_reference`'s ``‖x‖ · h / ‖h‖`` (a zero
    input gets log scale log 1e-30: features ≈ 0, finite)."""
    norm_h = torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp_min(1e-30)
    norm_x = torch.linalg.vector_norm(x, dim=-1).clamp_min(1e-30)
    return Features(h / norm_h, torch.log(norm_x))


def norm_preserved_reference(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The readable twin of :func:`norm_preserved`: ``‖x‖ · h / ‖h‖`` as one (unbounded) tensor."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True) * h / torch.linalg.vector_norm(h, dim=-1, keepdim=True)


@register_feature_map("hedgehog")
class HedgehogFeatures(_LearnedProjection):
    """softmax([xW, −xW]) over the feature axis; W identity-initialised (F = 2m).

    Args:
        hybrid_mix: learn a per-head log-scale of the feature part (``mix [hq]``), returned as
            the queries' log scale, so a hybrid can weigh feature vs exact (window, sinks) keys.
        mix_init: initial value of ``mix`` (attention transfer re-initialises it from data).
        norm_preserving: rescale each feature vector to the 2-norm of its input
            (:func:`norm_preserved`; the scale goes into the log scale, queries' and keys').
    """

    def __init__(
        self, head_dim: int, num_features: int, seed: int = 0, hybrid_mix: bool = False, mix_init: float = 0.0, norm_preserving: bool = False, **kw
    ) -> None:
        super().__init__(head_dim, num_features, seed, **kw)
        for name, value in (("hybrid_mix", hybrid_mix), ("norm_preserving", norm_preserving)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self.hybrid_mix = hybrid_mix
        self.norm_preserving = norm_preserving
        if hybrid_mix:
            self.mix = nn.Parameter(torch.full((self.weight_q.shape[0],), float(mix_init)))

    def _init_weight(self, heads: int) -> torch.Tensor:
        return torch.eye(self.head_dim, self.num_features).unsqueeze(0).repeat(heads, 1, 1)

    @property
    def feature_dim(self) -> int:
        return 2 * self.num_features

    def _features(self, x: torch.Tensor, w: torch.Tensor) -> Features:
        p = self._project(x, w)
        h = torch.softmax(torch.cat([p, -p], dim=-1), dim=-1)
        return norm_preserved(h, upcast(x)) if self.norm_preserving else Features(h, None)

    def unmixed_queries(self, x: torch.Tensor) -> Features:
        """The queries' features without the hybrid ``mix`` (what :meth:`forward_queries` scales)."""
        return self._features(x, self.weight_q)

    def forward_queries(self, x: torch.Tensor) -> Features:
        f = self._features(x, self.weight_q)
        if not self.hybrid_mix:
            return f
        mix = per_head(self.mix.to(f.phi.dtype), x.shape[1]).expand(f.phi.shape[:-1])  # [B,H,N]
        return Features(f.phi, mix if f.log_scale is None else f.log_scale + mix)

    def forward_keys(self, x: torch.Tensor) -> Features:
        return self._features(x, self.weight_k)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", norm_preserving=True" if self.norm_preserving else "")


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
