"""The exact window + sinks band of a causal hybrid through PyTorch's FlexAttention.

The band is the set of keys a causal query t answers exactly: the last W keys ``t − W < s ≤ t``
and the first S real tokens (the sinks), padded keys excluded — :mod:`hf_rfa.ops.hybrid`'s
definition. Here it is a ``mask_mod`` over (query, key) positions and a :class:`BlockMask` built
analytically from the window and the sinks' blocks (``O(N/bs · (W/bs + S))``, never N×N), and
``flex_attention`` returns the normalised band output with its log-sum-exp. That is a
:class:`~hf_rfa.ops.partial.Partial` whose log scale is the lse: ``num = out``, ``den = 1``
(``num · exp(lse)`` is the band's numerator, ``exp(lse)`` its denominator), merged with the feature
part under the shared normaliser by :func:`~hf_rfa.ops.partial.merge`.

The one difference from :func:`hf_rfa.ops.hybrid.exact_local` (whose log scale is the row's
maximum score): the eps floor of :func:`~hf_rfa.ops.partial.finalize` is then relative to the lse,
at most ``log(W + S)`` above the maximum; it binds only where a signed map's denominator crosses
zero. (FlexAttention's ``max_scores`` output would give the maximum itself, but not on CPU, where
the twin tests run.)

Where it runs: on CUDA, ``torch.compile(flex_attention)`` (the fused kernel, forward and backward);
elsewhere the eager form, which materialises the scores (a test twin on CPU, forward only:
FlexAttention has no CPU backward). Low-precision q/k/v run in their dtype (fp32 accumulation
inside the kernel, as in SDPA); the Partial is float32.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..masks import NEG, sink_mask
from ..partial import Partial

#: the FlexAttention block size (its default on CUDA)
BLOCK = 128


def importable() -> bool:
    """Whether this PyTorch has FlexAttention (``torch.nn.attention.flex_attention``)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - PyTorch < 2.5
        return False
    return True


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """FlexAttention is in this PyTorch and ``device`` is CUDA (the compiled kernel) or CPU (the
    eager forward, a twin)."""
    return device.type in ("cuda", "cpu") and importable()


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _kernel(device: torch.device):
    """The FlexAttention callable for ``device``: compiled on CUDA, eager elsewhere."""
    if device.type == "cuda":
        return _compiled()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def band_mask_mod(real: torch.Tensor, sink: torch.Tensor | None, window: int | torch.Tensor, offset: int = 0):
    """The ``mask_mod`` of the band: key ``s`` is visible to query row ``i`` (position ``t = i +
    offset``) when it is real (``real [B, Nk]`` bool), ``s ≤ t``, and ``t − s < window`` or it is
    a sink (``sink [B, Nk]`` bool, or None)."""

    def mask_mod(b, h, q_idx, kv_idx):
        t = q_idx + offset
        near = (t - kv_idx) < window
        if sink is not None:
            near = near | sink[b, kv_idx]
        return real[b, kv_idx] & (kv_idx <= t) & near

    return mask_mod


def band_blocks(sink: torch.Tensor | None, b: int, n: int, window: int, block: int = BLOCK) -> torch.Tensor:
    """Which (query block, key block) tiles can hold a band entry: ``[B, Lq, Lk]`` bool for
    ``L = ceil(N / block)`` — the tiles that meet the causal window, and the tiles of a sink at or
    before the query block. A superset of the tiles with a visible entry (padding is left to the
    mask_mod); the twin test compares it with ``create_block_mask``'s tiles."""
    nb = -(-n // block)
    dev = sink.device if sink is not None else None
    lo = torch.arange(nb, device=dev) * block
    hi = torch.clamp(lo + block, max=n) - 1
    causal = lo.view(1, -1) <= hi.view(-1, 1)  # [Lq, Lk]: some key s <= some query t
    tiles = causal & (hi.view(1, -1) > lo.view(-1, 1) - window) if window > 0 else torch.zeros(nb, nb, dtype=torch.bool, device=dev)
    tiles = tiles.unsqueeze(0).expand(b, nb, nb)
    if sink is not None:
        pad = nb * block - n
        has_sink = torch.nn.functional.pad(sink, (0, pad)).view(b, nb, block).any(-1)  # [B, Lk]
        tiles = tiles | (has_sink[:, None, :] & causal[None])
    return tiles


def band_block_mask(real: torch.Tensor, sink: torch.Tensor | None, n: int, window: int, block: int = BLOCK):
    """The :class:`~torch.nn.attention.flex_attention.BlockMask` of the causal band of ``n``
    positions (queries = keys), built from :func:`band_blocks` (every tile partial: the mask_mod
    decides inside it)."""
    from torch.nn.attention.flex_attention import BlockMask

    tiles = band_blocks(sink, real.shape[0], n, window, block)[:, None]  # [B, 1, Lq, Lk]
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # tiles first, in order
    # the window as a tensor: a compiled kernel is not specialised (recompiled) per window
    mm = band_mask_mod(real, sink, torch.tensor(window, device=real.device))
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mm, seq_lengths=(n, n))


def band_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None,
    window: int,
    sinks: int,
    scale: float,
    block: int = BLOCK,
) -> Partial:
    """The causal band of ``q [B, H, N, D]``, ``k [B, Hkv, N, D]``, ``v [B, Hkv, N, Dv]`` (query t
    is position t) as a Partial ``[B, Hkv, G, N, ·]`` (float32; float64 inputs stay float64):
    ``num`` the normalised band output, ``den`` 1, log scale the lse (0 and NEG for a row that sees
    no band key). ``key_mask [B, N]`` bool or None; scores are ``scale · q·k``."""
    b, h, n, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    real = key_mask if key_mask is not None else torch.ones(b, n, dtype=torch.bool, device=q.device)
    sink = sink_mask(key_mask, b, n, sinks, q.device) if sinks > 0 else None
    bm = band_block_mask(real, sink, n, window, block)
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32
    qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
    fn = _kernel(q.device)
    with warnings.catch_warnings():  # the eager (CPU twin) form says it is unfused: it is meant to be
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, lse = _call(fn, qq, kk, vv, bm, scale)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = lse.to(ct)
    seen = torch.isfinite(lse)
    out = torch.where(seen.unsqueeze(-1), out.to(ct), torch.zeros((), dtype=ct, device=q.device))
    g = h // hkv
    den = seen.to(ct)
    ls = torch.where(seen, lse, torch.full_like(lse, NEG))
    return Partial(out.view(b, hkv, g, n, dv), den.view(b, hkv, g, n), ls.view(b, hkv, g, n))


def _call(fn, q, k, v, bm, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` from FlexAttention, by ``return_aux`` where this PyTorch has it, else by the
    older ``return_lse``."""
    gqa = q.shape[1] != k.shape[1]
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # pragma: no cover - PyTorch before AuxRequest
        return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True)
    out, aux = fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


__all__ = ["BLOCK", "available", "band_block_mask", "band_blocks", "band_mask_mod", "band_partial", "importable"]
