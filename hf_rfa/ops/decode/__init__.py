"""Incremental causal attention: a constant-size state continued by new tokens (generation)."""

from .continuation import continue_attention
from .state import DecodeState

__all__ = ["DecodeState", "continue_attention"]
