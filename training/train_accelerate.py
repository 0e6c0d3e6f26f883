#!/usr/bin/env python
"""Fine-tune a model with random feature attention in a plain Accelerate loop.

Same tasks and model options as ``finetune.py``; adds gradient accumulation, mixed precision
(from the accelerate config / ``--mixed_precision``), resumable checkpoints with exact resume
(``--checkpointing_steps``, ``--resume_from_checkpoint PATH|latest``) and deterministic redraws.

    accelerate launch --config_file training/configs/single_gpu.yaml training/train_accelerate.py \\
        --model_name_or_path MODEL --task causal-lm --train_file train.txt --feature_map favor+ \\
        --output_dir out --max_train_steps 100 --checkpointing_steps 50
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \\
        training/train_accelerate.py ...   # two CPU processes, gloo (``--cpu`` alone starts one)

All logic lives in :mod:`hf_rfa.recipes.training.loop` (flags: :mod:`hf_rfa.cli`, installed as ``hf-rfa-train``); see training/README.md.
"""

from hf_rfa.cli import _command, train_accelerate_main as main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(_command(main, "training/train_accelerate.py")())  # a user error: one line, status 2, as the installed command
