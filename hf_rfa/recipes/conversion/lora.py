"""The LoRA recovery stage (LoLCATs stage 2): LoRA adapters on next-token loss, merged back.

:func:`lora_finetune` wraps the stock attention projections with PEFT adapters
(``hf_rfa.recipes.training.peft_utils.lora_config``), trains them through the ``"rfa"`` attention
(:func:`register_train`) and merges them, returning a plain converted model. Its objective
(:data:`OBJECTIVES`): ``"next_token"``, the cross-entropy on the training text (LoLCATs), or
``"distill"``, the divergence from the original model's next-token distribution at every position
(the same weights with the adapters off and exact softmax attention, one more forward per step;
RADLADS distils a converted model's logits from its teacher's the same way): the adapters then make
up for the approximation instead of also adapting the model to the training text.
Several processes (:mod:`.distributed`): each takes its rows of every global batch and the
gradients are averaged before each step; under FSDP (:mod:`.fsdp`) the adapters are added first,
then a sharded copy of the wrapped model trains (FSDP reduce-scatters the gradients) and its
trained values come back into the wrapped model before the merge.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from . import distributed, fsdp, precision
from .budget import TransferResult, check_limit
from .calibration import CAPTURE_NAME, attn_implementation, register_capture, rfa_layers
from .devices import input_device, to_device
from .lm_loss import causal_lm_loss, distill_loss, kl_from_logits, supports_chunked_loss
from ...hf.loading import is_converted
from ...ops.backends import training_backend

logger = logging.getLogger(__name__)

TRAIN_NAME = "hf_rfa_train"
#: LoRA objectives: next-token cross-entropy on the text, or KL from the original model's predictions
OBJECTIVES = ("next_token", "distill")


def _train_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function for training (LoRA) and for evaluation in the recipes: the ``"rfa"``
    attention itself (:func:`hf_rfa.hf.attention.rfa_attention_forward`, the layer's
    :class:`~hf_rfa.hf.attention.RFAAttention` — what a user's Trainer runs: q/k/v in the autocast
    dtype under autocast, the rotary embedding undone block by block inside the op), except that a
    layer set to an inference-only backend runs ``"auto"`` when the call records a graph."""
    from ...hf.attention import BACKEND_KWARG, rfa_attention_forward

    rfa = getattr(module, "rfa", None)
    if rfa is not None:
        kwargs[BACKEND_KWARG] = training_backend(rfa.backend)
    return rfa_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def register_train() -> None:
    """Register the training attention function (the op's autograd form) and its mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ...hf.attention import rfa_mask

    AttentionInterface.register(TRAIN_NAME, _train_forward)
    AttentionMaskInterface.register(TRAIN_NAME, rfa_mask)


def lora_finetune(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor | None]],
    tokens: int,
    lr: float = 1e-3,
    r: int = 8,
    max_seconds: float | None = None,
    progress: bool = True,
    train_feature_maps: bool = False,
    autocast: torch.dtype | None = None,
    activation_checkpointing: bool = False,
    objective: str = "next_token",
) -> tuple[nn.Module, TransferResult]:
    """LoRA (r, on the stock attention projections) on next-token loss; returns the *merged*
    converted model and a :class:`TransferResult`. An unconverted model (no ``rfa`` layer) trains
    with its own attention: the same budget on the original is the reference for how much of a
    LoRA's gain is adaptation to the text rather than to the conversion. ``autocast``:
    ``torch.bfloat16`` runs each forward under autocast (:mod:`.precision`; adapters and loss stay
    float32); None: float32. Feature maps stay frozen unless
    ``train_feature_maps`` (then their parameters, e.g. a ``decay``, train end to end with the
    adapters: PEFT's ``modules_to_save`` copies, folded back by the merge).
    ``activation_checkpointing``: each decoder layer's activations are recomputed in the backward
    (transformers' ``activation_checkpointing_enable``, non-reentrant) instead of held, for this
    stage only. ``objective``: one of :data:`OBJECTIVES` (module docstring). Causal LMs only
    (labels = inputs)."""
    from ..training.peft_utils import lora_config, wrap_with_lora

    register_train()
    if not isinstance(train_feature_maps, bool):
        raise ValueError(f"train_feature_maps must be a bool, got {train_feature_maps!r}")
    if train_feature_maps and not [p for rfa in rfa_layers(model).values() for p in rfa.parameters()]:
        raise ValueError("train_feature_maps=True, but the converted model's feature maps have no trainable parameters")
    if not isinstance(activation_checkpointing, bool):
        raise ValueError(f"activation_checkpointing must be a bool, got {activation_checkpointing!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
    peft_model = wrap_with_lora(model, lora_config(model, r=r, train_feature_maps=train_feature_maps))
    peft_model.train()
    with checkpointed_layers(model, activation_checkpointing):
        if distributed.fsdp_active():
            with fsdp.sharded(peft_model) as work:
                res = _train(work, batches, tokens, lr, max_seconds, progress, autocast, objective, sharded=True)
                res.sharding = fsdp.storage(work)
        else:
            res = _train(peft_model, batches, tokens, lr, max_seconds, progress, autocast, objective)
    res.activation_checkpointing = activation_checkpointing
    merged = peft_model.merge_and_unload()
    merged.eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    logger.info("LoRA: %d tokens, %d steps, %.1f min, loss %.3f -> %.3f", res.tokens, res.steps, res.seconds / 60, res.losses[0], res.losses[-1])
    return merged, res


@contextlib.contextmanager
def checkpointed_layers(model: nn.Module, on: bool = True):
    """Within the block, ``model``'s decoder layers recompute their activations in the backward
    (transformers' activation checkpointing, non-reentrant: the same values and gradients); the
    model's previous setting is put back afterwards. ``on=False``: nothing changes. A model whose
    class does not support it is refused (ValueError naming it)."""
    if not on:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation_checkpointing: {type(model).__name__} does not support transformers' activation checkpointing; run without it")
    was = bool(getattr(model, "is_activation_checkpointing", False))
    hooked = bool(getattr(model, "_require_grads_hooks", None))
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    try:
        yield
    finally:
        if not was:
            model.activation_checkpointing_disable()
            if not hooked:  # (enabling also made the input embeddings' output require grad)
                model.disable_input_require_grads()


@dataclass
class SavedWeights:
    """What :func:`target_weights` copied: ``values`` of the LoRA targets' weights and biases by
    parameter name, and every parameter's ``requires_grad``."""

    values: dict[str, torch.Tensor]
    requires_grad: dict[str, bool]


def target_weights(model: nn.Module) -> SavedWeights:
    """Copies of what a LoRA merge changes in ``model``: the weights (and biases) of the LoRA
    target projections, and every parameter's ``requires_grad`` (:func:`lora_finetune` freezes the
    merged model). The window-only baseline trains its LoRA on the model itself and puts these back
    afterwards (:func:`restore_weights`) instead of training a copy of the whole model: on
    Llama-shaped models about a tenth of the weights' memory instead of all of it."""
    from ..training.peft_utils import lora_targets

    targets = set(lora_targets(model))
    values = {
        f"{name}.{pn}": p.detach().clone()
        for name, m in model.named_modules() if name.split(".")[-1] in targets
        for pn, p in m.named_parameters(recurse=False)
    }
    return SavedWeights(values, {n: p.requires_grad for n, p in model.named_parameters()})


@torch.no_grad()
def restore_weights(model: nn.Module, saved: SavedWeights) -> None:
    """Put back what :func:`target_weights` copied, bit for bit, and every ``requires_grad``."""
    params = dict(model.named_parameters())
    missing = sorted(set(saved.values) - set(params))
    if missing:
        raise ValueError(f"cannot restore {missing[:3]}: the model has no such parameters")
    for name, value in saved.values.items():
        params[name].copy_(value)
    for name, grad in saved.requires_grad.items():
        if name in params:
            params[name].requires_grad_(grad)


def _train(
    peft_model: nn.Module, batches, tokens: int, lr: float, max_seconds: float | None, progress: bool, autocast: torch.dtype | None,
    objective: str = "next_token", sharded: bool = False,
) -> TransferResult:
    """The LoRA loop on ``peft_model`` (sharded: FSDP averages the gradients in the backward)."""
    from tqdm.auto import tqdm

    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    res = TransferResult()
    start = time.perf_counter()
    bar = tqdm(total=tokens, desc="LoRA", unit="tok", disable=not progress)
    base = peft_model.get_base_model()
    device = input_device(base)
    res.autocast = precision.dtype_name(autocast)
    chunked = supports_chunked_loss(base)
    distill = objective == "distill"
    if distill:
        register_capture()  # (the teacher's exact attention)
    if sharded and (chunked or distill):  # FSDP: the loss runs as a forward of the root unit, which gathers its head
        fsdp.forward_method(peft_model, "lm_loss", _loss)
    res.chunked_loss = chunked
    res.objective = objective
    try:
        with attn_implementation(base, TRAIN_NAME) if is_converted(base) else contextlib.nullcontext():
            for ids, mask in batches:
                ids, mask = distributed.shard(ids, mask)
                ids, mask = to_device(ids, device), to_device(mask, device)
                labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
                with precision.autocast(device, autocast):
                    if sharded and (chunked or distill):
                        loss = peft_model.lm_loss(ids, mask, labels, chunked, distill)
                    else:
                        loss = _loss(peft_model, ids, mask, labels, chunked, distill)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                res.losses.append(float(loss.detach()))
                # keep only the number: the loss with its spent graph (and the model output with its
                # [B, N, vocab] logits) must not stay alive through the next step's forward, where
                # they would add to the peak memory (benchmarks/train_step.py --release-loss)
                del loss
                if not sharded:
                    distributed.all_reduce_grads(params)
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                n = distributed.global_tokens(int(mask.sum()) if mask is not None else ids.numel())
                res.tokens += n
                res.steps += 1
                bar.update(n)
                bar.set_postfix(loss=f"{res.losses[-1]:.3f}")
                if res.tokens >= tokens:
                    break
                check_limit("lora", res, tokens, start, max_seconds)
    finally:
        bar.close()
    res.seconds = time.perf_counter() - start
    return res


def _loss(peft_model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor, chunked: bool, distill: bool) -> torch.Tensor:
    """One step's loss: next-token cross-entropy, or (``distill``) the mean KL from the teacher —
    ``peft_model`` with its adapters off under exact softmax attention, no gradient — each without
    the full logits in memory where ``chunked`` (:mod:`.lm_loss`)."""
    base = peft_model.get_base_model()
    if not distill:
        if chunked:
            return causal_lm_loss(base, ids, mask, labels)
        return peft_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    with torch.no_grad(), peft_model.disable_adapter(), attn_implementation(base, CAPTURE_NAME):
        if chunked:
            teacher = base.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        else:
            teacher = base(input_ids=ids, attention_mask=mask, use_cache=False).logits
    if chunked:
        return distill_loss(base, ids, mask, labels, teacher)
    logits = peft_model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    valid = labels[:, 1:].to(logits.device) != -100
    return kl_from_logits(logits[:, :-1], teacher[:, :-1], valid) / valid.sum().clamp(min=1)


__all__ = ["OBJECTIVES", "TRAIN_NAME", "checkpointed_layers", "lora_finetune", "register_train", "SavedWeights", "restore_weights", "target_weights"]
