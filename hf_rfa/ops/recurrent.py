"""The recurrent (one-step) form of causal linear attention, with an explicit state.

State per layer: ``S = Σ_s φ(k_s) v_sᵀ`` ``[B, Hkv, F, Dv]`` and ``z = Σ_s φ(k_s)`` ``[B, Hkv, F]``,
both stored relative to a log reference ``ref`` ``[B, Hkv]`` (the running max of the keys' log
scales, so states never overflow), plus ``log_gate_sum`` ``[B, Hkv]`` (cumulative log gate of
gated RFA; 0 otherwise). Used for decoding and for folding a prefix into the state; the chunked
parallel form in ``linear.py`` uses the same update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import NEG
from .partial import Partial


@dataclass
class LinearState:
    """Recurrent state of causal linear attention (see module docstring for shapes)."""

    S: torch.Tensor
    z: torch.Tensor
    ref: torch.Tensor
    log_gate_sum: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, kv_heads: int, feature_dim: int, value_dim: int, device=None, dtype=torch.float32) -> "LinearState":
        return cls(
            S=torch.zeros(batch, kv_heads, feature_dim, value_dim, device=device, dtype=dtype),
            z=torch.zeros(batch, kv_heads, feature_dim, device=device, dtype=dtype),
            ref=torch.full((batch, kv_heads), NEG, device=device, dtype=dtype),
            log_gate_sum=torch.zeros(batch, kv_heads, device=device, dtype=dtype),
        )

    def index_select(self, index: torch.Tensor) -> "LinearState":
        """Reorder/select batch rows (beam search)."""
        return LinearState(*(t.index_select(0, index.to(t.device)) for t in (self.S, self.z, self.ref, self.log_gate_sum)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.S, self.z, self.ref, self.log_gate_sum))


def fold(state: LinearState, kf: torch.Tensor, lk: torch.Tensor | None, v: torch.Tensor) -> LinearState:
    """Add keys to the state.

    kf ``[B, Hkv, N, F]`` (zero rows for keys to skip), lk ``[B, Hkv, N]`` effective key log
    scales (NEG for skipped keys; None = 0), v ``[B, Hkv, N, Dv]``.
    """
    v = v.to(state.S.dtype)
    if lk is None:  # unscaled features: log scale 0
        new_ref = state.ref.clamp_min(0.0)
        old = torch.exp(state.ref - new_ref)
        return LinearState(
            state.S * old[..., None, None] + kf.transpose(-1, -2) @ v,
            state.z * old[..., None] + kf.sum(-2),
            new_ref,
            state.log_gate_sum,
        )
    new_ref = torch.maximum(state.ref, lk.amax(-1)).detach()
    old = torch.exp(state.ref - new_ref)
    w = torch.exp(lk - new_ref.unsqueeze(-1)).unsqueeze(-1) * kf  # [B,Hkv,N,F]
    return LinearState(
        state.S * old[..., None, None] + w.transpose(-1, -2) @ v,
        state.z * old[..., None] + w.sum(-2),
        new_ref,
        state.log_gate_sum,
    )


def read(state: LinearState, qf: torch.Tensor, lq: torch.Tensor | None) -> Partial:
    """Attend queries to the state: qf ``[B, Hkv, G, N, F]``, lq ``[B, Hkv, G, N]`` (or None)."""
    num = qf @ state.S.unsqueeze(2)  # [B,Hkv,G,N,Dv]
    den = (qf * state.z[:, :, None, None, :]).sum(-1)
    ls = state.ref[:, :, None, None].expand(den.shape)
    if lq is not None:
        ls = ls + lq
    return Partial(num, den, ls)
