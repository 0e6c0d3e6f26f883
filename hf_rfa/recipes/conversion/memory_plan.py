"""The memory plan of a conversion, from the model's config alone (``hf-rfa-convert --dry-run``).

:func:`plan` builds the model on the meta device (``accelerate.init_empty_weights``: no weight is
read or allocated), converts it there to count the feature-map tensors, and adds up, per process:

- **weights**: the frozen weights in ``dtype`` plus the converted layers' tensors in float32; while
  a window-only baseline trains its own LoRA (merged into the model itself), a copy of the LoRA
  targets' weights to put back afterwards (**baseline copy**). With FSDP (:mod:`.fsdp`) the
  training stages hold 1/N of them (N processes) plus the **gathered units**: the root unit's own
  tensors (embeddings, final norm, output head; gathered for the whole forward) and two decoder
  layers (the one running and the one prefetched); evaluation runs on the gathered model (full
  weights);
- **gradients and optimizer state** of what each stage trains (Adam: two float32 moments): the
  feature maps in attention transfer, the LoRA adapters in the LoRA stage (with FSDP: 1/N);
- **activations** per stage: attention transfer holds each layer's captured q, k, v and softmax
  output (all layers at once, or one with ``transfer_layerwise``) and one layer's training graph;
  LoRA holds the model's saved activations for the backward (with ``activation_checkpointing``:
  every decoder layer's input and one layer's activations, recomputed in the backward) and the
  float32 logits of the loss (of one chunk of positions where :mod:`.lm_loss` computes it);
  evaluation one window's logits (one chunk's where the head is plain: :func:`~hf_rfa.recipes.evaluation.next_token_nll`)
  and one chunk's float32 log-softmax;
- **decode cache**: the constant-size RFA state of the converted model next to the softmax KV
  cache at the longest evaluation context;
- **upcast copy**: on a CPU without bf16 matrix hardware, low-precision weights are multiplied
  in float32 one layer at a time (:func:`.devices.float32_compute`): the largest weight's copy;
- **autocast copy**: float32 weights trained under bf16 autocast (``train_autocast``: CUDA, CPUs
  with bf16 matrix units) keep each matmul's bf16 weight for the backward: a bf16 copy of the
  frozen weights in the LoRA stage (with ``activation_checkpointing`` one decoder layer's and the
  output head's); LoRA's activations are counted tensor by tensor in the dtype each is saved in
  (:func:`_lora_layer`: the norms' inputs in float32, the matmuls' outputs in bf16), the other
  stages' at 4 bytes then, at 2 with bf16 / float16 weights;
- **load** (CPU, weights cast from the checkpoint's dtype to another): safetensors files (a local
  folder's or a Hub id's) are read tensor by tensor and each tensor cast, a few at a time (**checkpoint
  (read)**: the largest ones, one per loading thread); any other checkpoint is memory-mapped while
  each tensor is cast, and its touched pages count next to the cast weights (**checkpoint
  (mapped)**); a checkpoint loaded in its own dtype is mapped and used as it is (no copy);
- **runtime**: on the CPU, the resident memory of the process before loading (Python, torch,
  transformers); on CUDA, an allowance for the CUDA context;
- **tokenizer** (CPU, ``--dry-run``): what loading the model's tokenizer adds (the tokenizer and
  the modules it imports), measured by loading it in a fresh process where it is at hand without a
  download (:func:`.plan_inputs.tokenizer_bytes`); a run's own check before loading leaves it out.

The peak is the largest stage total. :func:`.plan_check.check_fits` compares it with what the device has free
(``torch.cuda.mem_get_info``; on the CPU ``MemAvailable`` of ``/proc/meminfo``, or psutil) and
refuses a run that would not fit, with the numbers and what to change.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import ConversionConfig
from .host_memory import measure_peak_rss, rss_now
from .lm_loss import loss_chunk, supports_chunked_loss
from .plan_inputs import checkpoint_dtype, config_file, tensor_sizes, tokenizer_bytes
from ..evaluation import NLL_CHUNK

logger = logging.getLogger(__name__)

GIB = 1024**3
MIB = 1024**2
#: CUDA context and allocator slack of one process, bytes (an allowance, not a measurement)
CUDA_CONTEXT_BYTES = 600 * MIB
#: the stages of the table, in order
STAGES = ("load", "transfer", "lora", "eval")


class PlanDoesNotFit(ValueError):
    """The memory plan's peak exceeds what the device has free."""


