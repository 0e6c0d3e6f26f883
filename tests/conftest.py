import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def paired_grads(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, inputs, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(fast, twin)`` gradient pairs w.r.t. ``inputs`` of two attention outputs ``[B, H, N, D]``
    under the same seeded random upstream gradient, zero at padded queries (``mask`` ``[B, N]``)."""
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * mask[:, None, :, None]
    return list(zip(torch.autograd.grad((out * up).sum(), inputs), torch.autograd.grad((ref * up).sum(), inputs)))


@pytest.fixture
def rel_err():
    return rel


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where no CUDA device is visible."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
