"""Regional ``torch.compile`` of a converted model for training.

``compile_layers(model)`` compiles every decoder layer (each element of a ``ModuleList`` that holds
a converted attention module) with ``layer.compile(...)``: the layers share one compiled graph
(their parameters are graph inputs), so compiling costs one layer's trace, not the model's. With
``fullgraph=True`` (the default) the recomputing hybrid's autograd Function
(:class:`hf_rfa.ops.hybrid.function.HybridFunction`) is traced whole — forward, and the backward
that recomputes block by block with ``torch.autograd.grad`` — so Inductor fuses its elementwise
passes too; that needs Dynamo's ``trace_autograd_ops`` option, which this function turns on
(process-wide; logged). Train with ``use_cache=False`` (as Trainer does with gradient
checkpointing): a KV cache's per-layer state would make Dynamo recompile for every layer.

Measured in ``benchmarks/train_step.py --dtypes fp32-compile`` (``docs/training.md``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .attention import RFAAttention

logger = logging.getLogger(__name__)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Elements of ``ModuleList``s that contain a converted attention module (the decoder layers)."""
    layers = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            layers += [m for m in module if any(isinstance(x, RFAAttention) for x in m.modules())]
    return layers


def compile_layers(model: nn.Module, fullgraph: bool = True, **compile_kwargs: Any) -> nn.Module:
    """Compile each decoder layer of a converted ``model`` in place (``layer.compile(fullgraph=...,
    **compile_kwargs)``) and return the model. ValueError when the model has no converted layer
    (call :func:`hf_rfa.convert` first). See the module docstring for ``use_cache=False``."""
    if not isinstance(fullgraph, bool):
        raise ValueError(f"fullgraph must be True or False, got {fullgraph!r}")
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layer with a converted attention module (call hf_rfa.convert first)")
    import torch._dynamo

    if not torch._dynamo.config.trace_autograd_ops:
        logger.info("hf_rfa.compile_layers: setting torch._dynamo.config.trace_autograd_ops = True (the hybrid's backward calls torch.autograd.grad)")
        torch._dynamo.config.trace_autograd_ops = True
    for layer in layers:
        layer.compile(fullgraph=fullgraph, **compile_kwargs)
    logger.info("hf_rfa.compile_layers: %d decoder layers compiled (fullgraph=%s)", len(layers), fullgraph)
    return model


__all__ = ["compile_layers"]
