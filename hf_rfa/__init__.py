"""hf_rfa: random feature attention as a drop-in ``attn_implementation`` for Hugging Face models.

Public API::

    hf_rfa.available_feature_maps()
    fm = hf_rfa.build_feature_map("favor+", head_dim=64, num_features=256, seed=0)
    out = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=0, sinks=0)
    ref = hf_rfa.softmax_attention(q, k, v, causal=True)
"""

from .feature_maps import FeatureMap, Features, available_feature_maps, build_feature_map, register_feature_map
from .ops import LinearState, quadratic_kernel_attention, random_feature_attention, softmax_attention

__version__ = "0.1.0"

__all__ = [
    "FeatureMap",
    "Features",
    "LinearState",
    "available_feature_maps",
    "build_feature_map",
    "quadratic_kernel_attention",
    "random_feature_attention",
    "register_feature_map",
    "softmax_attention",
]