@dataclass
class MemoryPlan:
    """Bytes per process of each part of each stage (``parts[stage][part]``) and the setting."""

    model: str
    dtype: str
    device: str
    processes: int
    sharding: str
    context: int
    batch_size: int
    parts: dict[str, dict[str, int]] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def stage_total(self, stage: str) -> int:
        return sum(self.parts.get(stage, {}).values())

    @property
    def peak(self) -> int:
        return max(self.stage_total(s) for s in self.parts)

    @property
    def peak_stage(self) -> str:
        return max(self.parts, key=self.stage_total)

    def markdown(self) -> str:
        """The ``--dry-run`` table: one row per part, one column per stage, totals, decode cache."""
        names = [s for s in STAGES if s in self.parts]
        rows = []
        for part in dict.fromkeys(p for s in names for p in self.parts[s]):
            rows.append(f"| {part} | " + " | ".join(fmt_bytes(self.parts[s].get(part)) for s in names) + " |")
        head = (
            f"Memory plan per process: {self.model}, {self.dtype} weights on {self.device}, {self.processes} process(es)"
            f" ({self.sharding}), context {self.context}, batch {self.batch_size}; parameters: "
            + ", ".join(f"{k} {v:,}" for k, v in self.counts.items())
        )
        lines = [head, "", "| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names), *rows]
        lines.append("| **total** | " + " | ".join(f"**{fmt_bytes(self.stage_total(s))}**" for s in names) + " |")
        lines.append("")
        lines.append(f"Peak: {fmt_bytes(self.peak)} ({self.peak_stage}).")
        if self.decode:
            lines.append("Decode cache per sequence: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.decode.items()) + ".")
        return "\n".join(lines)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


# --------------------------------------------------------------------------- the model on the meta device
def load_config(spec: str):
    """A transformers config from a Hub id, a folder or a ``config.json`` path (nothing else read)."""
    from transformers import AutoConfig

    from .loading import resolve_checkpoint

    if config_file(spec):
        import json

        d = json.loads(open(spec, encoding="utf-8").read())
        if "model_type" not in d:
            raise ValueError(f"model: {spec!r} has no 'model_type': not a transformers config.json")
        return AutoConfig.for_model(**d)
    return AutoConfig.from_pretrained(resolve_checkpoint(spec))


def meta_model(config, cfg: ConversionConfig) -> tuple[nn.Module, nn.Module]:
    """``(original, converted)`` skeletons on the meta device (no memory, nothing read)."""
    import transformers
    from accelerate import init_empty_weights

    from ...hf.convert import convert
    from .loading import CAUSAL_LM, CLASSIFIER, kind_of

    kind = kind_of(config)
    cls = {CAUSAL_LM: transformers.AutoModelForCausalLM, CLASSIFIER: transformers.AutoModelForSequenceClassification}.get(kind, transformers.AutoModel)
    with init_empty_weights():
        model = cls.from_config(config, attn_implementation="sdpa")
    original = sum(p.numel() for p in model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    inp, outp = model.get_input_embeddings(), model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)) and outp is not None and outp.weight is not inp.weight:
        original -= outp.weight.numel()  # tied on load (the skeleton may not tie them)
    with init_empty_weights():
        convert(model, cfg.rfa_config())
    return model, original


def _dims(config) -> dict[str, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = text.hidden_size
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    d = getattr(text, "head_dim", None) or h // heads
    inter = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h
    return {"h": h, "L": text.num_hidden_layers, "H": heads, "Hkv": kv, "D": d, "I": inter, "V": text.vocab_size}


def _lora_params(model: nn.Module, r: int) -> tuple[int, int]:
    """``(adapter parameters at rank r, parameters of the target projections)``."""
    from ..training.peft_utils import lora_targets

    targets = set(lora_targets(model))
    n = held = 0
    for name, m in model.named_modules():
        if name.split(".")[-1] in targets and hasattr(m, "weight") and m.weight is not None and m.weight.dim() == 2:
            n += r * sum(m.weight.shape)
            held += sum(p.numel() for p in m.parameters(recurse=False))
    return n, held


# --------------------------------------------------------------------------- the plan
def plan(cfg: ConversionConfig, processes: int | None = None, sharding: str | None = None, runtime_bytes: int | None = None,
         tokenizer: int | None = None) -> MemoryPlan:
    """The memory plan of ``cfg`` per process (see the module docstring). ``processes``: default
    ``WORLD_SIZE`` (1); ``sharding``: ``ddp`` (every process a full copy, :mod:`.distributed`) or
    ``fsdp`` (the training stages sharded over the processes, :mod:`.fsdp`); default: ``fsdp`` with
    several processes when ``cfg.fsdp`` or the launcher asks for FSDP (``ACCELERATE_USE_FSDP``),
    else ``ddp``; ``runtime_bytes``: the process's own memory (default: its resident memory now on
    the CPU, :data:`CUDA_CONTEXT_BYTES` on CUDA); ``tokenizer``: the tokenizer's memory on the CPU
    (default: :func:`.plan_inputs.tokenizer_bytes` in a ``--dry-run`` whose runtime is measured here; a run's own
    check, which loads the tokenizer moments later, does not spend the seconds: none)."""
    from . import devices, distributed
    from .calibration import rfa_layers

    processes = int(processes or os.environ.get("WORLD_SIZE", "1"))
    if sharding is None:
        sharding = "none" if processes == 1 else "fsdp" if cfg.fsdp or distributed.fsdp_requested() else "ddp"
    if sharding not in ("none", "ddp", "fsdp"):
        raise ValueError(f"sharding must be one of ['none', 'ddp', 'fsdp'], got {sharding!r}")
    device = devices.check_device(cfg.device, available=not cfg.dry_run)
    wdtype = cfg.torch_dtype
    wb = torch.finfo(wdtype).bits // 8
    autocast = devices.training_autocast(cfg.train_autocast, device, wdtype)
    # float32 weights under autocast: the matmuls' outputs are low precision but the residual stream,
    # norms and losses stay float32, so activations are counted at 4 bytes; low-precision weights: 2
    ab = torch.finfo(wdtype if wdtype in (torch.bfloat16, torch.float16) and autocast is not None else torch.float32).bits // 8
    config = load_config(cfg.model)
    model, p_orig = meta_model(config, cfg)
    layers = rfa_layers(model)
    p_rfa = sum(t.numel() for r in layers.values() for t in list(r.parameters()) + list(r.buffers()))
    p_train = sum(p.numel() for r in layers.values() for p in r.parameters())
    p_lora, p_targets = _lora_params(model, cfg.lora_r) if cfg.lora_tokens > 0 else (0, 0)
    first = next(iter(layers.values()))
    feat = first.feature_map.feature_dim if cfg.rfa.feature_map != "none" else 0
    g = _dims(config)
    shard = processes if sharding == "fsdp" else 1
    chunked = supports_chunked_loss(model)  # lm_loss (LoRA) and evaluation.next_token_nll: one chunk of logits at a time
    weights = p_orig * wb + p_rfa * 4
    runtime = runtime_bytes if runtime_bytes is not None else (CUDA_CONTEXT_BYTES if device.type == "cuda" else rss_now())
    b = max(1, math.ceil(cfg.batch_size / processes))
    n, n_lora = cfg.context, cfg.lora_context or cfg.context
    out = MemoryPlan(cfg.model, cfg.dtype, str(device), processes, sharding, n, cfg.batch_size,
                     counts={"frozen": p_orig, "feature maps": p_rfa, "trainable maps": p_train, "LoRA": p_lora})
    base = {"runtime": runtime, "weights": weights}
    if device.type == "cpu" and (tokenizer is not None or runtime_bytes is None and cfg.dry_run):
        base["tokenizer"] = tokenizer if tokenizer is not None else tokenizer_bytes(cfg.model)
    if devices.needs_float32_compute(device, wdtype):  # bf16 storage, float32 matmuls: one weight's float32 copy at a time
        base["upcast copy"] = 4 * max(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    train = base if shard == 1 else {**base, "weights": weights // shard, "gathered units": _gathered(model, p_orig + p_rfa, wb)}
    if p_train and cfg.transfer_tokens > 0:
        out.parts["transfer"] = {**train, **_sharded(_transfer(cfg, g, b, n, ab, feat, p_train, len(layers)), shard)}
    if p_lora and config_is_causal(config):
        # the matmuls' outputs: the autocast dtype, else float32 (float32 weights, or low-precision ones multiplied in float32)
        mb = torch.finfo(autocast).bits // 8 if autocast is not None else 4
        out.parts["lora"] = {**train, **_sharded(_lora(cfg, g, b, n_lora, ab, feat, p_lora, p_targets * wb, chunked=chunked, mb=mb), shard)}
        if autocast is not None and wdtype == torch.float32:  # each matmul's low-precision weight, saved for backward
            held = p_orig if not cfg.activation_checkpointing else (p_orig - g["V"] * g["h"]) // g["L"] + g["V"] * g["h"]  # checkpointed: one layer's (and the head's)
            out.parts["lora"]["autocast copy"] = held * (torch.finfo(autocast).bits // 8)  # (also under FSDP: the casts of gathered weights)
    out.parts["eval"] = {**base, **_eval(cfg, g, ab, chunked=chunked)}
    stored = checkpoint_dtype(config)
    if device.type == "cpu" and stored != wdtype and cfg.device_map is None:  # cast while loading (.loading)
        out.parts = {"load": {**base, **_cast_load(cfg, torch.finfo(stored).bits // 8, p_orig)}, **out.parts}
    out.decode = _decode(cfg, g, wb, feat, len(layers))
    return out


def _cast_load(cfg: ConversionConfig, sb: int, p_orig: int) -> dict[str, int]:
    """What loading a checkpoint stored in ``sb`` bytes per weight holds besides the cast weights:
    from safetensors files, the tensors being read and cast at once (its largest few, one per
    loading thread of transformers: :func:`.loading.read_state_dict`; sizes from the files'
    headers); otherwise (a ``config.json``, other weight files, headers out of reach) the whole
    file, mapped while each tensor is cast (an upper bound)."""
    from transformers.core_model_loading import GLOBAL_WORKERS

    sizes = tensor_sizes(cfg.model)
    if not sizes:
        return {"checkpoint (mapped)": p_orig * sb}
    return {"checkpoint (read)": sum(sorted(sizes, reverse=True)[:GLOBAL_WORKERS]) * sb}


def _gathered(model: nn.Module, total: int, wb: int) -> int:
    """FSDP: the bytes of the units gathered at once in a training forward: the root's own tensors
    (all but the decoder layers') and two decoder layers (the running one, the prefetched one)."""
    from .fsdp import decoder_layers

    sizes = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    return (max(total - sum(sizes), 0) + 2 * max(sizes, default=0)) * wb


def _sharded(parts: dict[str, int], shard: int) -> dict[str, int]:
    """FSDP shards gradients and optimizer state too (1/N of each)."""
    return {k: v // shard if k in ("gradients", "optimizer") else v for k, v in parts.items()}


def config_is_causal(config) -> bool:
    from .loading import CAUSAL_LM, kind_of

    return kind_of(config) == CAUSAL_LM


def _transfer(cfg, g, b, n, ab, feat, p_train, n_layers) -> dict[str, int]:
    held = 1 if cfg.transfer_layerwise else n_layers
    per_layer = b * n * g["D"] * (2 * g["H"] + 2 * g["Hkv"]) * ab
    if cfg.rfa.feature_input == "unrotated":
        per_layer += b * n * g["D"] * (g["H"] + g["Hkv"]) * ab
    q = min(n, cfg.transfer_queries or n)
    graph = 4 * b * g["H"] * (n + q) * max(feat, 1) * 4  # features of keys and fitted queries, with their gradients (float32)
    teacher = b * n * (g["h"] * 4 + g["I"] * 3) * ab + b * g["H"] * n * n * ab  # one layer of the teacher's forward
    return {"gradients": p_train * 4, "optimizer": 2 * p_train * 4, "captures": held * per_layer, "activations": graph + teacher}


def _lora_layer(cfg, g, b, n, mb, feat) -> int:
    """The bytes one decoder layer saves for LoRA's backward, by tensor (counted as unique storages
    by saved-tensor hooks on SmolLM2's LoRA forward, float32 and under bf16 autocast, both within 2%
    of this; tiny Llama, Qwen2 and Gemma layers within 10%; GPT-2's composite GELU saves about a
    quarter more): 16 bytes per hidden unit (the two norms' float32 inputs, and the projections' inputs:
    two more in float32 or four low-precision casts), the MLP's three intermediates and the q, k, v
    the attention op keeps, in the matmuls' output dtype (``mb`` bytes), the rotary cos/sin, and
    the feature scan's state per 512-token block (:mod:`hf_rfa.ops.feature.recompute`); without
    ``checkpoint_blocks`` the op's autograd forms keep each query head's features as well."""
    per_token = 16 * g["h"] + 3 * g["I"] * mb + (g["H"] + 2 * g["Hkv"]) * g["D"] * mb + 2 * g["D"] * 4
    states = math.ceil(n / 512) * g["Hkv"] * feat * (g["D"] + 1) * 4
    if not cfg.rfa.checkpoint_blocks:
        per_token += g["H"] * max(feat, 1) * 4
    return b * (n * per_token + states)


def _lora(cfg, g, b, n, ab, feat, p_lora, targets, chunked=False, mb=4) -> dict[str, int]:
    per_layer = _lora_layer(cfg, g, b, n, mb, feat)
    rows = min(n, loss_chunk(g["V"], b)) if chunked else n  # lm_loss: one chunk's logits at a time (the hidden states are counted per layer)
    logits = b * rows * g["V"] * (ab + 3 * 4)  # logits, their float32 copy, log-softmax and its gradient
    # activation checkpointing: every layer's input is held, one layer's activations at a time (its recompute)
    layers = g["L"] * b * n * g["h"] * ab + per_layer if cfg.activation_checkpointing else g["L"] * per_layer
    parts = {"gradients": p_lora * 4, "optimizer": 2 * p_lora * 4, "activations": layers + logits}
    if cfg.lora_objective == "distill":  # the teacher's final hidden states, and its chunk's logits beside the student's in the KL
        parts["teacher"] = b * n * g["h"] * ab + b * rows * g["V"] * (ab + 5 * 4)
    if cfg.evaluates_window_only and (cfg.rfa.window or cfg.rfa.sinks) and cfg.rfa.feature_map != "none":
        parts["baseline copy"] = targets  # the window-only baseline's LoRA merges into the model; its target weights are kept to be put back
    return parts


def _eval(cfg, g, ab, chunked=False) -> dict[str, int]:
    n = max(cfg.eval_contexts)
    rows = min(n, NLL_CHUNK)  # evaluation.next_token_nll: a plain head runs one chunk of positions at a time
    logits = (rows if chunked else n) * g["V"] * ab + rows * g["V"] * 2 * 4  # the logits (all or one chunk's), one chunk's float32 copy and log-softmax (passkey: the answer's logits only)
    layer = n * (g["h"] * 4 + g["I"] * 3) * ab + g["H"] * min(n, 1024) * n * 4
    return {"activations": logits + layer}


def _decode(cfg, g, wb, feat, n_layers) -> dict[str, int]:
    n = max(cfg.eval_contexts)
    softmax = 2 * g["L"] * g["Hkv"] * n * g["D"] * wb
    exact = (cfg.rfa.window + cfg.rfa.sinks + cfg.rfa.memory) * 2 * g["Hkv"] * g["D"] * wb
    state = g["Hkv"] * feat * (g["D"] + 1) * 4 if feat else 0
    return {f"softmax KV @{n}": softmax, "RFA state": n_layers * (exact + state) + (g["L"] - n_layers) * 2 * g["Hkv"] * n * g["D"] * wb}


__all__ = ["CUDA_CONTEXT_BYTES", "MemoryPlan", "PlanDoesNotFit", "fmt_bytes", "load_config", "measure_peak_rss", "meta_model", "plan", "rss_now"]
