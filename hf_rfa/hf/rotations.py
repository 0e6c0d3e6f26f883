"""The rotations an :class:`~hf_rfa.hf.cache.RFACache` needs to un-rotate the keys it keeps
(``feature_input="unrotated"``), so that it keeps the rotated keys only.

- :class:`RopeRing`: the ``(cos, sin)`` of the last ``keep`` positions as the model gave them
  (the window, or with an exact memory its buffer of at most ``W + memory_every`` keys), kept
  once for all layers.
- :class:`RopeTable`: the ``(cos, sin)`` of any past position, recomputed from the model's rotary
  embedding module — for the exact memory's keys, which may sit anywhere in the past. It is used
  only while it reproduces, bit for bit, the rotations the model gave every forward's tokens:
  each forward is checked once (:meth:`RopeTable.observe`); a static rotary embedding (not
  ``dynamic`` / ``longrope``, whose frequencies change with the length), rows padded on the left
  only, and the model's positions counting the real tokens (what ``generate()`` builds from the
  attention mask). When a check fails the table stops and the layers keep copies of their
  un-rotated keys again, derived from the rotations that were checked.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

#: rotary embedding types whose frequencies depend on the sequence length (no table for them)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class RopeRing:
    """The rotary embedding ``(cos, sin)`` of the last ``keep`` positions, one for all layers of a cache.

    ``feature_input="unrotated"``: each layer derives the un-rotated keys of its local block
    (``Wc ≤ keep`` kept positions + the ``n`` new ones) from its rotated keys; the rotations of
    those positions are identical in every layer, so they are kept here once. ``cos``/``sin`` are
    ``[Bc, Lr, Dr]`` (``Lr ≤ keep``; ``Bc`` is 1 when every row has the same positions, else the
    batch). In each forward the first layer that reaches the new length appends the forward's
    rotations (:meth:`local`); the later layers of that forward read the same local block; the
    ring then keeps the last ``keep`` positions only. ``users`` is the number of layers sharing it
    (the transient local block is dropped once all of them read it).
    """

    def __init__(self, keep: int, users: int = 1) -> None:
        self.keep = int(keep)
        self.users = int(users)
        self.reset()

    def reset(self) -> None:
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self.end = 0  # positions covered: [end - Lr, end)
        self._block: tuple | None = None  # (p0, n, cos, sin, reads) of the current forward

    def __len__(self) -> int:
        return 0 if self.cos is None else self.cos.shape[1]

    def local(self, p0: int, n: int, wc: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotations ``[Bc, wc + n, Dr]`` of positions ``p0 - wc … p0 + n - 1``: the layer's kept
        window (``wc`` positions) and the forward's new tokens, whose ``cos``/``sin`` ``[B or 1, n, Dr]``
        come from the attention module (the same in every layer)."""
        blk = self._block
        if blk is None or blk[0] != p0 or blk[1] != n:
            if self.end != p0:
                raise RuntimeError(
                    f"RFACache rotary ring out of step: it covers positions up to {self.end}, a layer continues at {p0} "
                    "(feature_input='unrotated' needs every layer of the cache to see every forward)"
                )
            if tuple(cos.shape[:2]) != tuple(sin.shape[:2]) or cos.shape[1] != n:
                raise ValueError(f"the rotary embedding covers {cos.shape[1]} positions, the forward has {n} new tokens")
            if self.cos is None:
                bc, bs = cos, sin
            else:
                if self.cos.shape[-1] != cos.shape[-1]:
                    raise ValueError(f"rotary dim changed between forwards: {self.cos.shape[-1]} then {cos.shape[-1]}")
                rows = max(self.cos.shape[0], cos.shape[0])
                if {self.cos.shape[0], cos.shape[0]} - {1, rows}:
                    raise ValueError(f"rotary embedding of batch {cos.shape[0]} does not continue the cache's batch {self.cos.shape[0]}")
                bc = torch.cat([self.cos.to(cos.dtype).expand(rows, -1, -1), cos.expand(rows, -1, -1)], dim=1)
                bs = torch.cat([self.sin.to(sin.dtype).expand(rows, -1, -1), sin.expand(rows, -1, -1)], dim=1)
            blk = self._block = [p0, n, bc, bs, 0]
            keep = min(self.keep, bc.shape[1])
            self.cos, self.sin = bc[:, bc.shape[1] - keep:].clone(), bs[:, bs.shape[1] - keep:].clone()
            self.end = p0 + n
        bc, bs = blk[2], blk[3]
        if wc + n > bc.shape[1]:
            raise RuntimeError(f"RFACache rotary ring keeps {bc.shape[1] - n} past positions but a layer keeps a window of {wc} (ring keep={self.keep})")
        blk[4] += 1
        if blk[4] >= self.users:  # every layer of this forward has read it
            self._block = None
        return bc[:, bc.shape[1] - wc - n:], bs[:, bs.shape[1] - wc - n:]

    def map_batch(self, fn) -> None:
        """Beam search / batch selection: ``fn`` on the batch axis (a ring shared by all rows stays)."""
        self._block = None
        if self.cos is not None and self.cos.shape[0] > 1:
            self.cos, self.sin = fn(self.cos), fn(self.sin)

    def nbytes(self) -> int:
        return 0 if self.cos is None else 2 * self.cos.numel() * self.cos.element_size()




