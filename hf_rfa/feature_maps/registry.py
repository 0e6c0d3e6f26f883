"""Registry of feature maps by name: ``register_feature_map``, ``build_feature_map``."""

from __future__ import annotations

from typing import Any

import re
from typing import Callable, TypeVar

from .base import FeatureMap

_REGISTRY: dict[str, type[FeatureMap]] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_+\-]*$")

T = TypeVar("T", bound=type[FeatureMap])


def register_feature_map(name: str) -> Callable[[T], T]:
    """Class decorator registering a :class:`FeatureMap` subclass under ``name``.

    Raises ValueError for a malformed or already registered name.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"feature map name {name!r} must match {_NAME.pattern}")
    if name in _REGISTRY:
        raise ValueError(f"feature map {name!r} is already registered ({_REGISTRY[name].__name__})")

    def deco(cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise ValueError(f"{cls!r} registered as {name!r} is not a FeatureMap subclass")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def available_feature_maps() -> list[str]:
    """Names of all registered feature maps, sorted."""
    return sorted(_REGISTRY)


def feature_map_class(name: str) -> type[FeatureMap]:
    """The class registered under ``name``; ValueError listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown feature_map {name!r}; valid names: {', '.join(available_feature_maps())}"
        ) from None


def build_feature_map(
    name: str, head_dim: int, num_features: int = 256, seed: int = 0, **options: Any
) -> FeatureMap:
    """Build the feature map ``name`` for heads of size ``head_dim``.

    Args:
        name: one of :func:`available_feature_maps`.
        head_dim: D.
        num_features: m, random projections (or learned features).
        seed: base seed; projections are drawn from ``(seed, step=0)``.
        **options: map-specific options (e.g. ``orthogonal``, ``gate``, ``num_heads``).
    Raises:
        ValueError: unknown name, bad sizes or unknown options.
    """
    cls = feature_map_class(name)
    try:
        return cls(head_dim=head_dim, num_features=num_features, seed=seed, **options)
    except TypeError as e:  # unknown keyword
        raise ValueError(f"bad options for feature map {name!r}: {e}") from None
