"""Layer-by-layer attention transfer (``--transfer-layerwise``).

The all-layers form (:func:`.transfer.attention_transfer`) captures every layer's q, k, v and
softmax output from one teacher forward and trains every map at once: its activation memory grows
with the number of layers. Here each converted layer is trained on its own pass over the same
seeded batch stream: the teacher's forward runs only up to that layer (it stops after capturing it,
:func:`.calibration.capture` with ``layers``), only that layer's tensors are held, and only its
map trains. Each layer's loss depends only on its own map and Adam updates every tensor on its own,
and each layer's loss is divided by the number of layers as in the all-layers form: the maps come
out the same as the all-layers form's (same data order, seed and schedule), for L teacher forwards
(of growing depth) per batch instead of one. Under FSDP (:mod:`.fsdp`) each layer's pass trains a
sharded copy of its own and its teacher forwards run through every layer (a sharded model's forward
is not cut short: every process must gather and release the same units).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch
from torch import nn

from .calibration import rfa_layers
from .transfer import TransferResult, attention_transfer

logger = logging.getLogger(__name__)


def attention_transfer_layerwise(
    model: nn.Module,
    make_batches: Callable[[], Iterator[tuple[torch.Tensor, torch.Tensor | None]]],
    tokens: int,
    max_seconds: float | None = None,
    **kwargs,
) -> TransferResult:
    """Train each converted layer's map in turn on a fresh ``make_batches()`` stream of ``tokens``.

    ``kwargs`` are :func:`.transfer.attention_transfer`'s (lr, queries, schedule, autocast, ...).
    ``max_seconds`` is the safety limit of the whole stage, shared by the layers. Returns one
    :class:`~.transfer.TransferResult`: the tokens of one pass (each layer sees the same ones),
    every layer's steps, and per step the summed per-layer losses (the all-layers form's loss)."""
    import time

    layers = sorted(rfa_layers(model))
    out = TransferResult()
    start = time.perf_counter()
    for i in layers:
        left = None if max_seconds is None else max(max_seconds - (time.perf_counter() - start), 0.0)
        r = attention_transfer(model, make_batches(), tokens, max_seconds=left, layers={i}, **kwargs)
        out.tokens = max(out.tokens, r.tokens)
        out.steps += r.steps
        out.losses = [a + b for a, b in zip(out.losses, r.losses)] if out.losses else list(r.losses)
        out.autocast = r.autocast
        out.sharding = r.sharding  # under FSDP: what a process stored while a layer's map trained
        logger.info("layer-by-layer transfer: layer %d done (%d steps, mse %.3g -> %.3g)", i, r.steps, r.losses[0], r.losses[-1])
    out.seconds = time.perf_counter() - start
    return out


__all__ = ["attention_transfer_layerwise"]