class RopeTable:
    """``(cos, sin)`` of any past position from the model's rotary embedding, one for all layers.

    Positions here are a cache's positions (padding included); the model's position of a real
    token is its cache position minus the left padding of its row (``offsets``). :meth:`observe`
    checks each forward once and returns whether the table may be used; :meth:`rotations` then
    gives the rotations of kept keys at their cache positions.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.ok = True
        self.end = 0  # positions observed: [0, end)
        self.offsets: torch.Tensor | None = None  # [B] left padding per row
        self.started: torch.Tensor | None = None  # [B] bool: the row has a real token
        self.rotary = None
        self._last: tuple[int, int] | None = None

    def _stop(self, why: str) -> bool:
        if self.ok:
            logger.info("RFACache keeps un-rotated copies of its memory keys: %s", why)
        self.ok = False
        return False

    def observe(self, p0: int, n: int, mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, rotary: tuple) -> bool:
        """Check the forward of ``n`` tokens at cache positions ``[p0, p0 + n)`` (padding ``mask
        [B, n]`` or None, the model's ``cos``/``sin [B or 1, n, Dr]``) once for all layers; True
        while the table reproduces every checked forward's rotations."""
        if not self.ok:
            return False
        if self._last == (p0, n):  # a later layer of the forward already checked
            return True
        if p0 != self.end:
            return self._stop(f"a layer continues at position {p0}, the table covers {self.end}")
        if len(rotary) != 1 or length_dependent(rotary[0]):
            return self._stop("the model has no single static rotary embedding module")
        b = mask.shape[0] if mask is not None else cos.shape[0]
        km = torch.ones(b, n, dtype=torch.bool, device=cos.device) if mask is None else mask.to(cos.device).bool()
        offsets = self.offsets if self.offsets is not None else torch.zeros(b, dtype=torch.long, device=cos.device)
        started = self.started if self.started is not None else torch.zeros(b, dtype=torch.bool, device=cos.device)
        if offsets.shape[0] == 1 and b > 1:  # rows told apart from now on (so far the same for all)
            offsets, started = offsets.expand(b).clone(), started.expand(b).clone()
        if offsets.shape[0] != b:
            return self._stop(f"batch {b} does not continue the table's batch {offsets.shape[0]}")
        begun = started[:, None] | (km.long().cumsum(-1) > 0)
        if bool((begun & ~km).any()):
            return self._stop("a row has padding after its first real token")
        offsets = offsets + (~begun).long().sum(-1)  # leading padding
        pos = (p0 + torch.arange(n, device=cos.device))[None, :] - offsets[:, None]
        rc, rs = self._at(pos.clamp_min(0), cos.dtype, rotary[0])
        same = ((rc == cos.expand_as(rc)) & (rs == sin.expand_as(rs))).all(-1) | ~km
        if not bool(same.all()):
            return self._stop("the rotary embedding recomputed at the tokens' positions differs from the model's")
        self.offsets, self.started, self.rotary = offsets, begun[:, -1] if n else started, rotary[0]
        self.end, self._last = p0 + n, (p0, n)
        return True

    @staticmethod
    def _at(pos: torch.Tensor, dtype: torch.dtype, module) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, dtype=dtype, device=pos.device)
        with torch.no_grad():
            return module(x, pos)

    def rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[B, N, Dr]`` of the cache positions ``[B or 1, N]`` (rows with the left
        padding observed so far; positions inside the padding read position 0)."""
        if self.rotary is None or self.offsets is None:
            raise RuntimeError("RopeTable.rotations before any forward was observed")
        pos = (positions - self.offsets[:, None]).clamp_min(0)
        return self._at(pos, dtype, self.rotary)

    def map_batch(self, fn) -> None:
        """Beam search / batch selection: ``fn`` on the batch axis."""
        self._last = None
        if self.offsets is not None:
            self.offsets, self.started = fn(self.offsets), fn(self.started)


def length_dependent(module) -> bool:
    """True when ``module``'s rotary type changes its frequencies with the length."""
    kind = str(getattr(module, "rope_type", "default"))
    return any(name in kind for name in LENGTH_DEPENDENT_ROPE)


__all__ = ["LENGTH_DEPENDENT_ROPE", "RopeRing", "RopeTable"]
