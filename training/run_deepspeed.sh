#!/usr/bin/env bash
# DeepSpeed ZeRO-2 (STAGE=2) or ZeRO-3 (STAGE=3); needs `pip install deepspeed` and GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${STAGE:-2}
NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
MODEL=${MODEL:-$(python -c "from hf_rfa.assets import smollm2_path; print(smollm2_path())")}
TRAIN=${TRAIN:-$(python -c "from hf_rfa.assets import wikipedia_text_file as f; print(f('train'))")}
accelerate launch --config_file "training/configs/deepspeed_zero${STAGE}.yaml" --num_processes "$NGPU" training/train_accelerate.py \
  --model_name_or_path "$MODEL" --task causal-lm --train_file "$TRAIN" --validation_split_percentage 5 \
  --preset favor+ --num_features 64 --window 64 --redraw_interval 100 \
  --max_seq_length 2048 --per_device_train_batch_size 4 --gradient_accumulation_steps 1 \
  --learning_rate 1e-4 --max_train_steps 1000 --checkpointing_steps 250 \
  --output_dir "${OUT:-runs/zero${STAGE}}" "$@"
