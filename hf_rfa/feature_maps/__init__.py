"""Feature maps: a registry of named maps (random Fourier, positive/FAVOR, learned)."""

from .base import FeatureMap, Features, derive_seed, generator_for
from .registry import available_feature_maps, build_feature_map, feature_map_class, register_feature_map

# importing the families registers them
from . import fourier, learned, none, positive  # noqa: E402,F401

__all__ = [
    "FeatureMap",
    "Features",
    "available_feature_maps",
    "build_feature_map",
    "derive_seed",
    "feature_map_class",
    "generator_for",
    "register_feature_map",
]
