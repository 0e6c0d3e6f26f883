"""The state of constant-memory decoding (:class:`DecodeState`) and the exact part of a
continuation: the kept window and sinks, read by the new queries (:func:`exact_part`) and joined by
new sink tokens (:func:`join_sinks`). The exact memory's state builds on these
(:mod:`hf_rfa.ops.memory`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..masks import NEG
from ..partial import Partial
from ..recurrent import LinearState


@dataclass
class DecodeState:
    """The past of one causal layer, summarised (B batch rows, Hkv kv heads, Wc ≤ W kept keys).

    linear:      :class:`LinearState` of every key older than the window (sinks excluded).
    win_k:       ``[B, Hkv, Wc, D]`` raw keys of the last Wc positions (input dtype).
    win_v:       ``[B, Hkv, Wc, Dv]`` their values.
    win_real:    ``[B, Wc]`` bool, the position holds a real (non-padding) token.
    win_feat:    ``[B, Wc]`` bool, real and not a sink: enters the feature state when evicted.
    win_decay:   ``[B, Hkv, Wc]`` accumulated log gate since each kept key arrived (0 ungated).
    sink_k:      ``[B, Hkv, S, D]`` keys of the first S real tokens (zeros where none yet).
    sink_v:      ``[B, Hkv, S, Dv]`` their values.
    sink_pos:    ``[B, S]`` long, their absolute positions.
    sink_exists: ``[B, S]`` bool, the slot is filled.
    real_count:  ``[B]`` long, real tokens seen so far (ranks new sinks).
    nonfinite:   ``[B, Hkv]`` bool, a real key/value seen so far held a NaN/±inf (it was zeroed
                 before entering the state; every later row of that head is NaN, as in softmax).
    seen:        positions seen so far, padding included (the sequence length).
    win_kf:      ``[B, Hkv, Wc, D]`` the feature part's keys of the kept positions (``feature_k``,
                 e.g. un-rotated keys), or None when the feature part reads the keys themselves
                 or derives them from ``win_k`` (``continue_attention``'s ``feature_key_fn``: the
                 state is then exactly the plain one, nothing per layer added).
    """

    linear: LinearState
    win_k: torch.Tensor
    win_v: torch.Tensor
    win_real: torch.Tensor
    win_feat: torch.Tensor
    win_decay: torch.Tensor
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    sink_pos: torch.Tensor
    sink_exists: torch.Tensor
    real_count: torch.Tensor
    nonfinite: torch.Tensor
    seen: int = 0
    win_kf: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        shape: tuple[int, int, int, int, int],
        sinks: int,
        dtype: torch.dtype,
        device=None,
        compute_dtype: torch.dtype = torch.float32,
        feature_keys: bool = False,
    ) -> "DecodeState":
        """State before the first token for ``shape = (batch, kv_heads, head_dim, value_dim,
        feature_dim)`` and ``sinks`` sink slots: key/value buffers in ``dtype``, sums in
        ``compute_dtype``; ``feature_keys``: also keep the window's feature-part keys
        (``continue_attention`` given ``feature_k``; not for a ``feature_key_fn``, which derives
        them from the kept keys)."""
        b, h, head_dim, value_dim, feature_dim = shape
        return cls(
            linear=LinearState.zeros(b, h, feature_dim, value_dim, device=device, dtype=compute_dtype),
            win_k=torch.zeros(b, h, 0, head_dim, dtype=dtype, device=device),
            win_v=torch.zeros(b, h, 0, value_dim, dtype=dtype, device=device),
            win_real=torch.zeros(b, 0, dtype=torch.bool, device=device),
            win_feat=torch.zeros(b, 0, dtype=torch.bool, device=device),
            win_decay=torch.zeros(b, h, 0, dtype=compute_dtype, device=device),
            sink_k=torch.zeros(b, h, sinks, head_dim, dtype=dtype, device=device),
            sink_v=torch.zeros(b, h, sinks, value_dim, dtype=dtype, device=device),
            sink_pos=torch.zeros(b, sinks, dtype=torch.long, device=device),
            sink_exists=torch.zeros(b, sinks, dtype=torch.bool, device=device),
            real_count=torch.zeros(b, dtype=torch.long, device=device),
            nonfinite=torch.zeros(b, h, dtype=torch.bool, device=device),
            seen=0,
            win_kf=torch.zeros(b, h, 0, head_dim, dtype=dtype, device=device) if feature_keys else None,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state by name (the linear state's under ``linear.*``)."""
        out = {f"linear.{f.name}": getattr(self.linear, f.name) for f in fields(LinearState)}
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("linear", "seen") and getattr(self, f.name) is not None})
        return out

    def map_batch(self, fn) -> "DecodeState":
        """Apply ``fn`` to the batch axis (dim 0) of every tensor: reorder, select, repeat."""
        lin = LinearState(*(fn(getattr(self.linear, f.name)) for f in fields(LinearState)))
        rest = {f.name: (fn(getattr(self, f.name)) if getattr(self, f.name) is not None else None) for f in fields(self) if f.name not in ("linear", "seen")}
        return DecodeState(linear=lin, seen=self.seen, **rest)

    def nbytes(self) -> int:
        """Bytes held by the state (independent of the context length)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())



def exact_part(
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    real: torch.Tensor,
    offsets: tuple[int, int],
    window: int,
    sinks: tuple | None,
    chunk_size: int,
) -> Partial:
    """Exact softmax over the window band and the sinks, for the new queries only.

    xq ``[B, Hkv, G, n, D]`` (local indices ``q0 … q0+n-1``), xk ``[B, Hkv, L, D]``, v
    ``[B, Hkv, L, Dv]`` and real ``[B, L]`` of the local block (local index i is absolute position
    ``pos0 + i``; ``offsets = (q0, pos0)``); ``sinks = (sink_k, sink_v, sink_pos, sink_ok)`` or
    None: sink_k/v ``[B, Hkv, S, ·]`` (already scaled keys), sink_pos/sink_ok ``[B, S]``.
    """
    q0, pos0 = offsets
    sink_k, sink_v, sink_pos, sink_ok = sinks if sinks is not None else (None, None, None, None)
    b, hkv, g, n, _ = xq.shape
    dev = xq.device
    nums, dens, lss = [], [], []
    for a0 in range(0, n, chunk_size):
        a1 = min(n, a0 + chunk_size)
        qc = xq[:, :, :, a0:a1]
        t = torch.arange(q0 + a0, q0 + a1, device=dev).view(-1, 1)  # local query indices [C,1]
        parts_s, parts_v, parts_ok = [], [], []
        if window > 0:
            lo, hi = max(0, q0 + a0 - window + 1), q0 + a1
            s = torch.arange(lo, hi, device=dev).view(1, -1)
            band = (s <= t) & (s > t - window)  # [C,K]
            parts_s.append(qc @ xk[:, :, lo:hi].unsqueeze(2).transpose(-1, -2))  # [B,Hkv,G,C,K]
            parts_v.append(v[:, :, lo:hi])
            parts_ok.append(band.unsqueeze(0) & real[:, None, lo:hi])
        if sink_k is not None:
            tt = (t.view(1, -1, 1) + pos0)  # absolute query positions [1,C,1]
            sp = sink_pos.unsqueeze(1)  # [B,1,S]
            ok = sink_ok.unsqueeze(1) & (sp <= tt)
            if window > 0:
                ok = ok & ~(sp > tt - window)
            parts_s.append(qc @ sink_k.unsqueeze(2).transpose(-1, -2))  # [B,Hkv,G,C,S]
            parts_v.append(sink_v)
            parts_ok.append(ok)
        scores = torch.cat(parts_s, dim=-1)
        ok = torch.cat(parts_ok, dim=-1)[:, None, None]  # [B,1,1,C,K+S]
        vals = torch.cat(parts_v, dim=-2)
        r = torch.where(ok, scores, torch.full_like(scores, NEG)).amax(-1).detach()
        p = torch.exp(torch.where(ok, scores - r.unsqueeze(-1), torch.full_like(scores, NEG)))
        nums.append(p @ vals.unsqueeze(2))
        dens.append(p.sum(-1))
        lss.append(r)
    return Partial(torch.cat(nums, dim=-2), torch.cat(dens, dim=-1), torch.cat(lss, dim=-1))


def join_sinks(state: DecodeState, k: torch.Tensor, v: torch.Tensor, km: torch.Tensor, sinks: int, p0: int):
    """New real tokens ranked below S join the sink set: ``(sink_k, sink_v, sink_pos,
    sink_exists, new_sink [B, n])`` from the state's sinks and new keys/values ``[B, Hkv, n, ·]``."""
    sink_k, sink_v, sink_pos, sink_exists = state.sink_k, state.sink_v, state.sink_pos, state.sink_exists
    new_sink = torch.zeros_like(km)
    if sinks == 0:
        return sink_k, sink_v, sink_pos, sink_exists, new_sink
    b, hkv, _, d = k.shape
    rank = state.real_count.view(b, 1) + torch.cumsum(km.long(), -1) - 1  # [B,n]
    new_sink = km & (rank < sinks)
    hit = new_sink.unsqueeze(1) & (rank.unsqueeze(1) == torch.arange(sinks, device=k.device).view(1, -1, 1))  # [B,S,n]
    filled = hit.any(-1)  # [B,S]
    idx = hit.long().argmax(-1)  # [B,S]
    gk = torch.gather(k, 2, idx[:, None, :, None].expand(b, hkv, sinks, d))
    gv = torch.gather(v, 2, idx[:, None, :, None].expand(b, hkv, sinks, v.shape[-1]))
    f4 = filled[:, None, :, None]
    sink_k = torch.where(f4, gk.to(sink_k.dtype), sink_k)
    sink_v = torch.where(f4, gv.to(sink_v.dtype), sink_v)
    sink_pos = torch.where(filled, idx + p0, sink_pos)
    return sink_k, sink_v, sink_pos, sink_exists | filled, new_sink


__all__ = ["DecodeState", "exact_part", "join_sinks"]
