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


#: largest chunk length of the causal forms (their tiles are C × C per head and thread)
MAX_CHUNK = 4096
#: largest number of attention sinks (sink positions take B·S·N booleans)
MAX_SINKS = 4096


def check_int(name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]``, else ValueError naming
    ``name`` and the range."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


def check_scale(scale) -> float | None:
    """``scale`` as a float (None stays None); ValueError unless it is a finite number > 0 (the
    maps read q·√scale and k·√scale)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(float(scale)) or float(scale) <= 0:
        raise ValueError(f"scale must be a finite number > 0 or None, got {scale!r}")
    return float(scale)


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[int, int, int, int, int, int]:
    """Check shapes, dtypes and devices; return ``(B, H, Nq, D, Hkv, Nk)``. Raises ValueError
    naming the problem. Zero B, N or Dv are valid (an empty result); zero heads or D are not."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, N, D], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"q, k, v must be on one device, got q on {q.device} and {name} on {x.device}")
    b, h, nq, d = q.shape
    bk, hkv, nk, dk = k.shape
    if h < 1 or hkv < 1:
        raise ValueError(f"q and k need at least one head, got H={h}, Hkv={hkv}")
    if d < 1:
        raise ValueError(f"head dim D must be >= 1, got q shape {tuple(q.shape)}")
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
    if attention_mask.is_floating_point() and not torch.compiler.is_compiling():
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()) or not bool((attention_mask == 1).any()):
            raise ValueError(
                "attention_mask is a float tensor that is not a 0/1 padding mask with some 1 (an additive 0/-inf mask? "
                "all zeros reads as all padded): pass a padding mask (1/True = real token, 0/False = padding), e.g. additive_mask == 0"
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


def _all_finite(*tensors: torch.Tensor) -> bool:
    """Cheap test that no entry is NaN/±inf: a float32 sum of each tensor is finite (NaN and inf
    propagate; a sum that overflows from finite values only sends the caller to its exact check)."""
    return all(bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))) for t in tensors)


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous *with the canonical strides of its shape* (a view when it already is
    contiguous). ``Tensor.contiguous`` keeps any stride of a size-1 dimension (a transposed
    ``[B, N, 1, D]`` view is "contiguous" with another stride than a fresh ``[B, 1, N, D]`` tensor),
    and the matmul kernels pick their blocking, hence their summation order, from the strides:
    two tensors with the same values but such strides give results that differ in the last bits."""
    x = x.contiguous()
    return x.view(-1).view(x.shape) if x.dim() > 1 else x


def _zero_nonfinite(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero padded keys/values and every non-finite query / real key-value position; return
    ``(q, k, v, qbad [B, H, Nq], kbad [B, Hkv, Nk])`` (bad: the position held a NaN/±inf)."""
    if key_mask is not None:
        pad = ~key_mask[:, None, :, None]
        k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
    qbad = ~torch.isfinite(q).all(-1)  # [B,H,Nq]
    kbad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # [B,Hkv,Nk] (padded: already 0)
    q, k, v = q.masked_fill(qbad[..., None], 0), k.masked_fill(kbad[..., None], 0), v.masked_fill(kbad[..., None], 0)
    return q, k, v, qbad, kbad


