"""Incremental causal attention: a constant-size state continued by new tokens (generation)."""

from .continuation import DecodeCall, continue_attention
from .state import DecodeState

__all__ = ["DecodeCall", "DecodeState", "continue_attention"]
