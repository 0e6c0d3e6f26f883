"""Attention transfer (LoLCATs stage 1) and a LoRA recovery stage (stage 2).

Attention transfer trains *only* the feature-map parameters (Hedgehog's W_q/W_k and the hybrid
mixing weight ``mix``) so that each converted layer's RFA output matches its softmax output::

    loss_l = MSE( RFA_l(q_l, k_l, v_l),  softmax(q_l k_lᵀ·scale) v_l )      (per layer, pre o_proj)

q, k, v of every layer come from one *softmax* forward of the model (:func:`calibration.capture`,
no gradient); each layer's loss depends only on its own parameters, so all layers train at once
from one captured forward without back-propagating through the model. The differentiable RFA
output is the op's autograd form (:func:`calibration.rfa_output`; each layer's loss is
back-propagated at once, so without block recomputation, ``checkpoint_blocks=False``), except on
short contexts (:data:`TWIN_MAX_KEYS`), where the quadratic twin measured faster; LoRA runs the
op with the layer's own settings. ``benchmarks/transfer_forms.py`` measures both forms.

Before training, :func:`init_mixing` (:mod:`.mixing`) sets each head's ``mix`` in closed form so
that the feature part carries, on the first batch, the same (log-)mass as softmax puts on the keys
outside the exact window and sinks.

:func:`lora_finetune` (:mod:`.lora`) then trains LoRA adapters on next-token loss and merges them.

Several processes (:mod:`.distributed`): each takes its rows of every global batch and the
gradients are averaged before each step; under FSDP (:mod:`.fsdp`) the stage trains a sharded
working copy of the model instead, each trained layer's map its own FSDP unit whose gradients
FSDP reduce-scatters, and the trained values are gathered back into ``model`` at the end.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import nn

from . import distributed, fsdp, precision
from .budget import BudgetNotReached, TransferResult, check_limit
from .calibration import Captured, capture, feature_inputs, rfa_layers, rfa_output
from .devices import input_device, to_device
from .lora import TRAIN_NAME, lora_finetune, register_train
from .mixing import init_mixing
from ...ops.reference import quadratic_kernel_attention

logger = logging.getLogger(__name__)

#: The one rule for the form of attention transfer's layer outputs: the quadratic twin
#: (``quadratic_kernel_attention``, N×N per head) up to this many keys, the op's autograd form
#: above. Measured by ``benchmarks/transfer_forms.py`` (one thread; hedgehog m=64, H=9, Hkv=3,
#: D=64, forward + backward of one layer; after the op's Nq < Nk path stopped padding
#: the queries): 128 keys / 64 fitted queries (window 32): twin 7.8 ms, op 8.6 ms; 256 / 64
#: (window 64): twin 12.8, op 8.5; 256 / 256: twin 34.3, op 12.7; 1024 / 256 (the main job):
#: twin 132, op 22 (an older op, which padded the queries: 256 / 64 twin 51, op 85 ms).
TWIN_MAX_KEYS = 128


def transfer_output(rfa: nn.Module, cap: Captured, twin_max_keys: int = TWIN_MAX_KEYS) -> torch.Tensor:
    """One layer's differentiable output for attention transfer, ``[B, H, Nq, Dv]``: the quadratic
    twin for at most ``twin_max_keys`` keys (see :data:`TWIN_MAX_KEYS`), else the op's autograd form
    without block recomputation (each layer's loss is back-propagated at once)."""
    if cap.k.shape[2] <= twin_max_keys:
        fq, fk = feature_inputs(rfa, cap)
        return quadratic_kernel_attention(
            cap.q, cap.k, cap.v, rfa.feature_map, causal=cap.causal, attention_mask=cap.mask,
            window=rfa.window, sinks=rfa.sinks, scale=cap.scale,
            memory=getattr(rfa, "memory", 0), memory_every=getattr(rfa, "memory_every", 64),
            memory_score=getattr(rfa, "memory_score", "value_norm"), feature_q=fq, feature_k=fk,
        )
    return rfa_output(rfa, cap, checkpoint_blocks=False)


def rfa_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Trainable tensors of every converted layer's feature map (W, mix, ...)."""
    return [p for rfa in rfa_layers(model).values() for p in rfa.parameters()]


def _masked_mse(pred: torch.Tensor, cap: Captured) -> torch.Tensor:
    """MSE (float32) of a layer's output ``[B, H, Nq, Dv]`` against the capture's softmax output,
    over real (unpadded) query positions."""
    diff = pred.float() - cap.out.float()
    if cap.mask is None:
        return diff.pow(2).mean()
    m = cap.mask[:, None, -diff.shape[2] :, None].to(diff.dtype)
    return (diff.pow(2) * m).sum() / (m.sum() * diff.shape[1] * diff.shape[-1]).clamp_min(1)


#: Learning-rate schedules of attention transfer: factor of ``lr`` at progress ``p`` ∈ [0, 1]
#: (tokens seen / the token budget, counted before each optimiser step).
SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda p: 1.0,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * min(max(p, 0.0), 1.0))),
}


