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

All logic lives in :mod:`hf_rfa.recipes.training`; see training/README.md.
"""

import logging
import sys

from transformers import HfArgumentParser, TrainingArguments

from hf_rfa.recipes.training import DataArguments, ModelArguments, RFAArguments, run_trainer


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ModelArguments, DataArguments, RFAArguments, TrainingArguments))
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith((".json", ".yaml", ".yml")):
        model_args, data_args, rfa_args, training_args = parser.parse_yaml_file(sys.argv[1]) if not sys.argv[1].endswith(".json") else parser.parse_json_file(sys.argv[1])
    else:
        model_args, data_args, rfa_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO if training_args.process_index == 0 else logging.WARNING)
    return run_trainer(model_args, data_args, rfa_args, training_args)


if __name__ == "__main__":
    main()
