#!/usr/bin/env bash
# Multi-GPU DDP on one node: all-MiniLM-L6-v2 (or any BERT) converted to favor+ and fine-tuned as a
# classifier with Trainer; projections redrawn every 100 optimizer steps on every rank identically.
set -euo pipefail
cd "$(dirname "$0")/.."
NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
MODEL=${MODEL:-$(python -c "from hf_rfa.assets import minilm_path; print(minilm_path())")}
TRAIN=${TRAIN:-$(python -c "from hf_rfa.assets import rotten_tomatoes_csv as f; print(f('train'))")}
TEST=${TEST:-$(python -c "from hf_rfa.assets import rotten_tomatoes_csv as f; print(f('test'))")}
accelerate launch --config_file training/configs/ddp.yaml --num_processes "$NGPU" training/finetune.py \
  --model_name_or_path "$MODEL" --task classification --train_file "$TRAIN" --validation_file "$TEST" \
  --preset favor+ --num_features 64 --redraw_interval 100 --max_seq_length 64 \
  --do_train --do_eval --num_train_epochs 3 --per_device_train_batch_size 32 --learning_rate 1e-4 \
  --eval_strategy epoch --save_strategy epoch --bf16 true --report_to none \
  --output_dir "${OUT:-runs/minilm-favor-rt}" "$@"
