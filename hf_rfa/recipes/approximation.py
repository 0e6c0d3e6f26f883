"""Approximation-error measurements of feature maps against exact softmax attention."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..feature_maps import build_feature_map
from ..ops import quadratic_kernel_attention, random_feature_attention, softmax_attention

logger = logging.getLogger(__name__)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (float64)."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def synthetic_qkv(logit_std: float, n: int, d: int, heads: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Gaussian q, k with ``std(q·k/√d) = logit_std`` and v ~ N(0, 1), all ``[1, heads, n, d]``."""
    g = torch.Generator().manual_seed(seed)
    s = logit_std**0.5
    q = s * torch.randn(1, heads, n, d, generator=g)
    k = s * torch.randn(1, heads, n, d, generator=g)
    v = torch.randn(1, heads, n, d, generator=g)
    return q, k, v


@dataclass
class ErrorRow:
    feature_map: str
    num_features: int
    logit_std: float
    output_error: float
    matrix_error: float


def approximation_errors(
    maps: list[str],
    num_features: list[int],
    logit_stds: list[float],
    n: int = 1024,
    d: int = 64,
    draws: int = 3,
    heads: int = 4,
    progress: bool = True,
) -> list[ErrorRow]:
    """Relative error of the attention output (and of the row-normalised attention matrix) of
    each map vs softmax, bidirectional, averaged over ``draws`` seeded projection draws.

    ``favor++`` is calibrated on the same q, k (its ρ); learned maps are at initialisation.
    """
    from tqdm.auto import tqdm

    rows = []
    jobs = [(s, name, m) for s in logit_stds for name in maps for m in num_features]
    eye = torch.eye(n).expand(1, heads, n, n)
    for std in logit_stds:  # the trivial baseline: uniform attention (mean of the values)
        q, k, v = synthetic_qkv(std, n, d, heads)
        uni = v.mean(-2, keepdim=True).expand_as(v)
        rows.append(ErrorRow("uniform (baseline)", 0, std, relative_error(uni, softmax_attention(q, k, v, causal=False)),
                             relative_error(torch.full((1, heads, n, n), 1.0 / n), softmax_attention(q, k, eye, causal=False))))
    for std, name, m in tqdm(jobs, desc="approximation error", disable=not progress):
        q, k, v = synthetic_qkv(std, n, d, heads)
        ref = softmax_attention(q, k, v, causal=False)
        ref_mat = softmax_attention(q, k, eye, causal=False)
        out_e, mat_e = [], []
        for seed in range(draws):
            fm = build_feature_map(name, head_dim=d, num_features=m, seed=seed)
            if hasattr(fm, "calibrate"):
                fm.calibrate(q * d**-0.25, k * d**-0.25)
            out_e.append(relative_error(random_feature_attention(q, k, v, fm, causal=False), ref))
            mat_e.append(relative_error(quadratic_kernel_attention(q, k, eye, fm, causal=False), ref_mat))
        rows.append(ErrorRow(name, m, std, sum(out_e) / draws, sum(mat_e) / draws))
    return rows


def error_table_markdown(rows: list[ErrorRow], field: str = "output_error") -> str:
    """Markdown table: one row per (map, m), one column per logit std."""
    stds = sorted({r.logit_std for r in rows})
    keys = list(dict.fromkeys((r.feature_map, r.num_features) for r in rows))
    lookup = {(r.feature_map, r.num_features, r.logit_std): getattr(r, field) for r in rows}
    lines = ["| map | m | " + " | ".join(f"std {s:g}" for s in stds) + " |", "|---|---|" + "---|" * len(stds)]
    for name, m in keys:
        cells = []
        for s in stds:
            e = lookup[(name, m, s)]
            cells.append(f"{100 * e:.1f}%" if e < 10 else f"{e:.3g}×")
        lines.append(f"| {name} | {m or '–'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
