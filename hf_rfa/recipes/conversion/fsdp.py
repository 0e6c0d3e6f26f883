"""FSDP2 sharding of the conversion's training stages (attention transfer and LoRA).

Under FSDP (:func:`.distributed.fsdp_active`: ``accelerate launch`` with an FSDP config, or
``hf-rfa-convert --fsdp``), each training stage trains a **sharded working copy** of its model:

1. :func:`sharded` deep-copies the module tree, sharing the parameter tensors (no second copy of
   any weight), and applies PyTorch's FSDP2 to the copy (``torch.distributed.fsdp.fully_shard``):
   the stage's own units first (attention transfer: each trained layer's feature map), then every
   decoder layer (the model's ``_no_split_modules``, as Accelerate's transformer wrap policy), then
   the root. Each process keeps 1/N of every tensor (its rows along dim 0);
2. the plain model's parameters then release their storage: while the stage trains, every process
   holds 1/N of the frozen weights, plus one unit's gathered weights during its forward/backward;
3. the stage runs its usual loop on the copy: FSDP all-gathers each unit before it runs and
   reduce-scatters (averages) the gradients after the backward (the manual
   :func:`.distributed.all_reduce_grads` is skipped); the optimiser steps on the shards;
4. on exit every parameter is gathered in full (``DTensor.full_tensor``, the same order in every
   process) back into the plain model, which is then what it would be without FSDP: evaluation,
   the window-only baseline's copy, PEFT's merge and the export see ordinary tensors.

Why the copy and not the model itself: ``fully_shard`` changes a module in place (its class, its
parameters, its hooks) and has no inverse; PEFT must wrap the projections *before* sharding (its
adapters are then sharded with their layer) and merge them into ordinary tensors after. Why
evaluation runs on the gathered model: it then needs no collective at all (every process runs its
own windows, as without FSDP), so uneven window counts cannot leave processes waiting on each other;
the cost is the full weights on every device outside the training stages (the memory plan's *eval*
column).
"""

from __future__ import annotations

import copy
import logging
import types
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from . import distributed

logger = logging.getLogger(__name__)

_MESH: dict = {}


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an FSDP2 unit (``fully_shard`` applied to it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without torch.distributed
        return False
    return isinstance(model, FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder (or encoder) layers of ``model``: the classes named in its ``_no_split_modules``
    (what Accelerate's transformer wrap policy wraps), else every element of a ``ModuleList`` that
    holds an attention module."""
    from ...hf.convert import find_attention_modules

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    attn = {id(m) for _, m, _ in find_attention_modules(model)}
    return [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m if any(id(x) in attn for x in c.modules())]


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    p = distributed.processes()
    kind = p.device.type if p.device is not None else "cpu"
    if kind not in _MESH:
        _MESH[kind] = init_device_mesh(kind, (p.world,))
    return _MESH[kind]


@contextmanager
def sharded(model: nn.Module, units: Callable[[nn.Module], list[nn.Module]] | None = None) -> Iterator[nn.Module]:
    """Yield an FSDP2-sharded working copy of ``model`` (see the module docstring); on exit the
    copy's parameters are gathered back into ``model`` (same parameter objects, full values).

    ``units(copy)``: modules of the copy to shard as units of their own before the decoder layers
    (their parameters then leave the layers' units)."""
    from torch.distributed.fsdp import fully_shard

    params = dict(model.named_parameters())
    work = copy.deepcopy(model, {id(p): p for p in params.values()})
    mesh = _mesh()
    for unit in [*(units(work) if units is not None else []), *decoder_layers(work)]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(work, mesh=mesh, reshard_after_forward=True)
    for p in params.values():  # each process now holds its shard only
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    s = storage(work)
    logger.info("FSDP over %d processes: this process holds %d of the %d parameters", s["processes"], s["local_parameters"], s["parameters"])
    try:
        yield work
    finally:
        gather_into(work, params)
        del work


@torch.no_grad()
def gather_into(work: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """Every parameter of the sharded ``work`` in full into ``params`` (by name; a collective:
    every process gathers the same tensors in the same order)."""
    from torch.distributed.tensor import DTensor

    for name, p in work.named_parameters():
        params[name].data = p.full_tensor() if isinstance(p, DTensor) else p.detach()


def storage(model: nn.Module) -> dict[str, int]:
    """``{"processes", "local_parameters", "parameters"}``: the numbers this process stores (its
    shards) and the model's full count."""
    from torch.distributed.tensor import DTensor

    local = total = 0
    for p in model.parameters():
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        total += p.numel()
    return {"processes": distributed.processes().world, "local_parameters": local, "parameters": total}


def forward_method(module: nn.Module, name: str, fn: Callable) -> None:
    """Bind ``fn(module, ...)`` as ``module.<name>`` and register it with FSDP
    (``register_fsdp_forward_method``): calling it all-gathers the unit's parameters first and
    reduce-scatters their gradients after the backward, as a forward would."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(module, name, types.MethodType(fn, module))
    register_fsdp_forward_method(module, name)


__all__ = ["decoder_layers", "forward_method", "gather_into", "is_sharded", "sharded", "storage"]
