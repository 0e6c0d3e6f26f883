"""``none``: no feature part at all — the window-only baseline.

With ``RFAConfig(feature_map="none", window=W, sinks=S)`` every query attends exactly (softmax) to
its window and the sinks, and every other key is dropped: sliding-window attention with attention
sinks (StreamingLLM, Xiao et al. 2023). It is the strongest trivial baseline a random-feature
recipe has to beat with the same window and sinks, and it decodes with the same constant-memory
cache (its linear state has zero features).
"""

from __future__ import annotations

import torch

from .base import FeatureMap, Features
from .registry import register_feature_map


@register_feature_map("none")
class NoFeatures(FeatureMap):
    """Keys outside the exact window and the sinks get zero weight (no features are computed).

    The ops check :attr:`null` and skip the feature part; calling the map itself is an error.
    """

    null = True

    @property
    def feature_dim(self) -> int:
        return 0

    def forward_queries(self, x: torch.Tensor) -> Features:
        raise ValueError("feature_map='none' has no features: the ops skip the feature part (window/sinks only)")

    forward_keys = forward_queries