def guard_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keep padded and non-finite positions out of every other row's output.

    Finite padded keys/values are already excluded exactly by the ops (masked features, ``NEG``
    log scales); when any input is non-finite, padded keys/values (``key_mask [B, Nk]`` False) are
    zeroed, so whatever they hold changes nothing. A non-finite query, or a non-finite real
    key/value, is zeroed too and the rows that
    would see it (softmax makes them NaN: itself for a query; causal: the rows at or after the
    key; bidirectional: every row) are returned as ``poison [B, H, Nq]`` for the caller to set to
    NaN — so no row's output depends, even through a shared maximum or a 0·inf, on positions it
    does not attend to. ``poison`` is None when every input is finite (checked eagerly; under
    ``torch.compile`` it is always computed, without a data-dependent branch).

    q ``[B, H, Nq, D]``, k ``[B, Hkv, Nk, D]``, v ``[B, Hkv, Nk, Dv]`` → the same shapes.
    """
    compiling = torch.compiler.is_compiling()
    # both branches hand on dense tensors with the canonical strides of their shape (:func:`dense`):
    # the same strides give the same summation order, so rows that see no non-finite input are
    # bit-identical whether or not another row does
    if not compiling and _all_finite(q, k, v):  # the common case: the ops mask padded keys exactly
        return dense(q), dense(k), dense(v), None
    q, k, v, qbad, kbad = _zero_nonfinite(q, k, v, key_mask)
    return dense(q), dense(k), dense(v), _key_poison(kbad, causal, q.shape[2], q.shape[1] // k.shape[1]) | qbad


def _key_poison(kbad: torch.Tensor, causal: bool, nq: int, g: int) -> torch.Tensor:
    """Query rows ``[B, H, Nq]`` that see a bad real key ``kbad [B, Hkv, Nk]`` (softmax makes them
    NaN): causal, query i is key position Nk − Nq + i and sees every key up to it; bidirectional,
    every row."""
    b, hkv, nk = kbad.shape
    if causal:
        seen = (torch.cumsum(kbad.to(torch.int32), dim=-1) > 0)[..., nk - nq :]
    else:
        seen = kbad.any(-1, keepdim=True).expand(b, hkv, nq)
    return seen.repeat_interleave(g, dim=1)


def guard_feature_inputs(
    feature_q: torch.Tensor, feature_k: torch.Tensor, key_mask: torch.Tensor | None, causal: bool, poison: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`guard_inputs` for the feature part's own inputs (``feature_q [B, H, Nq, D]``,
    ``feature_k [B, Hkv, Nk, D]``): non-finite rows are zeroed and the rows softmax would make NaN
    (a bad query itself; those that see a bad real key) are added to ``poison`` (None: none yet)."""
    if not torch.compiler.is_compiling() and _all_finite(feature_q, feature_k):
        return dense(feature_q), dense(feature_k), poison
    qbad, kbad = ~torch.isfinite(feature_q).all(-1), ~torch.isfinite(feature_k).all(-1)
    feature_q, feature_k = dense(feature_q.masked_fill(qbad[..., None], 0)), dense(feature_k.masked_fill(kbad[..., None], 0))
    if key_mask is not None:  # a padded key is zeroed but poisons nothing
        kbad = kbad & key_mask[:, None, :]
    rows = qbad | _key_poison(kbad, causal, feature_q.shape[2], feature_q.shape[1] // feature_k.shape[1])
    return feature_q, feature_k, rows if poison is None else poison | rows


def guard_continuation(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, past_bad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`guard_inputs` for causal decoding: ``n`` new tokens continuing a summarised past.

    q ``[B, H, n, D]``, k ``[B, Hkv, n, D]``, v ``[B, Hkv, n, Dv]`` (the new tokens), key_mask
    ``[B, n]`` bool or None, ``past_bad [B, Hkv]`` bool: an earlier real key/value of that head
    was non-finite. Returns ``(q, k, v, poison [B, H, n] or None, bad [B, Hkv])``: the inputs with
    padded and non-finite positions zeroed (only when some input is non-finite), the new rows
    softmax makes NaN (after a bad key of their head, earlier or new, or a bad query: the row
    itself; None when the inputs are finite and no head was flagged before), and ``past_bad``
    updated for the next call — so the decoding state only ever holds finite numbers
    and the rows of other heads, batch rows and earlier positions are untouched.
    """
    b, h, n, _ = q.shape
    hkv = k.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    # one sum (a decoding step runs this once per layer, so no per-tensor checks): any NaN/±inf
    # entry makes the total non-finite; a total that overflows from finite values only costs the
    # exact path below
    total = q.sum(dtype=ct) + k.sum(dtype=ct) + v.sum(dtype=ct)
    # both branches hand on dense tensors with canonical strides (:func:`dense`): the same
    # summation order whether or not another row holds a non-finite input
    if bool(torch.isfinite(total)) and not bool(past_bad.any()):
        return dense(q), dense(k), dense(v), None, past_bad
    before = past_bad[:, :, None].expand(b, hkv, n)
    q, k, v, qbad, kbad = _zero_nonfinite(q, k, v, key_mask)
    seen = before | (torch.cumsum(kbad.to(torch.int32), dim=-1) > 0)
    return dense(q), dense(k), dense(v), seen.repeat_interleave(h // hkv, dim=1) | qbad, past_bad | kbad.any(-1)


def to_output_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in ``dtype``; float16 is clamped to its finite range first (a signed map's floored
    normaliser can give values beyond 65504; NaN stays NaN)."""
    if dtype == torch.float16:
        fmax = torch.finfo(torch.float16).max
        out = out.clamp(-fmax, fmax)
    return out.to(dtype)


def check_feature_map(feature_map, head_dim: int) -> None:
    """ValueError unless ``feature_map`` is a hf_rfa feature map for head dim ``head_dim``."""
    if not all(hasattr(feature_map, a) for a in ("forward_queries", "forward_keys", "eps", "has_gate")):
        raise ValueError(f"feature_map must be a hf_rfa FeatureMap (see hf_rfa.build_feature_map), got {type(feature_map).__name__}")
    if getattr(feature_map, "head_dim", head_dim) != head_dim:
        raise ValueError(f"feature map head_dim={feature_map.head_dim} does not match q/k head dim D={head_dim}")


def check_feature_inputs(q, k, feature_q, feature_k):
    """``feature_q``/``feature_k`` checked against q ``[B, H, Nq, D]`` and k ``[B, Hkv, Nk, D]``
    (ValueError naming the bad one); returns them (both None: the feature part reads q and k)."""
    if (feature_q is None) != (feature_k is None):
        raise ValueError("feature_q and feature_k go together: give both (the feature part's queries and keys) or neither")
    if feature_q is None:
        return None, None
    for name, x, ref in (("feature_q", feature_q, q), ("feature_k", feature_k, k)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(ref.shape):
            raise ValueError(f"{name} must have the shape of {name[-1]} {tuple(ref.shape)}, got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if not x.is_floating_point() or x.device != ref.device:
            raise ValueError(f"{name} must be a floating tensor on {ref.device}, got {x.dtype} on {x.device}")
    return feature_q, feature_k


class _SaturateGrad(torch.autograd.Function):
    """Identity forward; backward saturates a gradient that left float16's range at ±max (as the
    forward output is clamped by :func:`to_output_dtype`) instead of handing on ±inf."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        big = torch.finfo(grad.dtype).max
        return grad.nan_to_num(nan=float("nan"), posinf=big, neginf=-big)


def saturate_grad(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` whose float16 gradient saturates at ±65504 instead of overflowing (other dtypes: ``x``)."""
    if x is None or x.dtype != torch.float16 or not x.requires_grad:
        return x
    return _SaturateGrad.apply(x)


def shift_keys(x: torch.Tensor, shift: int, fill: float, dim: int = 2) -> torch.Tensor:
    """Delay a key-axis tensor by ``shift`` positions (front-filled with ``fill``), same length.

    Query t then sees original keys s ≤ t − shift: the feature part of a causal hybrid window.
    """
    n = x.shape[dim]
    if shift <= 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = min(shift, n)
    pad = torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)
    kept = x.narrow(dim, 0, max(n - shift, 0))
    return torch.cat([pad, kept], dim=dim)
