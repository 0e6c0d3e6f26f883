#!/usr/bin/env bash
# Two CPU processes (gloo) on one machine: the same recipes as on a GPU node.
# NOTE: with accelerate 1.15, `accelerate launch --cpu --num_processes 2` starts ONE process (multi-CPU
# launching goes through mpirun). Use torchrun via --multi_gpu plus ACCELERATE_USE_CPU=1, which makes
# Accelerate choose MULTI_CPU with the gloo backend. Trainer additionally takes --use_cpu true.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$(python -c "from hf_rfa.assets import minilm_path; print(minilm_path())")}
TRAIN=${TRAIN:-$(python -c "from hf_rfa.assets import rotten_tomatoes_csv as f; print(f('train'))")}
TEST=${TEST:-$(python -c "from hf_rfa.assets import rotten_tomatoes_csv as f; print(f('test'))")}
LAUNCH=(env ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no)
COMMON=(--model_name_or_path "$MODEL" --task classification --train_file "$TRAIN" --validation_file "$TEST"
        --max_train_samples 256 --max_eval_samples 256 --max_seq_length 48 --preset favor+ --num_features 32 --redraw_interval 4)
"${LAUNCH[@]}" training/train_accelerate.py "${COMMON[@]}" --per_device_train_batch_size 8 --max_train_steps 16 \
  --checkpointing_steps 8 --output_dir "${OUT:-runs/cpu2}/accelerate"
"${LAUNCH[@]}" training/finetune.py "${COMMON[@]}" --per_device_train_batch_size 8 --max_steps 16 --use_cpu true \
  --do_train --do_eval --report_to none --save_strategy no --output_dir "${OUT:-runs/cpu2}/trainer"
# FSDP2 on CPU (Accelerate does not enable FSDP for CPU processes; this applies the config's wrap policy directly):
# torchrun --nproc_per_node 2 training/fsdp_cpu_check.py --config training/configs/fsdp_llama.yaml --model_name_or_path CKPT --train_file FILE --out fsdp.json
