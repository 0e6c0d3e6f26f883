"""Drawing random projection matrices: i.i.d. Gaussian and block-orthogonal (Performer)."""

from __future__ import annotations

import torch


def gaussian_projection(num_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """``[num_rows, dim]`` with i.i.d. N(0, 1) entries (float32, CPU)."""
    return torch.randn(num_rows, dim, generator=generator, dtype=torch.float32)


def orthogonal_projection(num_rows: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """``[num_rows, dim]`` block-orthogonal Gaussian rows (Choromanski et al. 2021, FAVOR+).

    Rows come in blocks of ``dim`` mutually orthogonal directions (QR of a Gaussian block, in
    float64); each row's norm is re-drawn from the chi distribution with ``dim`` degrees of
    freedom, so every row is marginally N(0, I) and estimators stay unbiased.
    """
    blocks = []
    remaining = num_rows
    while remaining > 0:
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        # sign fix makes the QR unique, so the draw is a function of the generator alone
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(q.T[: min(dim, remaining)])
        remaining -= dim
    rows = torch.cat(blocks, dim=0)
    norms = torch.randn(num_rows, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return (rows * norms.unsqueeze(1)).to(torch.float32)


def draw_projection(num_rows: int, dim: int, generator: torch.Generator, orthogonal: bool) -> torch.Tensor:
    """Dispatch to :func:`orthogonal_projection` or :func:`gaussian_projection`."""
    fn = orthogonal_projection if orthogonal else gaussian_projection
    return fn(num_rows, dim, generator)
