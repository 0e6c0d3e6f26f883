"""Drawing random projection matrices: i.i.d. Gaussian and block-orthogonal (Performer)."""

from __future__ import annotations

import torch
from torch import nn

from .base import FeatureMap


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


class RandomProjectionMap(FeatureMap):
    """A feature map holding one random projection ``omega [m, D]``.

    Drawn at construction (step 0) and by :meth:`redraw`; i.i.d. Gaussian or block-orthogonal
    rows (``orthogonal``; ``None`` takes the class's ``default_orthogonal``). With
    ``learnable=True`` the step-0 draw only initialises an ``nn.Parameter`` that attention
    transfer or fine-tuning then trains (the map is no longer an unbiased estimator, but keeps its
    functional form); such a map cannot be redrawn.
    """

    default_orthogonal = False

    def __init__(self, head_dim: int, num_features: int, seed: int = 0, orthogonal: bool | None = None, learnable: bool = False, **kw) -> None:
        super().__init__(head_dim, num_features, seed, **kw)
        if not isinstance(learnable, bool):
            raise ValueError(f"learnable must be True or False, got {learnable!r}")
        self.orthogonal = self.default_orthogonal if orthogonal is None else bool(orthogonal)
        self.learnable = learnable
        if learnable:
            self.omega = nn.Parameter(torch.zeros(num_features, head_dim))
        else:
            self.register_buffer("omega", torch.zeros(num_features, head_dim), persistent=True)
        FeatureMap.redraw(self, 0)  # the initial draw (also of learnable maps)

    def redraw(self, step: int) -> None:
        if self.learnable:
            raise ValueError(
                f"{type(self).__name__} has learnable=True: its projections are trained parameters and cannot be "
                "redrawn (use learnable=False for redrawn random features)"
            )
        super().redraw(step)

    def _draw(self, generator: torch.Generator) -> None:
        w = draw_projection(self.num_features, self.head_dim, generator, self.orthogonal)
        self.omega.copy_(w.to(self.omega.device))

    def extra_repr(self) -> str:
        return super().extra_repr() + (", learnable=True" if self.learnable else "")
