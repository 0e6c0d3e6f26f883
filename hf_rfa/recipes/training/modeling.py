"""Build the model a recipe trains: original checkpoint + RFAConfig, or a converted checkpoint.

``build_model`` decides by the checkpoint's ``config.json``: with an ``rfa_config`` entry it is
loaded with :func:`hf_rfa.from_pretrained` (projections and learned maps restored), otherwise it
is loaded with transformers and converted on the fly with :func:`hf_rfa.convert` (or left as
softmax when ``feature_map='softmax'``). ``apply_lora`` wraps it in PEFT LoRA on the stock
attention projections with the ``rfa`` modules trainable; ``save_final`` writes a folder that
``hf_rfa.from_pretrained`` loads (LoRA merged) and, for LoRA, the adapter next to it.
"""

from __future__ import annotations

import hashlib
import logging
import os

import torch
from torch import nn

from ...config import CONFIG_ATTR, RFAConfig
from ...hf.convert import convert, from_pretrained, rfa_config_of
from ...hf.loading import write_adapter_rfa_config
from ...feature_maps import FeatureMap
from .peft_utils import lora_config, wrap_with_lora
from .args import ModelArguments, RFAArguments
from ..._logging import error_line

logger = logging.getLogger(__name__)

PEFT_TASK = {"causal-lm": "CAUSAL_LM", "classification": "SEQ_CLS"}


def auto_class(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task == "causal-lm":
        return AutoModelForCausalLM
    if task == "classification":
        return AutoModelForSequenceClassification
    raise ValueError(f"task must be one of {sorted(PEFT_TASK)}, got {task!r}")


def _named(flag: str, name: str, load):
    """``load()``; an ``OSError`` (a Hub id that cannot be fetched, a folder without the files)
    re-raised naming ``flag`` and ``name``: transformers' own message names neither."""
    try:
        return load()
    except OSError as e:
        reason = error_line(e)
        raise OSError(f"{flag} {name!r} could not be loaded: {reason}") from e


def load_tokenizer(model_args: ModelArguments):
    """The tokenizer, with a pad token (eos, else unk) when it has none."""
    from transformers import AutoTokenizer

    name = model_args.tokenizer_name or model_args.model_name_or_path
    flag = "--tokenizer_name" if model_args.tokenizer_name else "--model_name_or_path"
    tok = _named(flag, name, lambda: AutoTokenizer.from_pretrained(name))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
        if tok.pad_token is None:
            raise ValueError(f"tokenizer_name: {model_args.tokenizer_name or model_args.model_name_or_path} has no pad, eos or unk token")
    return tok


def is_converted_checkpoint(name_or_path: str) -> bool:
    from transformers import AutoConfig

    return bool(getattr(_named("--model_name_or_path", name_or_path, lambda: AutoConfig.from_pretrained(name_or_path)), CONFIG_ATTR, None))


def _check_settings(target: RFAConfig, model: nn.Module, path: str, task: str) -> None:
    """Refuse, with the flag that fixes it, settings of the default preset (recall) that ``model``
    cannot take: un-rotated features without rotary embeddings, decay or memory on bidirectional
    attention (encoders take ``--preset encoder``, GPT-2-style causal LMs ``--feature_input rotated``)."""
    from ..conversion.checks import has_rotary, is_bidirectional

    if target.feature_input == "unrotated" and not has_rotary(model):
        fix = "--feature_input rotated" if task == "causal-lm" and not is_bidirectional(model) else "--preset encoder"
        raise ValueError(f"--feature_input unrotated (preset recall's, the default) needs rotary position embeddings, which {path} "
                         f"({type(model).__name__}) does not have: use {fix}")
    if is_bidirectional(model):
        causal_only = [f for f, on in (("--decay", target.decay), ("--memory", target.memory)) if on]
        if causal_only:
            raise ValueError(f"{', '.join(causal_only)} {'needs' if len(causal_only) == 1 else 'need'} causal attention, but {path} "
                             f"({type(model).__name__}) is bidirectional: use --preset encoder (or {' '.join(f + ' 0' for f in causal_only)})")


def build_model(
    model_args: ModelArguments,
    rfa_args: RFAArguments,
    task: str,
    tokenizer=None,
    label_names: list[str] | None = None,
) -> nn.Module:
    """Load (and, for an original checkpoint, convert) the model for ``task``."""
    cls = auto_class(task)
    kwargs = {}
    if task == "classification":
        if not label_names:
            raise ValueError("label_names must be given for task='classification'")
        kwargs = {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)), "label2id": {n: i for i, n in enumerate(label_names)}}
    path = model_args.model_name_or_path
    if is_converted_checkpoint(path):
        model = from_pretrained(path, model_class=cls, **kwargs)
        cfg = rfa_config_of(model)
        if rfa_args.redraw_interval is not None and rfa_args.redraw_interval != cfg.redraw_interval:
            getattr(model.config, CONFIG_ATTR)["redraw_interval"] = rfa_args.redraw_interval
        logger.info("loaded converted checkpoint %s (%s, m=%d)", path, cfg.feature_map, cfg.num_features)
    else:
        model = cls.from_pretrained(path, **kwargs)
        if rfa_args.is_softmax:
            logger.info("loaded %s with softmax attention (no conversion)", path)
        else:
            target = rfa_args.to_rfa_config()
            _check_settings(target, model, path, task)
            convert(model, target)
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def check_window(model: nn.Module, task: str, max_seq_length: int, ddp: bool) -> None:
    """Causal-LM blocks no longer than the exact window run exact softmax, so the learned feature
    maps get no gradient: a warning, and under DDP (which refuses trained parameters without a
    gradient, in the Accelerate loop's second step) a ``ValueError`` naming the fix."""
    cfg = rfa_config_of(model)
    if cfg is None or task != "causal-lm" or not cfg.window or cfg.window < max_seq_length:
        return
    learned = [n for n, p in model.named_parameters() if p.requires_grad and ".rfa." in f".{n}."]
    message = (f"--window {cfg.window} >= --max_seq_length {max_seq_length}: every key is inside the exact window, so training runs "
               "exact softmax attention and the feature maps get no gradient")
    if ddp and learned:
        raise ValueError(f"{message}; DDP refuses trained parameters without a gradient: use a --max_seq_length above {cfg.window}")
    logger.warning("%s", message)


