"""Loading a checkpoint for conversion: Hub id, local folder, GGUF file or an already converted folder."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import evaluation
from ...config import CONFIG_ATTR

CAUSAL_LM, ENCODER, CLASSIFIER = "causal-lm", "encoder", "classifier"


def kind_of(config) -> str:
    """``causal-lm``, ``classifier`` or ``encoder`` from a transformers config."""
    arch = " ".join(config.architectures or [])
    if "CausalLM" in arch or "LMHead" in arch:
        return CAUSAL_LM
    if "SequenceClassification" in arch:
        return CLASSIFIER
    if getattr(config, "is_decoder", False) or config.model_type in {"gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}:
        return CAUSAL_LM
    return ENCODER


def resolve_checkpoint(spec: str) -> str:
    """A loadable folder or Hub id for ``spec``; GGUF files are converted once into the asset cache."""
    if spec.endswith(".gguf"):
        from ... import assets

        if not os.path.isfile(spec):
            raise ValueError(f"model: GGUF file {spec!r} not found")
        out = assets.cache_dir() / "gguf" / f"{Path(spec).stem}-{_content_key(spec)}"  # keyed on content, not name
        if not (out / "config.json").is_file():
            assets.gguf_to_hf(spec, out, overwrite=True)
        return str(out)
    if not os.path.isdir(spec) and evaluation.looks_like_path(spec):
        raise ValueError(f"model: local folder {spec!r} not found (a Hub id looks like 'org/name')")
    return spec


def _content_key(path: str) -> str:
    """First 16 hex digits of the file's SHA-256."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_model(
    spec: str, dtype: torch.dtype = torch.float32, device: torch.device | str | None = "cpu", device_map: str | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[nn.Module, Any, str]:
    """``(model, tokenizer, kind)``; a folder whose config has ``rfa_config`` loads converted.

    ``dtype``: the weights' dtype; ``device``: where the model goes (None: CUDA when available,
    else the CPU); ``device_map="auto"``: spread over the visible devices instead
    (:mod:`.devices`); ``attn_implementation``: the unconverted model's attention (sdpa, eager,
    flash_attention_2). The defaults load on the CPU in float32 with sdpa."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from ...hf.convert import from_pretrained
    from . import devices

    dev = devices.check_device(None if device is None else str(device))
    devices.check_device_map(device_map)
    devices.check_attn_implementation(attn_implementation, None if device_map else dev)
    kwargs = devices.load_kwargs(dtype, dev, device_map)
    path = resolve_checkpoint(spec)
    cfg = AutoConfig.from_pretrained(path)
    kind = kind_of(cfg)
    cls = {CAUSAL_LM: transformers.AutoModelForCausalLM, CLASSIFIER: transformers.AutoModelForSequenceClassification, ENCODER: transformers.AutoModel}[kind]
    if getattr(cfg, CONFIG_ATTR, None):
        model = from_pretrained(path, **kwargs)
    else:
        model = cls.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)
    if devices.needs_float32_compute(devices.input_device(model), dtype):
        devices.float32_compute(model)  # bf16 storage, float32 matmuls (no bf16 matrix hardware here)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok, kind


__all__ = ["CAUSAL_LM", "CLASSIFIER", "ENCODER", "kind_of", "load_model", "resolve_checkpoint"]
