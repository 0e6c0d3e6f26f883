#!/usr/bin/env bash
# One GPU (bf16): SmolLM2 converted with the recall preset, LoRA-tuned on a text file, Accelerate loop.
# MODEL / TRAIN / EVAL default to the offline assets; on a Hub-connected machine use Hub ids
# (e.g. MODEL=HuggingFaceTB/SmolLM2-135M, --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$(python -c "from hf_rfa.assets import smollm2_path; print(smollm2_path())")}
TRAIN=${TRAIN:-$(python -c "from hf_rfa.assets import wikipedia_text_file as f; print(f('train'))")}
EVAL=${EVAL:-$(python -c "from hf_rfa.assets import wikipedia_text_file as f; print(f('eval'))")}
accelerate launch --config_file training/configs/single_gpu.yaml training/train_accelerate.py \
  --model_name_or_path "$MODEL" --task causal-lm --train_file "$TRAIN" --validation_file "$EVAL" \
  --preset recall --lora_r 8 \
  --max_seq_length 1024 --per_device_train_batch_size 8 --gradient_accumulation_steps 4 \
  --learning_rate 5e-4 --warmup_steps 20 --max_train_steps 500 --checkpointing_steps 100 \
  --output_dir "${OUT:-runs/smollm2-hedgehog-lora}" "$@"
