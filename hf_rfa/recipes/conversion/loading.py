"""Loading a checkpoint for conversion: Hub id, local folder, GGUF file or an already converted folder."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import evaluation
from ...config import CONFIG_ATTR
from ..._logging import error_line

logger = logging.getLogger(__name__)

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
    try:
        cfg = AutoConfig.from_pretrained(path)
    except OSError as e:  # transformers' message names no model: say which one could not be read
        reason = error_line(e)
        raise OSError(f"model {spec!r} could not be loaded: {reason}") from e
    kind = kind_of(cfg)
    cls = {CAUSAL_LM: transformers.AutoModelForCausalLM, CLASSIFIER: transformers.AutoModelForSequenceClassification, ENCODER: transformers.AutoModel}[kind]
    if getattr(cfg, CONFIG_ATTR, None):
        model = from_pretrained(path, **kwargs)
    else:
        model = _load_casting(cls, path, cfg, attn_implementation, kwargs)
        if model is None:
            model = cls.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)
    if devices.needs_float32_compute(devices.input_device(model), dtype):
        devices.float32_compute(model)  # bf16 storage, float32 matmuls (no bf16 matrix hardware here)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok, kind


#: safetensors' dtype names of the torch dtypes a conversion loads in
_STORED = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def checkpoint_files(path: str, fetch: bool = False) -> list[str]:
    """The safetensors files of a checkpoint (sharded: those its index names): a local folder's, or
    a Hub id's in the Hugging Face cache (:func:`hub_checkpoint_files`: fetched into the cache first
    when ``fetch``, as ``from_pretrained`` would; else only what the cache holds); [] for a folder
    without safetensors, one with other weight files only, or a Hub id whose files cannot be had."""
    if not os.path.isdir(path):
        return [] if evaluation.looks_like_path(path) else hub_checkpoint_files(path, fetch)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return [os.path.join(path, name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    single = os.path.join(path, "model.safetensors")
    return [single] if os.path.isfile(single) else []


def hub_checkpoint_files(repo_id: str, fetch: bool) -> list[str]:
    """The safetensors files of Hub model ``repo_id`` in the Hugging Face cache (the index's shards,
    else ``model.safetensors``); with ``fetch``, downloaded there first where missing (the files
    ``from_pretrained`` would download); [] where the repository has none, the Hub cannot be
    reached or the cache lacks them: the caller then leaves the load to transformers."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    def get(name: str, local: bool = not fetch) -> str:
        return hf_hub_download(repo_id, name, local_files_only=local)

    try:
        try:
            index = get("model.safetensors.index.json")
        except LocalEntryNotFoundError:  # not in the cache, and (fetching) the Hub out of reach
            return [get("model.safetensors", local=True)]
        except EntryNotFoundError:  # not in the repository
            return [get("model.safetensors")]
        with open(index, encoding="utf-8") as f:
            return [get(name) for name in sorted(set(json.load(f)["weight_map"].values()))]
    except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        logger.debug("%s: no safetensors files to read tensor by tensor (%s)", repo_id, e)
        return []


def read_state_dict(files: list[str], dtype: torch.dtype) -> dict[str, Any] | None:
    """Lazy slices of every tensor in ``files``, read from the file (``pread``) when transformers
    materialises them, if loading in ``dtype`` casts any of them; None when nothing is cast (the
    memory-mapped file then *is* the weights) or this safetensors cannot read without a map.

    Why: transformers maps a safetensors file and casts each tensor from the map; the pages it
    reads stay resident until the whole file is loaded, so a bf16 load of a float32 checkpoint
    peaks at the float32 file plus the bf16 weights (SmolLM2-135M: 513 + 258 MiB). Read tensor by
    tensor, each float32 copy is freed once cast: the peak is the bf16 weights plus the tensors in
    flight (transformers' loading threads)."""
    from safetensors import safe_open

    try:
        handles = [safe_open(f, framework="pt", backend="pread") for f in files]
    except TypeError:  # safetensors without a pread backend
        return None
    slices = {k: h.get_slice(k) for h in handles for k in h.keys()}
    want = _STORED.get(dtype)
    if want is None or not any(s.get_dtype() in _STORED.values() and s.get_dtype() != want for s in slices.values()):
        return None
    return slices


def _load_casting(cls, path: str, cfg, attn_implementation: str, kwargs: dict[str, Any]) -> nn.Module | None:
    """``cls.from_pretrained(path, ...)`` for a local safetensors checkpoint that loading in
    ``kwargs["dtype"]`` casts, from :func:`read_state_dict` instead of the mapped file (the same
    weights, bit for bit); None where that does not apply (a device other than the CPU or a device
    map, no safetensors files, nothing cast, a model class the Auto class does not map). A Hub id
    reads the files of its snapshot in the Hugging Face cache (downloaded there first)."""
    files = checkpoint_files(path, fetch=True) if "device_map" not in kwargs else []  # (the CPU path: no device map)
    if not files:
        return None
    concrete = cls._model_mapping.get(type(cfg), None) if hasattr(cls, "_model_mapping") else None
    state = read_state_dict(files, kwargs["dtype"]) if concrete is not None else None
    if state is None:
        return None
    from transformers import GenerationConfig

    model = concrete.from_pretrained(None, config=cfg, state_dict=state, attn_implementation=attn_implementation, **kwargs)
    model.config._name_or_path = model.name_or_path = path  # as loading from the folder records them
    if model.can_generate():
        try:
            model.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json (the folder's or the Hub id's): the default stands
            pass
    return model


__all__ = ["CAUSAL_LM", "CLASSIFIER", "ENCODER", "checkpoint_files", "hub_checkpoint_files", "kind_of", "load_model", "read_state_dict", "resolve_checkpoint"]
