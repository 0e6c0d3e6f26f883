"""Peak RSS of the main job's LoRA stage: SmolLM2-135M converted with the main job's recipe,
``transfer.lora_finetune`` for a few steps at the LoRA context, the main job's autocast rule
(with ``--dtype bfloat16`` on a CPU without bf16 matrix units, as the conversion: bf16 weights
multiplied in float32, no autocast).

    .venv/bin/python benchmarks/lora_stage_memory.py                     # this checkout
    .venv/bin/python benchmarks/lora_stage_memory.py --src /path/to/other/checkout
    .venv/bin/python benchmarks/lora_stage_memory.py --activation-checkpointing
    .venv/bin/python benchmarks/lora_stage_memory.py --activation-checkpointing --malloc-mmap-threshold 0

``--src`` imports ``hf_rfa`` from another checkout instead (e.g. an older commit from ``git
worktree add``), so two versions can be compared on one machine; the recipe (``train_step.RECIPES
["main"]``) and the seeded token ids are the same for both, and so are the losses (printed). One JSON
line: peak RSS of the process (``resource.getrusage``), the losses, seconds, which ``hf_rfa``.
``--malloc-mmap-threshold`` is glibc's threshold as ``hf-rfa-convert`` sets it on the CPU (4 MiB;
0: glibc's own, which keeps freed blocks of up to 32 MiB resident: see
``hf_rfa.recipes.conversion.host_memory``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence (the main job's LoRA context: 4096)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer's activations in the backward (hf-rfa-convert --activation-checkpointing)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the frozen weights")
    ap.add_argument("--malloc-mmap-threshold", type=int, default=4, help="MiB; glibc's mmap threshold as the conversion sets it on the CPU (0: glibc's default)")
    ap.add_argument("--src", type=Path, default=None, help="a checkout whose hf_rfa is imported instead of the installed one")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.context < 2:
        raise ValueError(f"steps must be >= 1 and context >= 2, got steps={args.steps}, context={args.context}")
    if args.src is not None:
        if not (args.src / "hf_rfa" / "__init__.py").is_file():
            raise ValueError(f"--src must be a checkout with hf_rfa/__init__.py, got {args.src}")
        # the editable install's finder would otherwise win over sys.path
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__ and "editable" not in getattr(f, "__name__", "")]
        sys.path.insert(0, str(args.src.resolve()))
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM

    import hf_rfa
    from hf_rfa.assets.models import smollm2_path
    from hf_rfa.recipes.conversion import precision, transfer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_step import RECIPES

    torch.set_num_threads(args.threads)
    if args.malloc_mmap_threshold:
        from hf_rfa.recipes.conversion.host_memory import map_large_blocks  # (an older --src may lack it)

        map_large_blocks(args.malloc_mmap_threshold)
    torch.manual_seed(0)  # PEFT's LoRA initialisation
    weights = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=weights)
    dtype = precision.resolve_autocast("auto", "cpu")
    if args.dtype != "float32":
        from hf_rfa.recipes.conversion import devices

        if hasattr(devices, "training_autocast"):  # as load_model and the LoRA stage (an older --src may lack it: autocast as above)
            dtype = devices.training_autocast("auto", torch.device("cpu"), weights)
            if devices.needs_float32_compute(torch.device("cpu"), weights):
                devices.float32_compute(model)  # bf16 storage, float32 matmuls (no bf16 matrix hardware here)
    hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPES["main"]))
    if args.dtype != "float32":  # as the conversion does: low-precision frozen weights, float32 maps
        devices.keep_trainable_float32(model)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(10, model.config.vocab_size, (1, args.context), generator=g), None) for _ in range(args.steps)]
    t0 = time.perf_counter()
    extra = {"activation_checkpointing": True} if args.activation_checkpointing else {}  # (an older --src may not take it)
    _, res = transfer.lora_finetune(model, iter(batches), tokens=args.steps * args.context, lr=1e-3, progress=False, autocast=dtype, **extra)
    print(json.dumps({
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "losses": res.losses,
        "seconds": time.perf_counter() - t0, "context": args.context, "steps": args.steps, "threads": args.threads,
        "dtype": args.dtype, "activation_checkpointing": args.activation_checkpointing,
        "malloc_mmap_threshold_mib": args.malloc_mmap_threshold,
        "autocast": precision.dtype_name(dtype), "hf_rfa": os.path.dirname(hf_rfa.__file__),
    }))


if __name__ == "__main__":
    main()
