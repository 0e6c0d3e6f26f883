"""The ``transformers.Trainer`` recipe behind ``training/finetune.py``.

Builds the model (original + RFAConfig, or converted checkpoint), optionally wraps it in LoRA,
trains with :class:`~hf_rfa.recipes.training.callbacks.RedrawCallback`, evaluates offline (accuracy /
perplexity), and saves a folder ``hf_rfa.from_pretrained`` loads (LoRA merged; adapter in
``adapter/``). Multi-process runs come from ``accelerate launch`` / ``torchrun``: Trainer reads
the distributed setup (DDP, FSDP, DeepSpeed) from the environment.
"""

from __future__ import annotations

import json
import logging
import os

from ... import compat
from .callbacks import RedrawCallback
from .args import DataArguments, ModelArguments, RFAArguments
from .data import prepare
from .metrics import argmax_logits, classification_metrics_for, perplexity
from .modeling import apply_lora, build_model, load_tokenizer, projection_fingerprint, save_final

logger = logging.getLogger(__name__)


def run_trainer(model_args: ModelArguments, data_args: DataArguments, rfa_args: RFAArguments, training_args) -> dict:
    """Fine-tune with ``Trainer``; returns the metrics (also ``output_dir/results.json``)."""
    from transformers import Trainer, set_seed

    set_seed(training_args.seed)
    tokenizer = load_tokenizer(model_args)
    data = prepare(data_args, tokenizer, training_args.main_process_first(desc="dataset preparation"))
    model = build_model(model_args, rfa_args, data_args.task, tokenizer, data.label_names)
    classification = data_args.task == "classification"
    if classification:
        # transformers 5.24: sequence classifiers take **kwargs, so Trainer assumes their loss is
        # a token sum over num_items_in_batch and multiplies it by the process count; their
        # loss is a batch mean, so this doubled the loss (and gradient) on 2 processes.
        compat.disable_loss_kwargs(model)
    if model_args.lora_r:
        model = apply_lora(model, model_args, data_args.task)
    redraw_cb = RedrawCallback()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data.train if training_args.do_train else None,
        eval_dataset=data.eval,
        data_collator=data.collator,
        processing_class=tokenizer,
        compute_metrics=classification_metrics_for(data_args.metric, len(data.label_names or []) or None) if classification else None,
        preprocess_logits_for_metrics=argmax_logits if classification else None,
        callbacks=[redraw_cb],
    )
    results: dict = {}
    if training_args.do_train:
        with _training_loss(trainer, model, model_args, classification) as chunked_loss:
            out = trainer.train(resume_from_checkpoint=trainer_resume(training_args.resume_from_checkpoint, training_args.output_dir))
        results["chunked_loss"] = chunked_loss
        results.update(out.metrics)
        results["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results["redraws"] = redraw_cb.redraws
    if data.eval is not None and training_args.do_eval:
        metrics = trainer.evaluate()
        if not classification:
            metrics["eval_perplexity"] = perplexity(metrics["eval_loss"])
        results.update(metrics)
    results["projection_fingerprint"] = projection_fingerprint(trainer.model)
    results["process_index"] = training_args.process_index
    results["num_processes"] = training_args.world_size
    with open(os.path.join(training_args.output_dir, f"fingerprint_rank{training_args.process_index}.txt"), "w") as f:
        f.write(results["projection_fingerprint"])
    if training_args.do_train:
        final = os.path.join(training_args.output_dir, "final")
        is_sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled
        state_dict = trainer.accelerator.get_state_dict(trainer.model_wrapped) if is_sharded else None
        if trainer.is_world_process_zero():
            saved = save_final(trainer.accelerator.unwrap_model(trainer.model), tokenizer, final, state_dict=state_dict)
            results["final_model"] = final
            if training_args.push_to_hub:
                saved.push_to_hub(training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir)))
                tokenizer.push_to_hub(training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir)))
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    logger.info("results: %s", {k: v for k, v in results.items() if k != "losses"})
    # no rank leaves while rank 0 still writes the final model (a rank exiting early tore gloo down
    # under it: "terminate called without an active exception", SIGABRT)
    trainer.accelerator.wait_for_everyone()
    return results


def _training_loss(trainer, model, model_args: ModelArguments, classification: bool):
    """The causal LM's training loss one chunk of logits at a time (``--chunked_loss``,
    :func:`hf_rfa.recipes.conversion.lm_loss.chunked_training_loss`), except for classifiers and
    under DeepSpeed and FSDP version 1. Under FSDP2 (``fully_shard``) the model's forward is replaced on
    the sharded module itself, inside the hooks that gather the root unit's output head
    (``training/fsdp_cpu_check.py --chunked_loss``)."""
    import contextlib

    from ..conversion.lm_loss import chunked_training_loss

    fsdp1 = trainer.is_fsdp_enabled and not getattr(trainer.accelerator, "is_fsdp2", False)
    if classification or not model_args.chunked_loss or fsdp1 or trainer.is_deepspeed_enabled:
        return contextlib.nullcontext(False)
    return chunked_training_loss(model)


def trainer_resume(resume: str | None, output_dir: str) -> str | None:
    """``resume_from_checkpoint`` for ``Trainer.train``: ``latest`` is the newest ``checkpoint-N`` in
    ``output_dir`` (ValueError when there is none); a folder is passed as is."""
    if resume != "latest":
        return resume
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if found is None:
        raise ValueError(f"resume_from_checkpoint='latest': {output_dir!r} holds no checkpoint-N folder; omit the flag to train from scratch")
    return found
