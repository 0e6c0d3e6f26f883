"""The plain Accelerate training loop behind ``training/train_accelerate.py``.

One loop for one process, DDP, FSDP and DeepSpeed (chosen by ``accelerate launch``'s config):
gradient accumulation, mixed precision, gradient clipping, an LR schedule, evaluation,
progress bar and logging (``output_dir/log.jsonl``), and resumable checkpoints.

Exact resume: ``accelerator.save_state`` stores model, optimizer, scheduler and RNG states;
:class:`TrainState` — the optimizer step, the epoch, the position inside the epoch and the
redraw step — is saved as JSON (``train_state.json``, never a pickle: a crafted checkpoint cannot
run code on resume), and a checkpoint counts as complete only once its ``COMPLETE`` file is
written last (``latest`` skips one a killed run left half-written). A resumed run drops the
records after the checkpoint's step from ``log.jsonl`` before appending its own. The data order of epoch ``e`` is a seeded
permutation (``use_seedable_sampler``, ``set_epoch(e)``) and a resumed run skips the batches
already consumed, so it continues exactly where the interrupted run was.

Redraw: after every ``redraw_interval``-th optimizer step ``k``, every feature map redraws its
projections from ``(seed, layer, k // redraw_interval)`` on every process, with no communication;
a fingerprint of the projections is all-gathered and compared (``RuntimeError`` if they differ).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field

import torch

from ...hf.convert import redraw, rfa_config_of
from .args import DataArguments, LoopArguments, ModelArguments, RFAArguments
from .data import prepare
from .metrics import classification_metrics_for, perplexity
from .modeling import apply_lora, build_model, check_window, load_tokenizer, projection_fingerprint, save_final

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step_"
#: the loop position of a checkpoint (JSON) and the file written last when it is complete
TRAIN_STATE_FILE, COMPLETE_FILE = "train_state.json", "COMPLETE"


@dataclass
class TrainState:
    """Loop position saved with every checkpoint (``accelerator.register_for_checkpointing``)."""

    completed_steps: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    redraw_step: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set the fields from ``state``; ValueError for unknown fields or values of the wrong type."""
        if not isinstance(state, dict) or set(state) - set(asdict(self)):
            raise ValueError(f"train state must be a dict of the fields {sorted(asdict(self))}, got {state!r:.200}")
        for key, value in state.items():
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value) if key == "losses" else isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise ValueError(f"train state field {key} has a bad value {value!r:.200}")
            setattr(self, key, list(value) if key == "losses" else value)

    def save_json(self, folder: str) -> None:
        """Write ``folder/train_state.json`` (atomically)."""
        path = os.path.join(folder, TRAIN_STATE_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f)
        os.replace(path + ".tmp", path)

    def load_json(self, folder: str) -> None:
        """Read ``folder/train_state.json`` (JSON only: nothing is unpickled)."""
        path = os.path.join(folder, TRAIN_STATE_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {folder!r} has no {TRAIN_STATE_FILE} (incomplete, or written by an older hf_rfa)")
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))


def latest_checkpoint(output_dir: str) -> str | None:
    """Newest *complete* ``output_dir/step_N`` folder (one holding ``COMPLETE``), or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = [(int(m.group(1)), d) for d in os.listdir(output_dir) if (m := re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", d))]
    complete = [(n, d) for n, d in steps if os.path.isfile(os.path.join(output_dir, d, COMPLETE_FILE))]
    if len(complete) < len(steps):
        logger.warning("skipping incomplete checkpoints %s", sorted(d for n, d in set(steps) - set(complete)))
    return os.path.join(output_dir, max(complete)[1]) if complete else None


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint folder to resume from: ``latest`` is the newest complete one in
    ``output_dir``; ValueError when there is none (a resume never starts from scratch in silence)."""
    if resume != "latest":
        return resume
    found = latest_checkpoint(output_dir)
    if found is None:
        raise ValueError(f"resume_from_checkpoint='latest': {output_dir!r} holds no complete checkpoint ({CHECKPOINT_PREFIX}N with {COMPLETE_FILE}); omit the flag to train from scratch")
    return found


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_state_exactly(accelerator, folder: str) -> None:
    """``accelerator.load_state(folder)``, refusing (ValueError) a checkpoint whose RNG state is
    missing or unreadable: accelerate would skip it with an INFO line and the resume would not be exact."""
    rng = os.path.join(folder, f"random_states_{accelerator.process_index}.pkl")
    if not os.path.isfile(rng):
        raise ValueError(f"checkpoint {folder!r} lacks {os.path.basename(rng)}: an exact resume needs the RNG state it saved")
    said, log = _Said(), logging.getLogger("accelerate.checkpointing")
    level = log.level
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:
        accelerator.load_state(folder)
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    if any("Could not load random states" in m for m in said.messages):
        raise ValueError(f"checkpoint {folder!r}: {os.path.basename(rng)} is unreadable (corrupt or truncated): an exact resume needs the RNG state it saved")


