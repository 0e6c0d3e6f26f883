"""Argument dataclasses shared by the recipes in ``training/`` (parsed with ``HfArgumentParser``).

Every field carries ``metadata={"help": ...}``; invalid values raise ``ValueError`` naming the
field in ``__post_init__``, as in ``transformers``' example scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from ...config import RFAConfig
from ..flags import FlagSpec, preset_config

TASKS = ("causal-lm", "classification")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")

#: local train/validation file suffixes (read by hf_rfa.recipes.data_files.load_local)
TRAIN_FILE_SUFFIXES = (".txt", ".csv", ".tsv", ".json", ".jsonl", ".parquet")


def _positive(obj, *names: str, minimum: float = 1) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


@dataclass
class ModelArguments:
    """Which checkpoint to start from and how to adapt it (full fine-tuning or LoRA)."""

    model_name_or_path: str = field(metadata={"help": "original checkpoint (converted on the fly with the RFA arguments) or a converted hf_rfa checkpoint; local folder or Hub id"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer folder or Hub id (default: the model's)"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 = full fine-tuning"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 2 * lora_r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_target_modules: str | None = field(default=None, metadata={"help": "comma-separated LoRA targets (default: the architecture's attention projections)"})
    train_feature_maps: bool = field(default=True, metadata={"help": "with LoRA: train and save the rfa modules (modules_to_save)"})
    chunked_loss: bool = field(default=True, metadata={"help": "causal LMs with a plain output head (Llama, Mistral, Qwen2/3, GPT-2): the training loss runs the head and the cross-entropy 96 MiB of float32 logits at a time instead of over every position at once (the same loss and gradients; also under FSDP2, not under FSDP version 1 or DeepSpeed)"})

    def __post_init__(self) -> None:
        if not self.model_name_or_path:
            raise ValueError("model_name_or_path must be set")
        _positive(self, "lora_r", minimum=0)
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")

    @property
    def target_modules(self) -> list[str] | None:
        return [t.strip() for t in self.lora_target_modules.split(",") if t.strip()] if self.lora_target_modules else None


@dataclass
class RFAArguments:
    """How an original checkpoint is converted: one :class:`RFAConfig` (``rfa``; default: the
    attention of the default preset, ``--preset`` on the command line) or None (exact softmax, the baseline; ``--feature_map softmax``).

    On the command line the ``RFAConfig`` fields are flags of their own (``--feature_map``,
    ``--num_features``, ...; its seed is ``--rfa_seed`` and its layers ``--rfa_layers 0,1``: the
    training arguments have a ``seed`` of their own). A converted checkpoint keeps its saved
    settings; only ``redraw_interval`` applies to it too, when given.
    """

    CLI: ClassVar[FlagSpec] = FlagSpec(rename={"seed": "rfa_seed", "layers": "rfa_layers"}, skip=("redraw_interval",), none_value="softmax")

    rfa: RFAConfig | None = field(default_factory=preset_config, metadata={"help": "attention settings of the converted layers (None: exact softmax)"})
    redraw_interval: int | None = field(default=None, metadata={"help": "redraw projections every N optimizer steps (0: never; default: a converted checkpoint's saved value, else 0)"})

    def __post_init__(self) -> None:
        if self.rfa is not None and not isinstance(self.rfa, RFAConfig):
            raise ValueError(f"rfa must be an RFAConfig or None (exact softmax), got {type(self.rfa).__name__}")
        if self.redraw_interval is not None:
            if not isinstance(self.redraw_interval, int) or isinstance(self.redraw_interval, bool) or self.redraw_interval < 0:
                raise ValueError(f"redraw_interval must be None or an int >= 0, got {self.redraw_interval!r}")
            if self.rfa is not None and self.rfa.redraw_interval != self.redraw_interval:
                self.rfa = replace(self.rfa, redraw_interval=self.redraw_interval)

    @property
    def is_softmax(self) -> bool:
        return self.rfa is None

    def to_rfa_config(self) -> RFAConfig:
        """The config an original checkpoint is converted with (``ValueError`` for softmax)."""
        if self.rfa is None:
            raise ValueError("rfa is None (exact softmax): there is no RFAConfig to convert with")
        return self.rfa


@dataclass
class DataArguments:
    """What to train on: text files / CSV / JSON, or a Hub dataset."""

    task: str = field(default="causal-lm", metadata={"help": f"one of {TASKS}"})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id (e.g. wikitext, sst2)"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration (e.g. wikitext-2-raw-v1)"})
    train_file: str | None = field(default=None, metadata={"help": "training file: .txt (causal-lm), .csv/.tsv/.json/.jsonl/.parquet (read with datasets.load_dataset)"})
    validation_file: str | None = field(default=None, metadata={"help": "evaluation file, same format as train_file"})
    validation_split: str = field(default="validation", metadata={"help": "Hub dataset split used for evaluation (falls back to 'test')"})
    validation_split_percentage: int = field(default=0, metadata={"help": "carve this percentage of train for evaluation when no validation data is given"})
    text_column: str | None = field(default=None, metadata={"help": "text column (default: 'text', 'sentence' or the first string column)"})
    label_column: str = field(default="label", metadata={"help": "label column (classification)"})
    max_seq_length: int = field(default=128, metadata={"help": "classification: truncate to this many tokens; causal-lm: block size"})
    max_train_samples: int | None = field(default=None, metadata={"help": "keep the first N training examples (after tokenisation for causal-lm: blocks)"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "keep the first N evaluation examples / blocks"})
    pad_to_max_length: bool = field(default=False, metadata={"help": "classification: pad every example to max_seq_length (default: dynamic padding)"})
    metric: list[str] = field(default_factory=lambda: ["accuracy"], metadata={"help": "classification: metrics to report, each evaluate.load(NAME) when it loads, else hf_rfa's offline accuracy / f1 / precision / recall (e.g. --metric accuracy f1)"})

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.dataset_name is None and self.train_file is None:
            raise ValueError("dataset_name or train_file must be set")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not path.endswith(TRAIN_FILE_SUFFIXES):
                raise ValueError(f"{name} must be a {', '.join(TRAIN_FILE_SUFFIXES)} file, got {path!r}")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(f"validation_split_percentage must be in [0, 100), got {self.validation_split_percentage!r}")
        _positive(self, "max_seq_length", "max_train_samples", "max_eval_samples")
        if not self.metric or not all(isinstance(m, str) and m for m in self.metric):
            raise ValueError(f"metric must name at least one metric (e.g. accuracy f1), got {self.metric!r}")


@dataclass
class LoopArguments:
    """Optimisation, checkpointing and logging of the plain Accelerate loop."""

    output_dir: str = field(metadata={"help": "where checkpoints, logs and the final model go"})
    do_train: bool = field(default=True, metadata={"help": "train (false: only evaluate the starting model)"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "batch per process per micro-step"})
    per_device_eval_batch_size: int = field(default=16, metadata={"help": "evaluation batch per process"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    learning_rate: float = field(default=5e-5, metadata={"help": "peak learning rate (AdamW)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on biases / norms)"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (0: off)"})
    num_train_epochs: int = field(default=1, metadata={"help": "epochs (ignored when max_train_steps is set)"})
    max_train_steps: int | None = field(default=None, metadata={"help": "total optimizer steps (overrides num_train_epochs)"})
    lr_scheduler_type: str = field(default="linear", metadata={"help": f"one of {SCHEDULERS}"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up optimizer steps"})
    seed: int = field(default=42, metadata={"help": "seed of model init, data order and dropout"})
    checkpointing_steps: int = field(default=0, metadata={"help": "save a resumable checkpoint every N optimizer steps (0: only at the end)"})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "checkpoint folder to resume from, or 'latest' (newest in output_dir)"})
    logging_steps: int = field(default=1, metadata={"help": "log the loss every N optimizer steps"})
    eval_steps: int = field(default=0, metadata={"help": "evaluate every N optimizer steps (0: only at the end)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations in backward (redraws stay outside forward)"})
    dataloader_drop_last: bool = field(default=False, metadata={"help": "drop the last incomplete global batch of each epoch"})
    save_final_model: bool = field(default=True, metadata={"help": "save_pretrained the result (LoRA merged) to output_dir/final"})
    push_to_hub: bool = field(default=False, metadata={"help": "push the final model to the Hub (needs hub_model_id and network)"})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repository for push_to_hub"})
    disable_tqdm: bool = field(default=False, metadata={"help": "no progress bar"})

    def __post_init__(self) -> None:
        _positive(self, "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_train_steps", "logging_steps")
        _positive(self, "checkpointing_steps", "eval_steps", "warmup_steps", minimum=0)
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise ValueError(f"lr_scheduler_type must be one of {SCHEDULERS}, got {self.lr_scheduler_type!r}")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("hub_model_id must be set when push_to_hub is true")
