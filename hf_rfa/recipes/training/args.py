"""Argument dataclasses shared by the recipes in ``training/`` (parsed with ``HfArgumentParser``).

Every field carries ``metadata={"help": ...}``; invalid values raise ``ValueError`` naming the
field in ``__post_init__``, as in ``transformers``' example scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import RFAConfig

TASKS = ("causal-lm", "classification")
SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")


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
    """Random feature attention settings used when converting an original checkpoint.

    ``feature_map="softmax"`` keeps exact attention (the baseline). For a converted checkpoint
    these are ignored (its saved ``rfa_config`` is used) except ``redraw_interval`` if given.
    """

    feature_map: str = field(default="favor+", metadata={"help": "feature map name, or 'softmax' for no conversion"})
    num_features: int = field(default=64, metadata={"help": "m, random / learned features per head"})
    window: int = field(default=0, metadata={"help": "hybrid: exact softmax over a local window of W tokens (0: none)"})
    sinks: int = field(default=0, metadata={"help": "hybrid: first S tokens attended exactly"})
    gate: bool = field(default=False, metadata={"help": "learned decay gate (feature_map='rfa')"})
    rfa_seed: int = field(default=0, metadata={"help": "projection seed; layer l draws from (seed, l, redraw step)"})
    redraw_interval: int | None = field(default=None, metadata={"help": "redraw projections every N optimizer steps (0: never; default: the config's)"})
    rfa_layers: str | None = field(default=None, metadata={"help": "comma-separated layer indices to convert (default: all)"})

    def __post_init__(self) -> None:
        if self.redraw_interval is not None and self.redraw_interval < 0:
            raise ValueError(f"redraw_interval must be >= 0, got {self.redraw_interval!r}")
        if not self.is_softmax:
            self.to_rfa_config()  # validates every field, ValueError names it

    @property
    def is_softmax(self) -> bool:
        return self.feature_map == "softmax"

    def to_rfa_config(self) -> RFAConfig:
        layers = [int(i) for i in self.rfa_layers.split(",") if i.strip()] if self.rfa_layers else None
        return RFAConfig(
            feature_map=self.feature_map, num_features=self.num_features, window=self.window, sinks=self.sinks,
            gate=self.gate, seed=self.rfa_seed, redraw_interval=self.redraw_interval or 0, layers=layers,
        )


@dataclass
class DataArguments:
    """What to train on: text files / CSV / JSON, or a Hub dataset."""

    task: str = field(default="causal-lm", metadata={"help": f"one of {TASKS}"})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id (e.g. wikitext, sst2)"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration (e.g. wikitext-2-raw-v1)"})
    train_file: str | None = field(default=None, metadata={"help": "training file: .txt (causal-lm), .csv/.json/.jsonl"})
    validation_file: str | None = field(default=None, metadata={"help": "evaluation file, same format as train_file"})
    validation_split: str = field(default="validation", metadata={"help": "Hub dataset split used for evaluation (falls back to 'test')"})
    validation_split_percentage: int = field(default=0, metadata={"help": "carve this % of train for evaluation when no validation data is given"})
    text_column: str | None = field(default=None, metadata={"help": "text column (default: 'text', 'sentence' or the first string column)"})
    label_column: str = field(default="label", metadata={"help": "label column (classification)"})
    max_seq_length: int = field(default=128, metadata={"help": "classification: truncate to this many tokens; causal-lm: block size"})
    max_train_samples: int | None = field(default=None, metadata={"help": "keep the first N training examples (after tokenisation for causal-lm: blocks)"})
    max_eval_samples: int | None = field(default=None, metadata={"help": "keep the first N evaluation examples / blocks"})
    pad_to_max_length: bool = field(default=False, metadata={"help": "classification: pad every example to max_seq_length (default: dynamic padding)"})

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.dataset_name is None and self.train_file is None:
            raise ValueError("dataset_name or train_file must be set")
        for name in ("train_file", "validation_file"):
            path = getattr(self, name)
            if path is not None and not path.endswith((".txt", ".csv", ".json", ".jsonl")):
                raise ValueError(f"{name} must be a .txt, .csv, .json or .jsonl file, got {path!r}")
        if not 0 <= self.validation_split_percentage < 100:
            raise ValueError(f"validation_split_percentage must be in [0, 100), got {self.validation_split_percentage!r}")
        _positive(self, "max_seq_length", "max_train_samples", "max_eval_samples")


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
