"""Incremental causal attention: a constant-size state continued by new tokens (generation)."""

from .continuation import DecodeState, continue_attention

__all__ = ["DecodeState", "continue_attention"]
