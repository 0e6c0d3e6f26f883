#!/usr/bin/env python
"""Fine-tune a model with random feature attention in a plain Accelerate loop.

Same tasks and model options as ``finetune.py``; adds gradient accumulation, mixed precision
(from the accelerate config / ``--mixed_precision``), resumable checkpoints with exact resume
(``--checkpointing_steps``, ``--resume_from_checkpoint PATH|latest``) and deterministic redraws.

    accelerate launch --config_file training/configs/single_gpu.yaml training/train_accelerate.py \\
        --model_name_or_path MODEL --task causal-lm --train_file train.txt --feature_map favor+ \\
        --output_dir out --max_train_steps 100 --checkpointing_steps 50
    accelerate launch --cpu --num_processes 2 training/train_accelerate.py ...   # CPU, gloo

All logic lives in :mod:`hf_rfa.recipes.training.loop`; see training/README.md.
"""

import logging
import os
import sys

from transformers import HfArgumentParser

from hf_rfa.recipes.training import DataArguments, LoopArguments, ModelArguments, RFAArguments, train


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, RFAArguments, LoopArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        args = parser.parse_json_file(sys.argv[1])
    else:
        args = parser.parse_args_into_dataclasses(args=argv)
    # (no PartialState() here: it would fix the distributed setup before Accelerator(cpu=...) reads it)
    main_process = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO if main_process else logging.WARNING)
    return train(*args)


if __name__ == "__main__":
    main()
