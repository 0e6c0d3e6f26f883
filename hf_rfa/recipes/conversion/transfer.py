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

Before training, :func:`init_mixing` sets each head's ``mix`` in closed form so that the feature
part carries, on the first batch, the same (log-)mass as softmax puts on the keys outside the
exact window and sinks.

:func:`lora_finetune` then trains LoRA adapters (``hf_rfa.recipes.training.peft_utils.lora_config``) on
next-token loss and merges them, returning a plain converted model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from . import distributed, precision
from .devices import input_device, to_device
from ...hf.loading import is_converted
from .calibration import Captured, attn_implementation, capture, feature_inputs, rfa_layers, rfa_output
from ...ops.backends import training_backend
from ...ops.masks import NEG, key_mask_bool, sink_mask
from ...ops.reference import quadratic_kernel_attention

logger = logging.getLogger(__name__)

TRAIN_NAME = "hf_rfa_train"
#: The one rule for the form of attention transfer's layer outputs: the quadratic twin
#: (``quadratic_kernel_attention``, N×N per head) up to this many keys, the op's autograd form
#: above. Measured by ``benchmarks/transfer_forms.py`` (one thread; hedgehog m=64, H=9, Hkv=3,
#: D=64, forward + backward of one layer; after the op's Nq < Nk path stopped padding
#: the queries): 128 keys / 64 fitted queries (window 32): twin 7.8 ms, op 8.6 ms; 256 / 64
#: (window 64): twin 12.8, op 8.5; 256 / 256: twin 34.3, op 12.7; 1024 / 256 (the main job):
#: twin 132, op 22 (an older op, which padded the queries: 256 / 64 twin 51, op 85 ms).
TWIN_MAX_KEYS = 128


@dataclass
class TransferResult:
    """What a training stage did: tokens seen, optimiser steps, wall seconds, loss history."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    autocast: str | None = None  # "bf16" when the stage ran under autocast (precision.dtype_name)

    def as_dict(self) -> dict:
        first = self.losses[0] if self.losses else None
        last = self.losses[-1] if self.losses else None
        out = {"tokens": self.tokens, "steps": self.steps, "minutes": self.seconds / 60, "loss_first": first, "loss_last": last}
        if self.autocast is not None:
            out["autocast"] = self.autocast
        return out


class BudgetNotReached(RuntimeError):
    """A training stage hit its wall-clock safety limit before its token budget.

    Budgets are counted in tokens so that a run's figures do not depend on how fast (or busy) the
    machine was; the wall-clock limit only guards against a run that would never end, and fails
    loudly instead of silently training less.
    """


def _check_limit(stage: str, res: "TransferResult", tokens: int, start: float, max_seconds: float | None) -> None:
    if max_seconds is not None and res.tokens < tokens and time.perf_counter() - start >= max_seconds:
        raise BudgetNotReached(
            f"{stage} hit its safety limit of {max_seconds / 60:.1f} min after {res.tokens} of {tokens} tokens "
            f"({res.steps} steps); the budget is in tokens so that results do not depend on machine speed: "
            f"raise the limit (--{stage.split()[0].lower()}-minutes) or lower the token budget"
        )


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


def _regions(cap: Captured, window: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, far) bool masks ``[B, 1, N, N]``: keys answered exactly / by the features."""
    b, n, dev = cap.q.shape[0], cap.k.shape[2], cap.q.device
    t = torch.arange(n, device=dev).view(-1, 1)
    s = torch.arange(n, device=dev).view(1, -1)
    visible = (s <= t) if cap.causal else torch.ones(n, n, dtype=torch.bool, device=dev)
    visible = visible.view(1, 1, n, n)
    km = key_mask_bool(cap.mask, b, n, cap.q.device)
    if km is not None:
        visible = visible & km.view(b, 1, 1, n)
    exact = torch.zeros(1, 1, n, n, dtype=torch.bool, device=dev)
    if window > 0:
        exact = (((s <= t) & (s > t - window)) if cap.causal else ((s - t).abs() < window)).view(1, 1, n, n)
    if sinks > 0:
        exact = exact | sink_mask(km, b, n, sinks, cap.q.device).view(b, 1, 1, n)
    exact = exact & visible
    return exact, visible & ~exact