def attention_transfer(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor | None]],
    tokens: int,
    lr: float = 1e-2,
    max_seconds: float | None = None,
    init_mix: bool = True,
    progress: bool = True,
    queries: int | None = None,
    twin_max_keys: int = TWIN_MAX_KEYS,
    max_position: int | None = None,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    schedule: str = "constant",
    query_blocks: int = 1,
    layers: set[int] | None = None,
) -> TransferResult:
    """Train the feature maps of a converted ``model`` to reproduce its softmax attention outputs.

    Args:
        model: converted with :func:`hf_rfa.convert` (a learned map: ``hedgehog``, ``t2r``...).
        batches: yields ``(input_ids [B, N], attention_mask | None)``; a seeded stream gives a
            deterministic run (:func:`hf_rfa.recipes.evaluation.shuffled_batches`).
        tokens: stop after this many (real) tokens (the budget).
        max_seconds: safety limit on wall time: reaching it before ``tokens`` raises
            :class:`BudgetNotReached` (never a silently shorter run).
        lr: Adam learning rate of the feature-map parameters.
        init_mix: initialise the hybrid mixing weights from the first batch first.
        queries: causal layers: fit only the last ``queries`` positions of each sequence (they
            still attend over the whole context): fewer outputs to fit (the op still reads every key).
        twin_max_keys: the layer outputs are the quadratic twin's up to this context, the op's
            above (:func:`transfer_output`, :data:`TWIN_MAX_KEYS`).
        max_position: each sequence gets positions ``offset … offset + N − 1`` with a random
            ``offset`` in ``[0, max_position − N]`` (drawn from ``seed``), so a map applied to
            rotary-embedded q/k learns every absolute position up to ``max_position``, not only
            those below the training context. None: positions from 0.
        autocast: ``torch.bfloat16`` runs the teacher's forward and the layers' outputs under
            autocast (:mod:`.precision`; the loss in float32); None: float32.
        schedule: learning-rate schedule over the token budget, a name in :data:`SCHEDULES`
            (``"constant"``; ``"cosine"``: from ``lr`` down to 0 at the last token).
        query_blocks: causal layers with ``queries``: optimiser steps per captured sequence, step
            ``b`` fitting the ``queries`` positions that end ``b · queries`` before the sequence's
            end (with the keys they see). The teacher's forward (most of a step's time at 1,024
            tokens) is shared by ``query_blocks`` steps; the budget still counts each sequence's
            tokens once.
        layers: train only these converted layers (the others frozen, their q/k/v not captured);
            each layer's loss is still divided by the number of converted layers, so a run per
            layer gives each map the updates of the all-layers form (:mod:`.layerwise`).
    Under FSDP (:mod:`.fsdp`) a sharded copy of ``model`` trains and the result comes back into ``model``.
    Returns a :class:`TransferResult` (one loss per step: the mean over layers of the MSE).
    Raises ValueError when the converted layers have nothing to train (random maps), or for an
    unknown ``schedule`` or a ``query_blocks`` that the sequences cannot hold.
    """
    _check_settings(schedule, query_blocks, queries, max_position)
    all_layers = rfa_layers(model)
    chosen = all_layers if layers is None else {i: r for i, r in all_layers.items() if i in layers}
    params = [p for r in chosen.values() for p in r.parameters()]
    if not params:
        raise ValueError("the converted model's feature maps have no trainable parameters (random maps need no transfer)")
    plan = _Plan(
        tokens, lr, schedule, queries, query_blocks, twin_max_keys, max_position, autocast, init_mix, len(all_layers),
        set(chosen) if len(chosen) < len(all_layers) else None, progress, max_seconds, torch.Generator().manual_seed(int(seed)),
    )
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    was_training = model.training
    model.eval()
    try:
        res = _train_sharded(model, set(chosen), batches, plan) if distributed.fsdp_active() else _train(model, chosen, batches, plan)
    finally:
        for p, rg in frozen:
            p.requires_grad_(rg)
        model.train(was_training)
    logger.info("attention transfer: %d tokens, %d steps, %.1f min, mse %.3g -> %.3g", res.tokens, res.steps, res.seconds / 60, *(res.losses[0], res.losses[-1]))
    return res


