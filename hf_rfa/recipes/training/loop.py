"""The plain Accelerate training loop behind ``training/train_accelerate.py``.

One loop for one process, DDP, FSDP and DeepSpeed (chosen by ``accelerate launch``'s config):
gradient accumulation, mixed precision, gradient clipping, an LR schedule, evaluation,
progress bar and logging (``output_dir/log.jsonl``), and resumable checkpoints.

Exact resume (:mod:`.checkpoints`): ``accelerator.save_state`` stores model, optimizer, scheduler
and RNG states and :class:`~.checkpoints.TrainState` the loop's position, as JSON. The data order of
epoch ``e`` is a seeded permutation (``use_seedable_sampler``, ``set_epoch(e)``) and a resumed run
skips the batches already consumed, so it continues exactly where the interrupted run was.

Redraw: after every ``redraw_interval``-th optimizer step ``k``, every feature map redraws its
projections from ``(seed, layer, k // redraw_interval)`` on every process, with no communication;
a fingerprint of the projections is all-gathered and compared (``RuntimeError`` if they differ).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...hf.convert import redraw, rfa_config_of
from .args import DataArguments, LoopArguments, ModelArguments, RFAArguments
from .checkpoints import CHECKPOINT_PREFIX, COMPLETE_FILE, TRAIN_STATE_FILE, TrainState, latest_checkpoint, load_state_exactly, resolve_resume, resume_from, save_checkpoint, trim_log  # noqa: F401 (re-exported)
from .data import prepare
from .metrics import classification_metrics_for, perplexity
from .modeling import apply_lora, build_model, check_window, load_tokenizer, projection_fingerprint, save_final

logger = logging.getLogger(__name__)


def _unwrapped_config_owner(model):
    for attr in ("module", "base_model", "model"):
        if rfa_config_of(model) is not None:
            return model
        model = getattr(model, attr, model)
    return model


def check_projections_in_sync(accelerator, model) -> list[str]:
    """All-gather the projection fingerprint (first 240 bits) of every process; RuntimeError if they differ."""
    fp = projection_fingerprint(model)
    code = torch.tensor([int(fp[i : i + 15], 16) for i in range(0, 60, 15)], dtype=torch.int64, device=accelerator.device)
    gathered = accelerator.gather(code).view(accelerator.num_processes, -1).cpu()
    prints = ["".join(f"{int(x):015x}" for x in row) for row in gathered]
    if len(set(prints)) != 1:
        raise RuntimeError(f"random projections differ between processes: {prints}")
    return [fp if p == fp[:60] else p for p in prints]  # every rank agrees: report the full digest


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate(accelerator, model, dataloader, task: str, metric: tuple[str, ...] | list[str] = ("accuracy",), num_labels: int | None = None) -> dict[str, float]:
    """The ``metric`` values (classification) and mean loss / perplexity over the whole evaluation set."""
    model.eval()
    losses, preds, refs = [], [], []
    for batch in dataloader:
        out = model(**batch)
        n = batch["labels"].shape[0]
        losses.append(accelerator.gather_for_metrics(out.loss.detach().float().repeat(n)))
        if task == "classification":
            p, r = accelerator.gather_for_metrics((out.logits.argmax(-1), batch["labels"]))
            preds.append(p.cpu())
            refs.append(r.cpu())
    model.train()
    loss = torch.cat(losses).mean().item()
    metrics = {"eval_loss": loss}
    if task == "classification":
        from types import SimpleNamespace

        scores = classification_metrics_for(metric, num_labels)(SimpleNamespace(predictions=torch.cat(preds).numpy(), label_ids=torch.cat(refs).numpy()))
        metrics.update({f"eval_{k}": v for k, v in scores.items()})
    else:
        metrics["eval_perplexity"] = perplexity(loss)
    return metrics


def _training_loss(accelerator, model, model_args: ModelArguments, task: str):
    """The causal LM's training loss one chunk of logits at a time (``--chunked_loss``,
    :func:`hf_rfa.recipes.conversion.lm_loss.chunked_training_loss`), except for classifiers and
    under DeepSpeed and FSDP version 1. Under FSDP2 (``fully_shard``) the model's forward is replaced on
    the sharded module itself, inside the hooks that gather the root unit's output head
    (``training/fsdp_cpu_check.py --chunked_loss``)."""
    import contextlib

    from ..conversion.lm_loss import chunked_training_loss

    kind = str(accelerator.distributed_type).split(".")[-1]
    sharded = kind == "DEEPSPEED" or (kind == "FSDP" and not getattr(accelerator, "is_fsdp2", False))
    if task != "causal-lm" or not model_args.chunked_loss or sharded:
        return contextlib.nullcontext(False)
    return chunked_training_loss(accelerator.unwrap_model(model))


@dataclass
class _Run:
    """What the loop's per-step bookkeeping (:func:`_after_step`) reads, and the fingerprints and
    metrics it updates."""

    accelerator: Any
    model: Any
    scheduler: Any
    progress: Any
    eval_dl: Any
    log_path: str
    interval: int
    evaluation: tuple  # (task, metric names, number of labels or None)
    fingerprints: list[str]
    metrics: dict = field(default_factory=dict)


def _prepare(accelerator, model, data, args: LoopArguments):
    """Data loaders, optimizer and LR schedule, prepared by ``accelerator`` → ``(model, optimizer,
    train_dl, eval_dl or None, scheduler, optimizer steps, steps per epoch)``."""
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    train_dl = DataLoader(data.train, shuffle=True, batch_size=args.per_device_train_batch_size, collate_fn=data.collator, drop_last=args.dataloader_drop_last)
    eval_dl = DataLoader(data.eval, batch_size=args.per_device_eval_batch_size, collate_fn=data.collator) if data.eval is not None else None
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.learning_rate)
    if eval_dl is not None:
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    else:
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    steps_per_epoch = math.ceil(len(train_dl) / args.gradient_accumulation_steps)
    max_steps = (args.max_train_steps or args.num_train_epochs * steps_per_epoch) if args.do_train else 0
    # the prepared scheduler steps once per process per optimizer step (as in transformers' examples)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps * accelerator.num_processes, num_training_steps=max(max_steps, 1) * accelerator.num_processes)
    return model, optimizer, train_dl, eval_dl, accelerator.prepare(scheduler), max_steps, steps_per_epoch


def _after_step(run: _Run, state: TrainState, args: LoopArguments, step_loss: float) -> None:
    """After optimizer step ``state.completed_steps``: the redraw, the log record, the checkpoint
    and the evaluation that fall on it."""
    state.losses.append(step_loss)
    run.progress.update(1)
    step = state.completed_steps
    if run.interval and step % run.interval == 0:
        state.redraw_step = step // run.interval
        n = redraw(run.model, state.redraw_step)
        run.fingerprints = check_projections_in_sync(run.accelerator, run.model)
        logger.info("step %d: redrew %d feature maps (redraw step %d), identical on %d processes", step, n, state.redraw_step, run.accelerator.num_processes)
    if step % args.logging_steps == 0:
        record = {"step": step, "epoch": state.epoch, "loss": step_loss, "lr": run.scheduler.get_last_lr()[0], "redraw_step": state.redraw_step}
        run.progress.set_postfix(loss=f"{step_loss:.4f}")
        logger.info("%s", record)
        if run.accelerator.is_main_process:
            with open(run.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
    if args.checkpointing_steps and step % args.checkpointing_steps == 0:
        save_checkpoint(run.accelerator, state, os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{step}"))
    if run.eval_dl is not None and args.eval_steps and step % args.eval_steps == 0:
        run.metrics = evaluate(run.accelerator, run.model, run.eval_dl, *run.evaluation)
        logger.info("step %d: %s", step, run.metrics)


def _train_steps(run: _Run, state: TrainState, args: LoopArguments, loop: tuple, max_steps: int, rng_at_resume: torch.Tensor | None) -> None:
    """Optimizer steps from ``state`` until ``max_steps`` (``loop = (train_dl, optimizer)``), epoch
    by epoch, skipping the batches a resumed epoch already consumed; ``rng_at_resume``: the global
    RNG state to set once the resumed data iterator exists (None: a fresh run)."""
    accelerator, model, scheduler = run.accelerator, run.model, run.scheduler
    train_dl, optimizer = loop
    model.train()
    micro_losses: list[torch.Tensor] = []
    while state.completed_steps < max_steps:
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(state.epoch)
        skip = state.steps_in_epoch * args.gradient_accumulation_steps
        loader = accelerator.skip_first_batches(train_dl, skip) if skip else train_dl
        for batch in loader:
            if rng_at_resume is not None:
                torch.set_rng_state(rng_at_resume)
                rng_at_resume = None
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_losses.append(loss.detach().float())
            del loss  # its spent graph must not stay alive through the next forward (peak memory)
            if not accelerator.sync_gradients:
                continue
            step_loss = accelerator.reduce(torch.stack(micro_losses).mean(), "mean").item()
            micro_losses.clear()
            state.completed_steps += 1
            state.steps_in_epoch += 1
            _after_step(run, state, args, step_loss)
            if state.completed_steps >= max_steps:
                break
        else:
            state.epoch += 1
            state.steps_in_epoch = 0


def _finish(accelerator, model, tokenizer, args: LoopArguments, results: dict) -> None:
    """Save the final model (``save_final_model``; pushed with ``push_to_hub``) and ``results.json``
    from the main process."""
    accelerator.wait_for_everyone()
    if args.save_final_model and args.do_train:
        final = os.path.join(args.output_dir, "final")
        sharded = str(accelerator.distributed_type) in ("DistributedType.FSDP", "DistributedType.DEEPSPEED", "FSDP", "DEEPSPEED")
        state_dict = accelerator.get_state_dict(model) if sharded else None
        unwrapped = accelerator.unwrap_model(model)
        if accelerator.is_main_process:
            saved = save_final(unwrapped, tokenizer, final, state_dict=state_dict)
            results["final_model"] = final
            if args.push_to_hub:
                saved.push_to_hub(args.hub_model_id)
                tokenizer.push_to_hub(args.hub_model_id)
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    accelerator.wait_for_everyone()


def train(model_args: ModelArguments, data_args: DataArguments, rfa_args: RFAArguments, args: LoopArguments, accelerator=None) -> dict:
    """Run the loop; returns (and writes to ``output_dir/results.json``) the final metrics."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from tqdm.auto import tqdm

    if accelerator is None:
        accelerator = Accelerator(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
            project_config=ProjectConfiguration(project_dir=args.output_dir),
        )
    logger.info("accelerator: %s, %d process(es), mixed precision %s", accelerator.distributed_type, accelerator.num_processes, accelerator.mixed_precision)
    set_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = load_tokenizer(model_args)
    data = prepare(data_args, tokenizer, accelerator.main_process_first())
    model = build_model(model_args, rfa_args, data_args.task, tokenizer, data.label_names)
    if model_args.lora_r:
        model = apply_lora(model, model_args, data_args.task)
    if args.gradient_checkpointing:
        # transformers >= 5.25 names it activation checkpointing (the old name warns)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if args.do_train:
        check_window(model, data_args.task, data_args.max_seq_length, ddp=str(accelerator.distributed_type).split(".")[-1] in ("MULTI_CPU", "MULTI_GPU"))
    rfa_cfg = rfa_config_of(_unwrapped_config_owner(model))
    interval = rfa_cfg.redraw_interval if rfa_cfg else 0
    model, optimizer, train_dl, eval_dl, scheduler, max_steps, steps_per_epoch = _prepare(accelerator, model, data, args)
    state = TrainState()  # saved as JSON next to accelerate's files (not registered: that would pickle it)
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume:
        resume_from(accelerator, model, state, resume, interval)
    # the checkpoint's RNG state (restored by load_state): creating the resumed data iterator draws
    # from the global generator (DataLoader's base seed), which the interrupted run had done before
    # its first step, so the state is set again once that iterator exists — dropout masks match
    rng_at_resume = torch.get_rng_state() if resume else None

    total_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("%d examples, %d optimizer steps (%d per epoch), global batch %d, redraw every %d steps", len(data.train), max_steps, steps_per_epoch, total_batch, interval)
    log_path = os.path.join(args.output_dir, "log.jsonl")
    if resume and accelerator.is_main_process:
        trim_log(log_path, state.completed_steps)
    progress = tqdm(total=max_steps, initial=state.completed_steps, desc="training", disable=args.disable_tqdm or not accelerator.is_local_main_process)
    run = _Run(accelerator, model, scheduler, progress, eval_dl, log_path, interval, (data_args.task, data_args.metric, len(data.label_names or []) or None), check_projections_in_sync(accelerator, model))
    with _training_loss(accelerator, model, model_args, data_args.task) as chunked_loss:  # (--chunked_loss)
        start = time.perf_counter()
        _train_steps(run, state, args, (train_dl, optimizer), max_steps, rng_at_resume)
    progress.close()
    train_time = time.perf_counter() - start

    metrics = evaluate(accelerator, model, eval_dl, *run.evaluation) if eval_dl is not None else run.metrics
    results = {
        "final_loss": state.losses[-1] if state.losses else None,
        "losses": state.losses,
        "completed_steps": state.completed_steps,
        "redraw_step": state.redraw_step,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "projection_fingerprints": run.fingerprints,
        "train_seconds": train_time,
        "chunked_loss": chunked_loss,
        **metrics,
    }
    _finish(accelerator, model, tokenizer, args, results)
    logger.info("done: %s", {k: v for k, v in results.items() if k != "losses"})
    return results