def save_checkpoint(accelerator, state: TrainState, folder: str) -> None:
    """``accelerator.save_state`` + the JSON train state, then ``COMPLETE`` once every process is done."""
    accelerator.save_state(folder)
    if accelerator.is_main_process:
        state.save_json(folder)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(folder, COMPLETE_FILE), "w", encoding="utf-8") as f:
            f.write(f"{state.completed_steps}\n")


def trim_log(log_path: str, completed_steps: int) -> None:
    """Drop the records of ``log.jsonl`` after ``completed_steps`` (a resumed run replays them)."""
    if not os.path.isfile(log_path):
        return
    with open(log_path, encoding="utf-8") as f:
        lines = [ln for ln in f if ln.strip()]
    keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= completed_steps]
    if len(keep) < len(lines):
        with open(log_path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(log_path + ".tmp", log_path)


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


def train(model_args: ModelArguments, data_args: DataArguments, rfa_args: RFAArguments, args: LoopArguments, accelerator=None) -> dict:
    """Run the loop; returns (and writes to ``output_dir/results.json``) the final metrics."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm
    from transformers import get_scheduler

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
    owner = _unwrapped_config_owner(model)
    if args.do_train:
        check_window(model, data_args.task, data_args.max_seq_length, ddp=str(accelerator.distributed_type).split(".")[-1] in ("MULTI_CPU", "MULTI_GPU"))
    rfa_cfg = rfa_config_of(owner)
    interval = rfa_cfg.redraw_interval if rfa_cfg else 0

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
    scheduler = accelerator.prepare(scheduler)
    state = TrainState()  # saved as JSON next to accelerate's files (not registered: that would pickle it)

    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume:
        if not os.path.isdir(resume):
            raise ValueError(f"resume_from_checkpoint {resume!r} is not a checkpoint folder")
        pickles = sorted(f for f in os.listdir(resume) if f.startswith("custom_checkpoint_"))
        if pickles:  # accelerate would unpickle them (arbitrary code); hf_rfa never writes them
            raise ValueError(f"checkpoint {resume!r} holds {pickles}: hf_rfa saves its training state as JSON and never unpickles one; remove these files to resume")
        load_state_exactly(accelerator, resume)
        state.load_json(resume)
        if interval and state.redraw_step:
            redraw(model, state.redraw_step)  # projections are a function of the step: restore exactly
        logger.info("resumed from %s at optimizer step %d (epoch %d, step %d in epoch)", resume, state.completed_steps, state.epoch, state.steps_in_epoch)
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
    fingerprints = check_projections_in_sync(accelerator, model)
    with _training_loss(accelerator, model, model_args, data_args.task) as chunked_loss:  # (--chunked_loss)
        model.train()
        start = time.perf_counter()
        micro_losses: list[torch.Tensor] = []
        metrics: dict = {}
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
                state.losses.append(step_loss)
                progress.update(1)
                if interval and state.completed_steps % interval == 0:
                    state.redraw_step = state.completed_steps // interval
                    n = redraw(model, state.redraw_step)
                    fingerprints = check_projections_in_sync(accelerator, model)
                    logger.info("step %d: redrew %d feature maps (redraw step %d), identical on %d processes", state.completed_steps, n, state.redraw_step, accelerator.num_processes)
                if state.completed_steps % args.logging_steps == 0:
                    record = {"step": state.completed_steps, "epoch": state.epoch, "loss": step_loss, "lr": scheduler.get_last_lr()[0], "redraw_step": state.redraw_step}
                    progress.set_postfix(loss=f"{step_loss:.4f}")
                    logger.info("%s", record)
                    if accelerator.is_main_process:
                        with open(log_path, "a") as f:
                            f.write(json.dumps(record) + "\n")
                if args.checkpointing_steps and state.completed_steps % args.checkpointing_steps == 0:
                    save_checkpoint(accelerator, state, os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{state.completed_steps}"))
                if eval_dl is not None and args.eval_steps and state.completed_steps % args.eval_steps == 0:
                    metrics = evaluate(accelerator, model, eval_dl, data_args.task, data_args.metric, len(data.label_names or []) or None)
                    logger.info("step %d: %s", state.completed_steps, metrics)
                if state.completed_steps >= max_steps:
                    break
            else:
                state.epoch += 1
                state.steps_in_epoch = 0
    progress.close()
    train_time = time.perf_counter() - start

    if eval_dl is not None:
        metrics = evaluate(accelerator, model, eval_dl, data_args.task, data_args.metric, len(data.label_names or []) or None)
    results = {
        "final_loss": state.losses[-1] if state.losses else None,
        "losses": state.losses,
        "completed_steps": state.completed_steps,
        "redraw_step": state.redraw_step,
        "num_processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "projection_fingerprints": fingerprints,
        "train_seconds": train_time,
        "chunked_loss": chunked_loss,
        **metrics,
    }
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
    logger.info("done: %s", {k: v for k, v in results.items() if k != "losses"})
    return results
