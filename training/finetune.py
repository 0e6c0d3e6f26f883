#!/usr/bin/env python
"""Fine-tune a model with random feature attention using ``transformers.Trainer``.

Tasks: ``causal-lm`` (text files or a Hub dataset) and ``classification`` (CSV/JSON or a Hub
dataset). Starts from an original checkpoint (converted on the fly with ``--feature_map ...``;
``--feature_map softmax`` keeps exact attention) or from a converted one (``hf_rfa.from_pretrained``).
``--lora_r 8`` trains LoRA adapters (plus the feature maps) instead of all weights.

    python training/finetune.py --model_name_or_path MODEL --task classification \\
        --train_file train.csv --validation_file test.csv --feature_map favor+ --num_features 64 \\
        --output_dir out --do_train --do_eval --num_train_epochs 1
    accelerate launch --config_file training/configs/ddp.yaml training/finetune.py ...

All logic lives in :mod:`hf_rfa.recipes.training` (flags: :mod:`hf_rfa.cli`, installed as ``hf-rfa-finetune``); see training/README.md.
"""

from hf_rfa.cli import _command, finetune_main as main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(_command(main, "training/finetune.py")())  # a user error: one line, status 2, as the installed command
