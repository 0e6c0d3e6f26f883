"""Input validation and the masks shared by the ops: padding masks, sinks, sentinels."""

from __future__ import annotations

import functools
import math

import torch

#: finite stand-in for −∞ in log space (exp(NEG − x) == 0, NEG − NEG == 0, never NaN)
NEG = -1e30


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether an autograd graph would be recorded through any of ``tensors`` (None ignored):
    the one test that picks between the autograd forms and the in-place/inference forms."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def no_autocast(fn):
    """Run an op with autocast switched off (features, states and sums stay float32 under
    ``torch.autocast``; the op itself converts its inputs and returns q's dtype). Under autocast
    the matmuls would otherwise run in bf16/fp16 and mix dtypes with the fp32 sums."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        dev = x.device.type if x is not None else "cpu"
        if not torch.is_autocast_enabled(dev):
            return fn(*args, **kwargs)
        with torch.autocast(dev, enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def exp_floor(dtype: torch.dtype) -> float:
    """Smallest exponent whose exp is still a *normal* number of ``dtype`` (≈ −86.3 for float32
    and bfloat16, −707 for float64). Large exponentials are clamped to it before ``exp`` in the
    inference kernels: results below it would be denormal, and producing denormals makes
    ``exp`` (and the FMAs that consume them) take a microcode slow path on x86 — measured 50×
    slower for a [96, 64, 64] block on this project's CPU. The clamp changes a weight of
    < 3.2e-38 (e × the smallest normal; relative to the block's largest weight, 1) into 3.2e-38.
    """
    return math.log(torch.finfo(dtype).tiny) + 1.0


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[int, int, int, int, int, int]:
    """Check shapes; return ``(B, H, Nq, D, Hkv, Nk)``. Raises ValueError naming the problem."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, N, D], got shape {tuple(x.shape)}")
    b, h, nq, d = q.shape
    bk, hkv, nk, dk = k.shape
    if dk != d:
        raise ValueError(f"head-dim mismatch: q has D={d}, k has D={dk}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in [B, Hkv, Nk]")
    if bk != b:
        raise ValueError(f"batch mismatch: q has B={b}, k has B={bk}")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be divisible by key/value heads ({hkv})")
    if causal and nq > nk:
        raise ValueError(f"causal attention needs Nq <= Nk (queries are the last Nq keys), got Nq={nq}, Nk={nk}")
    return b, h, nq, d, hkv, nk


def key_mask_bool(attention_mask: torch.Tensor | None, b: int, nk: int, device) -> torch.Tensor | None:
    """Validate a 2-D padding mask ``[B, Nk]`` (1/True = real token) and return it as bool."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (b, nk):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of shape [B, Nk] = [{b}, {nk}], "
            f"got {tuple(attention_mask.shape)}"
        )
    return attention_mask.to(device=device).bool() if attention_mask.dtype != torch.bool else attention_mask.to(device)


def sink_mask(key_mask: torch.Tensor | None, b: int, nk: int, sinks: int, device) -> torch.Tensor:
    """``[B, Nk]`` bool: the first ``sinks`` real (non-padded) tokens of each sequence."""
    if key_mask is None:
        return (torch.arange(nk, device=device) < sinks).view(1, nk).expand(b, nk)
    rank = torch.cumsum(key_mask.long(), dim=-1) - 1
    return key_mask & (rank < sinks)


def sink_positions(key_mask: torch.Tensor | None, b: int, nk: int, sinks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[B, S]`` (long) of the first S real tokens and whether each exists ``[B, S]``."""
    sm = sink_mask(key_mask, b, nk, sinks, device)
    rank = torch.cumsum(sm.long(), dim=-1) - 1  # rank among sinks
    idx = torch.arange(sinks, device=device).view(1, sinks, 1)
    hit = sm.unsqueeze(1) & (rank.unsqueeze(1) == idx)  # [B,S,Nk]
    exists = hit.any(-1)
    pos = hit.long().argmax(-1)
    return pos, exists
