"""How the exact memory (:mod:`hf_rfa.ops.memory`) ranks its candidate keys (``memory_score``).

A key's score is fixed at its first refresh and compared at a resolution of ``2**-SCORE_BITS`` in
log2, so that the prefill and cached decoding break ties the same way (ties go to the older key):
``"value_norm"`` (``log2 ‖v‖``) or ``"feature_error"`` (how badly the feature state recalls the
key's value, LoLA-style).
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


#: how the exact memory ranks its candidates (``memory_score``): the largest score is kept
MEMORY_SCORES = ("value_norm", "feature_error")


__all__ = ["MEMORY_SCORES", "SCORE_BITS", "feature_error", "recall_error", "round_log2", "value_norm"]