def _check_settings(schedule: str, query_blocks, queries: int | None, max_position) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if isinstance(query_blocks, bool) or not isinstance(query_blocks, int) or query_blocks < 1:
        raise ValueError(f"query_blocks must be an int >= 1, got {query_blocks!r}")
    if query_blocks > 1 and queries is None:
        raise ValueError("query_blocks > 1 needs queries (the size of each block of fitted queries)")
    if max_position is not None and (isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < 1):
        raise ValueError(f"max_position must be None or a positive int, got {max_position!r}")


def check_query_blocks_reach(context: int, query_blocks: int, queries: int, window: int, sinks: int) -> None:
    """Refuse query blocks of which the earliest holds no query with a key beyond the exact window
    and sinks: its layer outputs are exact, independent of the feature map, with nothing to fit
    (a ``ValueError`` naming the settings and what would fit)."""
    last = context - (query_blocks - 1) * queries - 1  # the earliest block's last query position
    if query_blocks > 1 and last < window + sinks:
        most = max((context - 1 - window - sinks) // queries + 1, 0)
        least = (query_blocks - 1) * queries + window + sinks + 1
        fix = f"use at most {most} blocks or a context of at least {least}" if most >= 1 else f"use a context of at least {least}"
        raise ValueError(
            f"transfer_query_blocks={query_blocks} × transfer_queries={queries} at context {context}: the earliest block "
            f"(queries {last - queries + 1}–{last}) has no key beyond window {window} + {sinks} sinks, so nothing to fit; {fix}"
        )


@dataclass
class _Plan:
    """One attention-transfer run's settings (:func:`attention_transfer`'s arguments) and its
    position generator; ``sharded``: under FSDP (gradients averaged by FSDP, not here)."""

    tokens: int
    lr: float
    schedule: str
    queries: int | None
    query_blocks: int
    twin_max_keys: int
    max_position: int | None
    autocast: torch.dtype | None
    init_mix: bool
    n_layers: int
    subset: set[int] | None
    progress: bool
    max_seconds: float | None
    gen: torch.Generator
    sharded: bool = False


def _inputs(ids: torch.Tensor, mask: torch.Tensor | None, device: torch.device, plan: _Plan):
    """This process's rows of a global batch on ``device`` and their positions (``max_position``:
    a random offset drawn from the plan's generator; else None)."""
    ids, mask = distributed.shard(ids, mask)
    ids, mask = to_device(ids, device), to_device(mask, device)
    if plan.max_position is None:
        return ids, mask, None
    n_ctx = ids.shape[-1]
    if plan.max_position < n_ctx:
        raise ValueError(f"max_position ({plan.max_position}) must be at least the context ({n_ctx})")
    off = int(torch.randint(0, plan.max_position - n_ctx + 1, (1,), generator=plan.gen))
    return ids, mask, (torch.arange(n_ctx, device=device) + off).expand(ids.shape[0], n_ctx)


def _train(model: nn.Module, chosen: dict[int, nn.Module], batches, plan: _Plan, fit: Callable | None = None) -> TransferResult:
    """The loop: one teacher capture per global batch, then ``query_blocks`` optimiser steps of the
    ``chosen`` maps. ``fit(rfa, cap, twin_max_keys)``: a layer's differentiable output (default
    :func:`transfer_output`; under FSDP the map unit's registered method)."""
    from tqdm.auto import tqdm

    fit = fit or (lambda rfa, cap, t: transfer_output(rfa, cap, t))
    opt = torch.optim.Adam([p for r in chosen.values() for p in r.parameters()], lr=plan.lr)
    res = TransferResult(autocast=precision.dtype_name(plan.autocast))
    start = time.perf_counter()
    bar = tqdm(total=plan.tokens, desc="attention transfer", unit="tok", disable=not plan.progress)
    device = input_device(model)
    try:
        for ids, mask in batches:
            ids, mask, pos = _inputs(ids, mask, device, plan)
            with precision.autocast(device, plan.autocast):
                caps = capture(model, ids, mask, pos, layers=plan.subset)
            if plan.init_mix and res.steps == 0:
                init_mixing(model, caps)
            nk = ids.shape[-1]
            if res.steps == 0:
                logger.info("attention transfer: layer outputs by the %s (%d keys; the twin up to %d)", "quadratic twin" if nk <= plan.twin_max_keys else "op", nk, plan.twin_max_keys)
            n = distributed.global_tokens(int(mask.sum()) if mask is not None else ids.numel())
            if plan.query_blocks > 1 and plan.query_blocks * plan.queries > nk:
                raise ValueError(f"query_blocks ({plan.query_blocks}) × queries ({plan.queries}) exceeds the sequence length ({nk})")
            if res.steps == 0 and plan.query_blocks > 1 and next(iter(caps.values())).causal:
                for rfa in chosen.values():
                    if rfa.spec.window > 0:
                        check_query_blocks_reach(nk, plan.query_blocks, plan.queries, rfa.spec.window, rfa.spec.sinks)
            for b in range(plan.query_blocks):
                res.losses.append(_step(opt, chosen, caps, nk, b, (res.tokens + n * b / plan.query_blocks) / max(plan.tokens, 1), plan, fit, device))
                res.steps += 1
            del caps  # not alive through the next capture (peak memory)
            res.tokens += n
            bar.update(n)
            bar.set_postfix(mse=f"{res.losses[-1]:.2e}")
            if res.tokens >= plan.tokens:
                break
            check_limit("transfer", res, plan.tokens, start, plan.max_seconds)
    finally:
        bar.close()
    res.seconds = time.perf_counter() - start
    return res


def _step(opt, chosen: dict[int, nn.Module], caps: dict[int, Captured], nk: int, b: int, progress: float, plan: _Plan, fit: Callable, device) -> float:
    """One optimiser step on query block ``b`` of every chosen layer; returns the mean layer loss."""
    for group in opt.param_groups:
        group["lr"] = plan.lr * SCHEDULES[plan.schedule](progress)
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for idx, rfa in chosen.items():
        cap = caps[idx]
        if plan.queries is not None and cap.causal and plan.queries < cap.q.shape[2]:
            cap = cap.queries_ending_at(nk - b * plan.queries, plan.queries)  # b = 0: the last queries
        with precision.autocast(device, plan.autocast):
            pred = fit(rfa, cap, plan.twin_max_keys)
        loss = _masked_mse(pred, cap)
        (loss / plan.n_layers).backward()
        total += float(loss.detach())
    if not plan.sharded:
        distributed.all_reduce_grads([p for g in opt.param_groups for p in g["params"]])
    opt.step()
    return total / plan.n_layers


FIT = "hf_rfa_fit"


def _fit(rfa: nn.Module, cap: Captured, twin_max_keys: int) -> torch.Tensor:
    """A map unit's registered FSDP method (:func:`.fsdp.forward_method`): :func:`transfer_output`."""
    return transfer_output(rfa, cap, twin_max_keys)


def _train_sharded(model: nn.Module, chosen: set[int], batches, plan: _Plan) -> TransferResult:
    """Under FSDP: the mixing init on the plain ``model`` from the first batch (when asked), then
    :func:`_train` on a sharded copy (:func:`.fsdp.sharded`) where each chosen layer's map is an
    FSDP unit of its own whose :func:`transfer_output` is a registered forward method."""
    if plan.init_mix:
        batches = iter(batches)
        first = next(batches, None)
        if first is not None:
            gen = torch.Generator()
            gen.set_state(plan.gen.get_state())  # the positions the first step will draw
            ids, mask, pos = _inputs(*first, input_device(model), replace(plan, gen=gen))
            with precision.autocast(input_device(model), plan.autocast):
                init_mixing(model, capture(model, ids, mask, pos, layers=plan.subset))
            batches = itertools.chain([first], batches)
    plan = replace(plan, init_mix=False, sharded=True)
    with fsdp.sharded(model, lambda work: [r for i, r in rfa_layers(work).items() if i in chosen]) as work:
        maps = {i: r for i, r in rfa_layers(work).items() if i in chosen}
        for r in maps.values():
            fsdp.forward_method(r, FIT, _fit)
        res = _train(work, maps, batches, plan, fit=lambda rfa, cap, t: getattr(rfa, FIT)(cap, t))
        res.sharding = fsdp.storage(work)
    return res


__all__ = [
    "BudgetNotReached", "SCHEDULES", "TRAIN_NAME", "TWIN_MAX_KEYS", "TransferResult", "attention_transfer", "init_mixing", "lora_finetune",
    "register_train", "rfa_parameters", "transfer_output",
]
