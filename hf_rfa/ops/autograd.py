"""Autograd helpers of the recomputing Functions (:mod:`hf_rfa.ops.feature.recompute`,
:mod:`hf_rfa.ops.band.recompute`, :mod:`hf_rfa.ops.hybrid.function`): block-local leaves, gradients
of the live outputs, and the feature map's parameters passed through a Function and bound again in
backward (so ``torch.func.functional_call`` and substitute parameters are honoured)."""

from __future__ import annotations

import torch


def leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    """A block-local autograd leaf (floating tensors only)."""
    if x is None or not x.is_floating_point():
        return x
    return x.detach().requires_grad_()


def grads(outputs: list, grad_outputs: list, inputs: list) -> list:
    """``torch.autograd.grad`` over the pairs whose output needs a gradient; None for inputs
    that are None or unused."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o is not None and g is not None and o.requires_grad]
    live = [x for x in inputs if x is not None and x.requires_grad]
    if not pairs or not live:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], live, [g for _, g in pairs], allow_unused=True))
    return [next(got) if x is not None and x.requires_grad else None for x in inputs]


def add_grad(acc: torch.Tensor | None, g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return acc
    return g.clone() if acc is None else acc.add_(g)


def map_params(feature_map) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """The feature map's parameters as ``(names, tensors)`` (``named_parameters()``; frozen ones
    too; none for a map that is not a Module): what the recomputing Functions take as ``*params``
    and bind again in backward (:func:`with_params`). Under :func:`torch.func.functional_call`
    these are the substitute tensors."""
    if not isinstance(feature_map, torch.nn.Module):
        return (), ()
    named = list(feature_map.named_parameters())
    return tuple(n for n, _ in named), tuple(p for _, p in named)


class _Bind(torch.nn.Module):
    """Holds the feature map so that :func:`torch.func.functional_call` can rebind its
    parameters (as ``fm.<name>``) around any callable, not only the map's ``forward``."""

    def __init__(self, feature_map: torch.nn.Module) -> None:
        super().__init__()
        self.fm = feature_map

    def forward(self, fn):
        return fn()


def own_params(feature_map, names: tuple[str, ...], tensors) -> bool:
    """Whether ``tensors`` are the feature map's own parameters ``names`` (the same objects; not
    substitutes bound by :func:`torch.func.functional_call`)."""
    own = dict(feature_map.named_parameters())
    return all(own.get(n) is t for n, t in zip(names, tensors))


def with_params(feature_map, names: tuple[str, ...], tensors, fn):
    """``fn()`` with the feature map's parameters ``names`` bound to ``tensors`` (by
    :func:`torch.func.functional_call`; the map's own parameters are restored afterwards). The
    recomputing Functions run their backward's recomputation in it, on leaves of the parameter
    tensors passed to forward — never on whatever the map holds when backward runs (which differs
    under ``functional_call`` or after an in-place update)."""
    if not names:
        return fn()
    if own_params(feature_map, names, tensors):  # already bound (forward, outside functional_call):
        return fn()  # nothing to rebind — and no module mutation for torch.compile to break its graph on
    return torch.func.functional_call(_Bind(feature_map), {"fm." + n: t for n, t in zip(names, tensors)}, (fn,))


def param_leaves(params, needs) -> list:
    """Block-local leaves of the saved parameter tensors ``params``: requiring a gradient where
    ``needs`` (the Function's ``needs_input_grad`` of each) says so, detached otherwise."""
    return [p.detach().requires_grad_(bool(nd) and p.is_floating_point()) for p, nd in zip(params, needs)]


__all__ = ["add_grad", "grads", "leaf", "map_params", "own_params", "param_leaves", "with_params"]
