"""How the exact memory (:mod:`hf_rfa.ops.memory`) ranks its candidate keys (``memory_score``).

A key's score is fixed at its first refresh and compared at a resolution of ``2**-SCORE_BITS`` in
log2, so that the prefill and cached decoding break ties the same way (ties go to the older key):
``"value_norm"`` (``log2 ‖v‖``), ``"feature_error"`` (how badly the feature state recalls the
key's value, LoLA-style) or ``"query_mass"`` (how much attention the queries of its exact window
gave the key: selection by the query side, :func:`window_mass`).
"""

from __future__ import annotations

import torch

from ..recurrent import LinearState, read

#: the selection compares ``log2 ‖v‖`` rounded to multiples of 2**-SCORE_BITS (≈ 0.07 % for 10)
SCORE_BITS = 10


def value_norm(v: torch.Tensor) -> torch.Tensor:
    """The selection score of values ``[..., N, Dv]``: ``log2 ‖v‖`` rounded to a multiple of
    ``2**-SCORE_BITS`` → ``[..., N]`` float32 (detached; finite: zero values score ≈ −100).

    Why rounded: a repeated token has the same value vector, but the prefill and cached decoding
    compute it with matmuls of other shapes, so the two copies can differ in the last bit; an
    exact-float ranking would then break their tie one way in one form and the other way in the
    other (decoding ≠ full forward). Rounded scores tie, and ties go to the older key in both
    (a flip needs a value within float rounding of a rounding boundary: ~1e-4 per key)."""
    return round_log2(torch.linalg.vector_norm(v.detach().to(torch.float64), dim=-1))


def round_log2(x: torch.Tensor) -> torch.Tensor:
    """``log2 x`` of non-negative float64 ``x`` rounded to a multiple of ``2**-SCORE_BITS``, float32."""
    return (torch.round(torch.log2(x.clamp_min(1e-30)) * 2**SCORE_BITS) / 2**SCORE_BITS).to(torch.float32)


def feature_error(linear: LinearState, feature_map, xk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The ``"feature_error"`` selection score of new candidate keys: how badly the feature state
    recalls each key's value when the key itself is the query — its key-side features φ_k(k) read
    the state (LoLA, arXiv 2505.23666, caches the keys the linear state represents worst):
    ``log2 ‖v − φ_k(k)ᵀS / φ_k(k)ᵀz‖``, rounded like
    :func:`value_norm`; where the state is empty (``φ(k)ᵀz = 0``) the prediction is 0 and the
    score is :func:`value_norm`'s.

    linear: the feature state before the keys are folded (``S [B, Hkv, F, Dv]``); xk ``[B, Hkv,
    K, D]`` keys scaled by √scale (compute dtype), v ``[B, Hkv, K, Dv]`` → ``[B, Hkv, K]`` float32
    (detached)."""
    with torch.no_grad():
        return recall_error(linear, feature_map.forward_keys(xk.detach()).phi, v)  # key-side features (maps may have per-query-head parameters)


def recall_error(linear: LinearState, phi: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`feature_error` from the keys' features ``phi [B, Hkv, K, F]`` (their log scales
    cancel in the ratio) → ``[B, Hkv, K]`` float32, detached."""
    with torch.no_grad():
        b, hkv, kk, _ = phi.shape
        part = read(linear, phi.detach().view(b, hkv, 1, kk, -1), None)
        num, den = part.num.view(b, hkv, kk, -1).double(), part.den.view(b, hkv, kk).double()
        pred = torch.where((den > 0).unsqueeze(-1), num / den.clamp_min(1e-300).unsqueeze(-1), torch.zeros_like(num))
        return round_log2(torch.linalg.vector_norm(v.detach().double() - pred, dim=-1))


#: queries per block of :func:`window_mass` (bounds its ``[B, Hkv, G, C, C + W]`` scores)
MASS_BLOCK = 64


def window_mass(xqg: torch.Tensor, xk: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor], masks: tuple[torch.Tensor, torch.Tensor], window: int, first: int) -> torch.Tensor:
    """The ``"query_mass"`` score's sums (query-side selection, after STILL's self-saliency,
    arXiv 2602.02180): how much attention each key receives from the queries whose exact window
    holds it, ``Σ_t Σ_h p_h(t, s)`` over the queries t with ``t − W < s ≤ t`` and the query heads h
    of the key's kv head, ``p_h(t, s) = exp(q_t·k_s·scale) / Σ_{s' exact for t} exp(q_t·k_s'·scale)``
    — the softmax of query t over its exact keys (window and sinks). A key's sum is complete
    once it has left the window, i.e. at its first refresh, where it is compared as
    ``log2(sum)`` rounded like :func:`value_norm` (:func:`round_log2`).

    xqg ``[B, Hkv, G, n, D]`` the call's queries · √scale; xk ``[B, Hkv, L, D]`` the local keys ·
    √scale (query i sits at local index ``first + i``); ``exact = (den, log_scale)`` ``[B, Hkv, G,
    n]`` the exact part's row sums (``Σ exp(score − log_scale)``); ``masks = (query_ok [B, n],
    key_ok [B, L])`` → the call's contributions ``[B, Hkv, L]`` float64 (detached; zeros with
    ``window = 0``)."""
    den, ls = exact
    q_ok, k_ok = masks
    b, hkv, g, n, _ = xqg.shape
    out = torch.zeros(b, hkv, xk.shape[2], dtype=torch.float64, device=xk.device)
    if window <= 0:
        return out
    with torch.no_grad():
        for i0 in range(0, n, MASS_BLOCK):
            i1 = min(n, i0 + MASS_BLOCK)
            k0, k1 = max(0, first + i0 - window + 1), first + i1
            t = torch.arange(first + i0, first + i1, device=xk.device).view(-1, 1)
            s = torch.arange(k0, k1, device=xk.device).view(1, -1)
            ok = ((s <= t) & (s > t - window)) & q_ok[:, None, None, i0:i1, None] & k_ok[:, None, None, None, k0:k1]
            ok = ok & (den[..., i0:i1] > 0).unsqueeze(-1)  # [B,Hkv,G,C,K]
            sc = xqg[:, :, :, i0:i1].detach() @ xk[:, :, None, k0:k1].detach().transpose(-1, -2)  # [B,Hkv,G,C,K]
            p = torch.exp(sc - ls[..., i0:i1, None]) / den[..., i0:i1, None].clamp_min(1e-30)
            out[:, :, k0:k1] += torch.where(ok, p, torch.zeros_like(p)).sum((2, 3)).double()
    return out


#: how the exact memory ranks its candidates (``memory_score``): the largest score is kept
MEMORY_SCORES = ("value_norm", "feature_error", "query_mass")


__all__ = ["MASS_BLOCK", "MEMORY_SCORES", "SCORE_BITS", "feature_error", "recall_error", "round_log2", "value_norm", "window_mass"]
