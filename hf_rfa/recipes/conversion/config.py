"""``ConversionConfig``: the settings of one conversion run (``hf-rfa-convert`` flags, same names).

The model's attention settings are one :class:`~hf_rfa.config.RFAConfig` field (``rfa``, default:
the attention of the default preset, ``recall``); the other fields say what the workflow does
around it: transfer and LoRA budgets, texts, evaluation, baselines, export.
:meth:`ConversionConfig.from_preset` is what the command builds: a preset's attention settings and
training budgets (:mod:`hf_rfa.presets`) with the given fields on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

from ...config import RFAConfig
from ...presets import DEFAULT_PRESET, get_preset
from ..flags import FlagSpec, flat_dict, preset_config
from .host_memory import DEFAULT_MMAP_THRESHOLD_MIB


@dataclass
class ConversionConfig:
    """Settings of one conversion run. Invalid values raise ``ValueError`` naming the field."""

    CLI: ClassVar[FlagSpec] = FlagSpec(required=("output", "calibration_text", "eval_text"), zero_is_none=("eval_tokens", "transfer_queries"))

    model: str = field(metadata={"help": "Hub id (e.g. gpt2), local folder, .gguf file or converted folder"})
    output: str = field(default="out", metadata={"help": "folder to create (written to a temp dir, renamed at the end)"})
    rfa: RFAConfig = field(default_factory=preset_config, metadata={"help": "attention settings of the converted layers (seed: also of training and evaluation draws)"})
    learnable_projections: bool = field(default=False, metadata={"help": "random-projection maps (favor+, positive, rff…): attention transfer trains the projections"})
    transfer_tokens: int = field(default=500_000, metadata={"help": "tokens of attention transfer (learned maps; 0: skip)"})
    lora_tokens: int = field(default=8192, metadata={"help": "tokens of the LoRA stage (causal LMs; 0: skip)"})
    transfer_minutes: float | None = field(default=None, metadata={"help": "safety limit of attention transfer: reaching it before transfer_tokens fails the run (budgets are tokens)"})
    lora_minutes: float | None = field(default=None, metadata={"help": "safety limit of LoRA: reaching it before lora_tokens fails the run (budgets are tokens)"})
    calibration_text: str | None = field(default=None, metadata={"help": "text of the per-layer error table: file, wikipedia:<split>, rotten_tomatoes:<split> or name[:config]:split"})
    train_text: str | None = field(default=None, metadata={"help": "transfer/LoRA text (None: the calibration text)"})
    eval_text: str | None = field(default=None, metadata={"help": "held-out evaluation text (same forms as calibration_text)"})
    context: int = field(default=1024, metadata={"help": "sequence length of transfer and LoRA (causal LMs)"})
    lora_context: int | None = field(default=None, metadata={"help": "sequence length of LoRA (None: context)"})
    eval_contexts: list[int] = field(default_factory=lambda: [1024], metadata={"help": "contexts at which perplexity is measured"})
    eval_tokens: int | None = field(default=16384, metadata={"help": "predicted tokens per evaluation (0 or None: all)"})
    error_tokens: int = field(default=2048, metadata={"help": "calibration tokens of the per-layer error table"})
    eval_sentences: int = field(default=1000, metadata={"help": "encoders: held-out sentences for embedding cosine / accuracy"})
    metric: list[str] = field(default_factory=lambda: ["accuracy"], metadata={"help": "classifiers: metrics of every variant on the held-out labels, each evaluate.load(NAME) when it loads, else hf_rfa's offline accuracy / f1 / precision / recall (e.g. --metric accuracy f1)"})
    encoder_max_length: int = field(default=128, metadata={"help": "encoders: texts (attention transfer, per-layer errors and evaluation) are truncated to this many tokens (at most the model's max_position_embeddings); the longer they are than the window, the more the features must carry"})
    encoder_pack_tokens: int = field(default=0, metadata={"help": "encoders without labels: join consecutive texts (lines) into passages of at least this many tokens before truncating to encoder_max_length, for calibration, training and evaluation alike (0: each text as it is)"})
    window_only_baseline: bool = field(default=False, metadata={"help": "hybrids: also evaluate feature_map='none' (same window and sinks, every other key dropped) untrained and, for causal LMs, after its own LoRA with the same budget (encoders have no LoRA stage: the untrained row is the same budget)"})
    baseline_windows: list[int] = field(default_factory=list, metadata={"help": "more window-only baselines (feature_map='none', the recipe's sinks) at these windows — causal LMs: each after its own LoRA with the same budget, e.g. the window holding as many decode-state numbers as the recipe's window + feature state; encoders: untrained, e.g. the window costing what the recipe's window + features cost (empty: none)"})
    evaluate_before_transfer: bool = field(default=True, metadata={"help": "learned maps: also evaluate the converted model before attention transfer (its map is an untrained initialisation)"})
    copy_gaps: list[int] = field(default_factory=list, metadata={"help": "long range: copy task at these gaps, every variant (e.g. 512 3584; empty: skip)"})
    copy_draws: int = field(default=8, metadata={"help": "long range: seeded draws of the copy task"})
    passkey_lengths: list[int] = field(default_factory=list, metadata={"help": "long range: passkey retrieval at these prompt lengths, original and trained variants (empty: skip)"})
    passkey_trials: int = field(default=20, metadata={"help": "long range: seeded passkey trials per (length, depth)"})
    memory_after_training: int = field(default=0, metadata={"help": "causal: after training, also evaluate (and publish) the recipe with an exact memory of this many keys per kv head ranked by rfa.memory_score (hf_rfa.set_memory; trained without it: it has no parameters), next to the window-only baseline after its LoRA with the same memory ranked by ||v|| (0: off)"})
    memory_split: str = field(default="uniform", metadata={"choices": ["uniform", "induction"], "help": "causal: how memory_after_training is split over the layers — uniform (the same in every layer) or induction (the same total; a share memory_floor of it in every layer and the rest in proportion to the original's attention on the induction source in copy sequences of the calibration text), for the recipe and its window-only baseline alike"})
    memory_floor: float = field(default=0.625, metadata={"help": "memory_split=induction: the share of memory_after_training that every layer keeps, in [0, 1] (0.625: 160 of 256 keys per kv head)"})
    batch_size: int = field(default=1, metadata={"help": "sequences per step of transfer and LoRA (causal LMs)"})
    transfer_queries: int | None = field(default=256, metadata={"help": "causal: fit the last Q queries of each sequence (0 or None: all)"})
    transfer_lr: float = field(default=1e-2, metadata={"help": "learning rate of attention transfer"})
    transfer_schedule: str = field(default="constant", metadata={"help": "learning-rate schedule of attention transfer over its token budget: constant or cosine (down to 0)"})
    transfer_query_blocks: int = field(default=1, metadata={"help": "causal: optimiser steps per captured sequence, each fitting the next transfer_queries positions back from the end (the teacher's forward is shared)"})
    lora_lr: float = field(default=1e-3, metadata={"help": "learning rate of LoRA"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_objective: str = field(default="next_token", metadata={"help": "LoRA's objective: next_token (cross-entropy on the training text) or distill (KL from the original model's next-token distribution at every position — the adapters make up for the attention's approximation without adapting the model to the training text; one more forward of the original per step)"})
    train_autocast: str = field(default="auto", metadata={"help": "mixed precision of attention transfer and LoRA: auto (bf16 where it is faster: CUDA with bf16, CPUs with AMX / AVX-512 BF16; else float32), off, bf16"})
    baselines: bool = field(default=False, metadata={"help": "also evaluate every baseline: untrained pure random features (random_feature_map), for causal hybrids the untrained random-feature hybrid (random_hybrid), and the window-only baseline (window_only_baseline)"})
    random_hybrid: bool = field(default=True, metadata={"help": "--baselines include random features + window + sinks"})
    eval_twin_max: int = field(default=2048, metadata={"help": "evaluate converted models up to this context through the training attention function (the op's autograd form; the name predates it: it was the quadratic twin); 0: never, always the inference form"})
    random_feature_map: str = field(default="favor+", metadata={"help": "feature map of the random-feature baselines"})
    random_num_features: int = field(default=256, metadata={"help": "features of the random-feature baselines"})
    generate_prompt: str | None = field(default="The history of the city", metadata={"help": "causal LMs: greedy generation sample after this prompt (None: skip)"})
    generate_tokens: int = field(default=30, metadata={"help": "tokens of the generation sample (0: skip)"})
    push_to_hub: str | None = field(default=None, metadata={"help": "upload the output folder to this Hub repo (a failed upload keeps the folder and says how to retry)"})
    base_model: str | None = field(default=None, metadata={"help": "Hub id the model was converted from, for the model card (None: model, when it is a Hub id)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing output folder written by hf_rfa"})
    progress: bool = field(default=True, metadata={"help": "progress bars"})
    device: str | None = field(default=None, metadata={"help": "where the conversion runs: cuda, cuda:N, cpu, mps (None: cuda when available, else cpu)"})
    dtype: str = field(default="float32", metadata={"help": "dtype of the frozen weights: float32, bfloat16 or float16 (feature maps, decay rates and LoRA stay float32; low-precision weights train under autocast of the device type)"})
    device_map: str | None = field(default=None, metadata={"help": "auto: spread a teacher/student that does not fit one device over every visible device (transformers/Accelerate device_map); None: all on --device"})
    teacher_attn_implementation: str = field(default="sdpa", metadata={"help": "attention of the original model: sdpa, eager or flash_attention_2 (needs flash_attn and CUDA)"})
    transfer_layerwise: bool = field(default=False, metadata={"help": "attention transfer one decoder layer at a time: the teacher's q/k/v of that layer only are held, each layer trained on the whole transfer budget (activation memory of one layer; the same result as all layers at once)"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "LoRA: recompute each decoder layer's activations in the backward (transformers' activation checkpointing) instead of holding them all: LoRA's activations fall to each layer's input plus one layer's, for about one more forward pass of compute (the same loss and gradients)"})
    malloc_mmap_threshold: int = field(default=DEFAULT_MMAP_THRESHOLD_MIB, metadata={"help": "conversions on the CPU: C-heap blocks of this many MiB or more get a memory map of their own, returned to the system when freed (glibc mallopt M_MMAP_THRESHOLD). glibc's default keeps freed blocks of up to 32 MiB resident, and a long-context conversion grows far past what it holds (LoRA at 4,096 tokens: 2.7 vs 1.2 GiB peak). 0: glibc's default; ignored where MALLOC_MMAP_THRESHOLD_ is set or the C library is not glibc"})
    fsdp: bool = field(default=False, metadata={"help": "several processes: shard attention transfer and LoRA with FSDP2 (each process holds 1/N of the weights while they train; evaluation and export see the gathered model). Also on without this flag when the launcher says FSDP (accelerate launch with an FSDP config sets ACCELERATE_USE_FSDP)"})
    dry_run: bool = field(default=False, metadata={"help": "print the memory plan (weights, gradients, optimizer, activations, decode cache) from the model's config on the meta device and exit: nothing is loaded"})
    memory_check: bool = field(default=True, metadata={"help": "before loading, refuse a run whose memory plan does not fit the device (free GPU memory / available RAM)"})

    def __post_init__(self) -> None:
        if not isinstance(self.rfa, RFAConfig):
            raise ValueError(f"rfa must be an RFAConfig, got {type(self.rfa).__name__}")
        for name in ("copy_gaps", "passkey_lengths", "baseline_windows"):
            v = getattr(self, name)
            if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in v):
                raise ValueError(f"{name} must be a list of ints >= 1, got {v!r}")
        from .lora import OBJECTIVES
        from .transfer import SCHEDULES

        if self.lora_objective not in OBJECTIVES:
            raise ValueError(f"lora_objective must be one of {list(OBJECTIVES)}, got {self.lora_objective!r}")
        if self.transfer_schedule not in SCHEDULES:
            raise ValueError(f"transfer_schedule must be one of {sorted(SCHEDULES)}, got {self.transfer_schedule!r}")
        for name in ("context", "batch_size", "lora_r", "error_tokens", "eval_sentences", "encoder_max_length", "random_num_features", "copy_draws", "passkey_trials"):
            _check_int(name, getattr(self, name), 1)
        _check_int("transfer_query_blocks", self.transfer_query_blocks, 1)
        if self.transfer_query_blocks > 1:
            if self.transfer_queries is None or self.transfer_query_blocks * self.transfer_queries > self.context:
                raise ValueError(
                    f"transfer_query_blocks × transfer_queries must fit in context ({self.context}), got "
                    f"{self.transfer_query_blocks} × {self.transfer_queries}"
                )
            if self.rfa.window > 0:
                from .transfer import check_query_blocks_reach

                check_query_blocks_reach(self.context, self.transfer_query_blocks, self.transfer_queries, self.rfa.window, self.rfa.sinks)
        for name in ("transfer_tokens", "lora_tokens", "generate_tokens", "eval_twin_max", "memory_after_training", "encoder_pack_tokens"):
            _check_int(name, getattr(self, name), 0)
        if not self.eval_contexts or any(not isinstance(c, int) or c < 2 for c in self.eval_contexts):
            raise ValueError(f"eval_contexts must be a non-empty list of ints >= 2, got {self.eval_contexts!r}")
        for name in ("transfer_minutes", "lora_minutes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {v!r}")
        for name in ("transfer_lr", "lora_lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("eval_tokens", "transfer_queries", "lora_context"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, "None or ")
        from . import devices

        devices.check_dtype(self.dtype)
        devices.check_device_map(self.device_map)
        for name in ("fsdp", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.fsdp and self.device_map is not None:
            raise ValueError("fsdp and device_map cannot be combined: FSDP shards the model over the processes, a device map over one process's devices")
        from .host_memory import check_mmap_threshold

        check_mmap_threshold(self.malloc_mmap_threshold)
        devices.check_attn_implementation(self.teacher_attn_implementation)
        if self.device is not None:
            devices.check_device(self.device, available=not self.dry_run)
        from .precision import check_autocast

        check_autocast(self.train_autocast)
        if self.learnable_projections:
            from ...feature_maps import feature_map_class
            from ...feature_maps.random_projections import RandomProjectionMap

            if not issubclass(feature_map_class(self.rfa.feature_map), RandomProjectionMap):
                raise ValueError(f"learnable_projections needs a random-projection feature map, got feature_map={self.rfa.feature_map!r}")
        RFAConfig(feature_map=self.random_feature_map, num_features=self.random_num_features)
        from .memory_split import check_memory_split

        check_memory_split(self.memory_split, self.memory_floor, self.memory_after_training)
        if self.memory_after_training:
            if self.rfa.memory:
                raise ValueError(f"memory_after_training={self.memory_after_training} needs rfa.memory=0 (the recipe already trains with memory={self.rfa.memory})")
            RFAConfig.from_dict({**self.rfa.to_dict(), "memory": self.memory_after_training})  # the settings it will take

    @property
    def seed(self) -> int:
        """``rfa.seed``: projections, data order and evaluation draws."""
        return self.rfa.seed

    @classmethod
    def from_preset(cls, name: str = DEFAULT_PRESET, rfa: dict | None = None, **fields) -> "ConversionConfig":
        """A preset's attention settings (``rfa`` overrides its ``RFAConfig`` fields) and training
        budgets, with ``fields`` on top: the config ``hf-rfa-convert --preset NAME`` builds."""
        preset = get_preset(name)
        return cls(**{**dict(preset.training), **fields, "rfa": preset.config(**(rfa or {}))})

    @property
    def evaluates_window_only(self) -> bool:
        """Whether the window-only baseline runs (``window_only_baseline`` or ``baselines``)."""
        return self.window_only_baseline or self.baselines

    def rfa_config(self) -> RFAConfig:
        """The converted layers' config: ``rfa``, with ``learnable_projections`` switched on in its
        map options (nothing else is added: ``RFAConfig.from_preset`` builds the same layers)."""
        options = dict(self.rfa.feature_map_options)
        if self.learnable_projections:
            options["learnable"] = True
        return replace(self.rfa, feature_map_options=options)

    @property
    def torch_dtype(self):
        """``dtype`` as a torch dtype."""
        from .devices import check_dtype

        return check_dtype(self.dtype)

    def to_dict(self) -> dict:
        """Flat: the ``rfa`` fields next to the others (``report.json``'s ``config``, keys as before)."""
        return flat_dict(self)


def _check_int(name: str, v, low: int, prefix: str = "") -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{name} must be {prefix}an int >= {low}, got {v!r}")


__all__ = ["ConversionConfig"]
