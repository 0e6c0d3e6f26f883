"""Fine-tuning converted models: the importable, tested code behind the recipes in ``training/``.

* :mod:`.args`     — ``HfArgumentParser`` dataclasses (model / RFA / data / loop arguments)
* :mod:`.data`     — text / CSV / JSON files or Hub datasets → tokenised splits + collator
* :mod:`.modeling` — original + RFAConfig or converted checkpoint → model; LoRA; final save
* :mod:`.metrics`  — offline accuracy and perplexity (no ``evaluate.load``, which needs the Hub)
* :mod:`.trainer`  — the ``Trainer`` recipe (``training/finetune.py``)
* :mod:`.loop`     — the Accelerate loop with exact resume (``training/train_accelerate.py``)
"""

from .args import DataArguments, LoopArguments, ModelArguments, RFAArguments
from .data import PreparedData, prepare
from .checkpoints import TrainState, latest_checkpoint
from .loop import train
from .metrics import accuracy, perplexity
from .modeling import apply_lora, build_model, load_tokenizer, projection_fingerprint, save_final
from .trainer import run_trainer

__all__ = [
    "DataArguments",
    "LoopArguments",
    "ModelArguments",
    "PreparedData",
    "RFAArguments",
    "TrainState",
    "accuracy",
    "apply_lora",
    "build_model",
    "latest_checkpoint",
    "load_tokenizer",
    "perplexity",
    "prepare",
    "projection_fingerprint",
    "run_trainer",
    "save_final",
    "train",
]