@torch.no_grad()
def init_mixing(model: nn.Module, caps: dict[int, Captured]) -> int:
    """Closed-form init of each hybrid head's ``mix``: mean over queries of
    ``log Σ_far exp(q·k·scale) − log Σ_far φ(q)·φ(k)`` (far = keys not in window/sinks; with a
    ``decay``, each feature term times its decay γ^(t−s)).

    Returns the number of layers initialised (maps without ``hybrid_mix`` are skipped).
    """
    done = 0
    for idx, rfa in rfa_layers(model).items():
        fm = rfa.feature_map
        if not getattr(fm, "hybrid_mix", False) or (rfa.window == 0 and rfa.sinks == 0) or idx not in caps:
            continue
        cap = caps[idx]
        b, h, n, d = cap.q.shape
        g = h // cap.k.shape[1]
        scale = d**-0.5 if cap.scale is None else cap.scale
        xq, xk = cap.q.float() * scale**0.5, cap.k.float() * scale**0.5
        fq, fk = feature_inputs(rfa, cap)
        xq_f, xk_f = (xq, xk) if fq is None else (fq.float() * scale**0.5, fk.float() * scale**0.5)
        phi_q = fm.forward_queries(xq_f).phi
        phi_k = fm.forward_keys(xk_f).phi.repeat_interleave(g, 1)
        scores = xq @ xk.repeat_interleave(g, 1).transpose(-1, -2)  # [B,H,N,N]
        _, far = _regions(cap, rfa.window, rfa.sinks)
        far = far.expand(b, h, n, n)
        target = torch.logsumexp(torch.where(far, scores, torch.full_like(scores, NEG)), -1)
        w = phi_q @ phi_k.transpose(-1, -2)
        rate = getattr(fm, "decay_log_rate", None)
        if rate is not None:  # a decayed feature state: key s reaches query t with weight γ^(t−s)
            r = rate.detach().to(w.dtype).exp()
            r = r.expand(h) if r.numel() == 1 else r.repeat_interleave(h // r.numel())
            pos = torch.arange(n, device=w.device)
            dist = (pos.view(-1, 1) - pos.view(1, -1)).clamp_min(0).to(w.dtype)
            w = w * torch.exp(-r.view(1, h, 1, 1) * dist)
        feat = torch.log((w * far).sum(-1).clamp_min(1e-30))
        rows = far.any(-1)  # [B,H,N]
        diff = torch.where(rows, target - feat, torch.zeros_like(target)).sum((0, 2)) / rows.sum((0, 2)).clamp_min(1)
        if fm.mix.numel() == 1:
            diff = diff.mean().view(1)
        fm.mix.copy_(diff.to(fm.mix.dtype))
        done += 1
    logger.info("initialised the hybrid mix of %d layers from data", done)
    return done


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
    Returns a :class:`TransferResult` (one loss per step: the mean over layers of the MSE).
    Raises ValueError when the converted layers have nothing to train (random maps), or for an
    unknown ``schedule`` or a ``query_blocks`` that the sequences cannot hold.
    """
    from tqdm.auto import tqdm

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if isinstance(query_blocks, bool) or not isinstance(query_blocks, int) or query_blocks < 1:
        raise ValueError(f"query_blocks must be an int >= 1, got {query_blocks!r}")
    if query_blocks > 1 and queries is None:
        raise ValueError("query_blocks > 1 needs queries (the size of each block of fitted queries)")
    all_layers = rfa_layers(model)
    layers = all_layers if layers is None else {i: r for i, r in all_layers.items() if i in layers}
    params = [p for r in layers.values() for p in r.parameters()]
    if not params:
        raise ValueError("the converted model's feature maps have no trainable parameters (random maps need no transfer)")
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    n_layers, subset = len(all_layers), (set(layers) if len(layers) < len(all_layers) else None)
    opt = torch.optim.Adam(params, lr=lr)
    res = TransferResult()
    start = time.perf_counter()
    bar = tqdm(total=tokens, desc="attention transfer", unit="tok", disable=not progress)
    was_training = model.training
    gen = torch.Generator().manual_seed(int(seed))
    if max_position is not None and (isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < 1):
        raise ValueError(f"max_position must be None or a positive int, got {max_position!r}")
    model.eval()
    device = input_device(model)
    res.autocast = precision.dtype_name(autocast)
    try:
        for ids, mask in batches:
            ids, mask = distributed.shard(ids, mask)  # this process's rows of the global batch
            ids, mask = to_device(ids, device), to_device(mask, device)
            pos = None
            if max_position is not None:
                n_ctx = ids.shape[-1]
                if max_position < n_ctx:
                    raise ValueError(f"max_position ({max_position}) must be at least the context ({n_ctx})")
                off = int(torch.randint(0, max_position - n_ctx + 1, (1,), generator=gen))
                pos = (torch.arange(n_ctx, device=device) + off).expand(ids.shape[0], n_ctx)
            with precision.autocast(device, autocast):
                caps = capture(model, ids, mask, pos, layers=subset)
            if init_mix and res.steps == 0:
                init_mixing(model, caps)
            nk = ids.shape[-1]
            if res.steps == 0:
                logger.info("attention transfer: layer outputs by the %s (%d keys; the twin up to %d)", "quadratic twin" if nk <= twin_max_keys else "op", nk, twin_max_keys)
            n = distributed.global_tokens(int(mask.sum()) if mask is not None else ids.numel())
            if query_blocks > 1 and query_blocks * queries > nk:
                raise ValueError(f"query_blocks ({query_blocks}) × queries ({queries}) exceeds the sequence length ({nk})")
            for b in range(query_blocks):
                for group in opt.param_groups:
                    group["lr"] = lr * SCHEDULES[schedule]((res.tokens + n * b / query_blocks) / max(tokens, 1))
                opt.zero_grad(set_to_none=True)
                total = 0.0
                for idx, rfa in layers.items():
                    cap = caps[idx]
                    if queries is not None and cap.causal and queries < cap.q.shape[2]:
                        cap = cap.queries_ending_at(nk - b * queries, queries)  # b = 0: the last queries
                    with precision.autocast(device, autocast):
                        pred = transfer_output(rfa, cap, twin_max_keys)
                    loss = _masked_mse(pred, cap)
                    (loss / n_layers).backward()
                    total += float(loss.detach())
                distributed.all_reduce_grads(params)
                opt.step()
                res.steps += 1
                res.losses.append(total / n_layers)
            del caps, cap, pred, loss  # not alive through the next capture (peak memory)
            res.tokens += n
            bar.update(n)
            bar.set_postfix(mse=f"{res.losses[-1]:.2e}")
            if res.tokens >= tokens:
                break
            _check_limit("transfer", res, tokens, start, max_seconds)
    finally:
        bar.close()
        for p, rg in frozen:
            p.requires_grad_(rg)
        model.train(was_training)
    res.seconds = time.perf_counter() - start
    logger.info("attention transfer: %d tokens, %d steps, %.1f min, mse %.3g -> %.3g", res.tokens, res.steps, res.seconds / 60, *(res.losses[0], res.losses[-1]))
    return res


# --------------------------------------------------------------------------- LoRA stage
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
) -> tuple[nn.Module, TransferResult]:
    """LoRA (r, on the stock attention projections) on next-token loss; returns the *merged*
    converted model and a :class:`TransferResult`. An unconverted model (no ``rfa`` layer) trains
    with its own attention: the same budget on the original is the reference for how much of a
    LoRA's gain is adaptation to the text rather than to the conversion. ``autocast``:
    ``torch.bfloat16`` runs each forward under autocast (:mod:`.precision`; adapters and loss stay
    float32); None: float32. Feature maps stay frozen unless
    ``train_feature_maps`` (then their parameters, e.g. a ``decay``, train end to end with the
    adapters: PEFT's ``modules_to_save`` copies, folded back by the merge). Causal LMs only
    (labels = inputs)."""
    from peft import get_peft_model
    from tqdm.auto import tqdm

    from ..training.peft_utils import lora_config

    register_train()
    if not isinstance(train_feature_maps, bool):
        raise ValueError(f"train_feature_maps must be a bool, got {train_feature_maps!r}")
    if train_feature_maps and not rfa_parameters(model):
        raise ValueError("train_feature_maps=True, but the converted model's feature maps have no trainable parameters")
    cfg = lora_config(model, r=r, train_feature_maps=train_feature_maps)
    peft_model = get_peft_model(model, cfg)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    res = TransferResult()
    start = time.perf_counter()
    bar = tqdm(total=tokens, desc="LoRA", unit="tok", disable=not progress)
    base = peft_model.get_base_model()
    peft_model.train()
    device = input_device(base)
    res.autocast = precision.dtype_name(autocast)
    try:
        with attn_implementation(base, TRAIN_NAME) if is_converted(base) else contextlib.nullcontext():
            for ids, mask in batches:
                ids, mask = distributed.shard(ids, mask)
                ids, mask = to_device(ids, device), to_device(mask, device)
                labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
                with precision.autocast(device, autocast):
                    loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                res.losses.append(float(loss.detach()))
                # keep only the number: the loss with its spent graph (and the model output with its
                # [B, N, vocab] logits) must not stay alive through the next step's forward, where
                # they would add to the peak memory (benchmarks/train_step.py --release-loss)
                del loss
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
                _check_limit("lora", res, tokens, start, max_seconds)
    finally:
        bar.close()
    merged = peft_model.merge_and_unload()
    merged.eval()
    for p in merged.parameters():
        p.requires_grad_(False)
    res.seconds = time.perf_counter() - start
    logger.info("LoRA: %d tokens, %d steps, %.1f min, loss %.3f -> %.3f", res.tokens, res.steps, res.seconds / 60, res.losses[0], res.losses[-1])
    return merged, res


__all__ = [
    "BudgetNotReached", "SCHEDULES", "TRAIN_NAME", "TWIN_MAX_KEYS", "TransferResult", "attention_transfer", "init_mixing", "lora_finetune",
    "register_train", "rfa_parameters", "transfer_output",
]