def apply_lora(model: nn.Module, model_args: ModelArguments, task: str) -> nn.Module:
    """Wrap ``model`` in PEFT LoRA (rank ``lora_r``) with the feature maps in ``modules_to_save``."""
    cfg = lora_config(
        model, r=model_args.lora_r, alpha=model_args.lora_alpha, dropout=model_args.lora_dropout,
        target_modules=model_args.target_modules,
        train_feature_maps=model_args.train_feature_maps and rfa_config_of(model) is not None,
        task_type=PEFT_TASK[task],
    )
    model = wrap_with_lora(model, cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA r=%d on %s: %d of %d parameters trainable (%.2f%%)", model_args.lora_r, cfg.target_modules, trainable, total, 100 * trainable / total)
    return model


def projection_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the buffers and parameters of every feature map in use (in module order).

    Under PEFT, ``modules_to_save`` keeps the frozen original next to the trained copy; only the
    copy is used (and survives ``merge_and_unload``), so originals are skipped.
    """
    h = hashlib.sha256()
    in_use = [m for name, m in model.named_modules() if isinstance(m, FeatureMap) and ".original_module." not in f".{name}."]
    for fm in in_use:
        for name, t in list(fm.named_buffers()) + list(fm.named_parameters()):
            h.update(name.encode())
            h.update(t.detach().to("cpu", torch.float64 if t.is_floating_point() else torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def unwrap_peft(model: nn.Module) -> nn.Module:
    """Merge LoRA into the base weights (PEFT models) and return the plain transformers model."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model


def save_final(model: nn.Module, tokenizer, output_dir: str, state_dict: dict | None = None, is_main_process: bool = True, save_function=torch.save) -> nn.Module:
    """``save_pretrained`` the trained model so that ``hf_rfa.from_pretrained`` loads it.

    PEFT models: the adapter goes to ``output_dir/adapter``, then LoRA is merged and the full
    model saved in ``output_dir``. ``state_dict`` (from ``accelerator.get_state_dict``) is for
    sharded runs (FSDP / ZeRO-3), where only the adapter is saved for PEFT models. Returns the
    model that was saved (the merged one for PEFT).
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model.save_pretrained(os.path.join(output_dir, "adapter"), state_dict=state_dict, is_main_process=is_main_process)
        if is_main_process:  # lets the stock AutoPeftModelFor*.from_pretrained convert an original base
            write_adapter_rfa_config(model.get_base_model(), os.path.join(output_dir, "adapter"))
        if state_dict is not None:
            logger.warning("sharded run: saved only the LoRA adapter in %s/adapter (merge it on one process)", output_dir)
            return model
        model = unwrap_peft(model)
    model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=is_main_process, save_function=save_function)
    if tokenizer is not None and is_main_process:
        tokenizer.save_pretrained(output_dir)
    logger.info("saved %s to %s", type(model).__name__, output_dir)
    return model
