"""The recurrent (one-step) form of causal linear attention, with an explicit state.

State per layer: ``S = Σ_s φ(k_s) v_sᵀ`` ``[B, Hkv, F, Dv]`` and ``z = Σ_s φ(k_s)`` ``[B, Hkv, F]``,
both stored relative to a log reference ``ref`` ``[B, Hkv]`` (the running max of the keys' log
scales, so states never overflow), plus ``log_gate_sum`` ``[B, Hkv]`` (cumulative log gate of
gated RFA; 0 otherwise). Used for decoding and for folding a prefix into the state; the chunked
parallel form in ``chunkwise.py`` uses the same update.
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
    """Attend queries to the state: qf ``[B, Hkv, G, N, F]``, lq ``[B, Hkv, G, N]`` (or None).
    The G query heads of a kv head are stacked as rows, so the state is not broadcast over them."""
    b, hkv, g, n, f = qf.shape
    q2 = qf.reshape(b, hkv, g * n, f)
    num = (q2 @ state.S).view(b, hkv, g, n, -1)  # [B,Hkv,G,N,Dv]
    den = (q2 @ state.z.unsqueeze(-1)).view(b, hkv, g, n)
    ls = state.ref[:, :, None, None].expand(b, hkv, g, n)
    if lq is not None:
        ls = ls + lq
    return Partial(num, den, ls)


def decay(state: LinearState, log_g: torch.Tensor) -> LinearState:
    """Gated RFA: multiply the state by g (``log_g [B, Hkv]``) — kept in log space via ``ref``."""
    return LinearState(state.S, state.z, state.ref + log_g, state.log_gate_sum + log_g)


def recurrent_step(
    state: LinearState,
    feature_map,
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> tuple[Partial, LinearState]:
    """One decoding step of pure causal linear attention (no window or sinks).

    xq ``[B, H, 1, D]`` and xk ``[B, Hkv, 1, D]`` already multiplied by √scale, v ``[B, Hkv, 1, Dv]``,
    key_mask ``[B, 1]`` bool (False: a padding token, which is skipped and does not decay the
    state). The new key is folded first, then the query reads the state (it sees itself).
    Returns the Partial for the query ``[B, Hkv, G, 1, ·]`` and the new state.
    """
    b, hkv = xk.shape[:2]
    fq, fk = feature_map.forward_queries(xq), feature_map.forward_keys(xk)
    g = fq.phi.shape[1] // hkv
    kf, lk = fk.phi, fk.log_scale
    if feature_map.has_gate:
        logg, log1mg = feature_map.log_gate(xk)  # [B,Hkv,1]
        if key_mask is not None:
            logg = logg * key_mask[:, None, :]
        state = decay(state, logg[..., 0])
        lk = (lk if lk is not None else torch.zeros_like(log1mg)) + log1mg
    if key_mask is not None:
        kf = kf * key_mask[:, None, :, None]
        if lk is not None:
            lk = torch.where(key_mask[:, None, :], lk, torch.full_like(lk, NEG))
    state = fold(state, kf, lk, v)
    lq = fq.log_scale.reshape(b, hkv, g, 1) if fq.log_scale is not None else None
    return read(state, fq.phi.reshape(b, hkv, g, 1, -1), lq), state
