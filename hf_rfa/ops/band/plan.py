"""The exact band's layout: query chunks, the padded key band each chunk sees, the sinks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import sink_positions


def gather_keys(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x ``[B, Hkv, N, D]``, pos ``[B, S]`` → ``[B, Hkv, S, D]``."""
    idx = pos[:, None, :, None].expand(x.shape[0], x.shape[1], pos.shape[1], x.shape[-1])
    return torch.gather(x, 2, idx)


@dataclass(frozen=True)
class Band:
    """The exact band's settings (:func:`~hf_rfa.ops.band.exact.exact_local`): ``window`` W,
    ``sinks`` S, ``causal``, the query chunk length ``chunk_size`` and the queries per block
    ``block_size``."""

    window: int
    sinks: int
    causal: bool = True
    chunk_size: int = 64
    block_size: int = 512


@dataclass
class BandPlan:
    """The exact part's layout (see :func:`exact_local`): query chunks of ``c`` tokens, ``nch`` of
    them, ``lpb`` per block; each chunk sees ``kw = c + left + right`` band keys of the padded
    key tensor (padded by ``left`` in front, to ``npad + right`` behind)."""

    b: int
    hkv: int
    g: int
    n: int
    c: int
    nch: int
    lpb: int
    left: int
    right: int
    window: int
    sinks: int
    causal: bool
    key_mask: torch.Tensor  # [B, N] bool
    band: torch.Tensor | None  # [C, Kw] bool: key j of a chunk's band visible to its query i
    spos: torch.Tensor | None  # [B, S] sink positions
    sexists: torch.Tensor | None  # [B, S]

    @property
    def npad(self) -> int:
        return self.nch * self.c

    @property
    def kw(self) -> int:
        return self.c + self.left + self.right

    def blocks(self) -> list[tuple[int, int]]:
        """Query chunk ranges ``[c0, c1)`` of the blocks."""
        return [(c0, min(self.nch, c0 + self.lpb)) for c0 in range(0, self.nch, self.lpb)]

    def pad_queries(self, xq: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(xq, (0, 0, 0, self.npad - self.n))

    def pad_keys(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, N, ·]`` → ``[B, Hkv, left + npad + right, ·]``."""
        return torch.nn.functional.pad(x, (0, 0, self.left, self.npad + self.right - self.n))


def band_plan(xq: torch.Tensor, key_mask: torch.Tensor | None, window: int, sinks: int, causal: bool, chunk_size: int = 64, block_size: int = 512, nk: int | None = None) -> BandPlan:
    """Layout of the exact part for queries ``xq [B, Hkv, G, N, D]`` (``nk``: the number of keys
    when it differs from N — bidirectional, no window: the sinks are the first S of the *keys*)."""
    b, hkv, g, n, _ = xq.shape
    dev = xq.device
    c = max(1, min(chunk_size, n))
    left = min(window, n) - 1 if window > 0 else 0
    right = 0 if causal or window <= 0 else min(window, n) - 1
    real = key_mask if key_mask is not None else torch.ones(b, n, dtype=torch.bool, device=dev)
    band = None
    if window > 0:
        i_q = torch.arange(c, device=dev).view(-1, 1)
        j_k = torch.arange(c + left + right, device=dev).view(1, -1)
        # query a+i, key a−left+j: band s ≤ t (causal) / s < t+W, and s > t−W
        band = (j_k >= i_q) & (j_k <= i_q + left + right) if not causal else (j_k >= i_q) & (j_k <= i_q + left)
    spos = sexists = None
    if sinks > 0:
        spos, sexists = sink_positions(key_mask, b, nk or n, sinks, dev)  # [B,S]
    return BandPlan(b, hkv, g, n, c, -(-n // c), max(1, block_size // c), left, right, window, sinks, causal, real, band, spos, sexists)


def gather_sinks(x: torch.Tensor, plan: BandPlan) -> torch.Tensor | None:
    """The sink tokens' keys or values ``[B, Hkv, S, ·]`` (None without sinks)."""
    return gather_keys(x, plan.spos) if plan.sinks > 0 else None


__all__ = ["Band", "BandPlan", "band_plan", "gather_keys", "gather_sinks"]
