"""LoRA on the converted SmolLM2-135M-Instruct: float32 vs ``lora_finetune(autocast="bf16")``.

    .venv/bin/python benchmarks/lora_autocast.py --n 512 --steps 4 --threads 1

The main job's conversion (FAVOR+ m=256, window 256, 4 sinks), then ``lora_finetune`` (r=8, lr 1e-3)
on the same seeded batches of Wikipedia train text for each mode, each mode in its own process,
the modes alternating (``--rounds``) so that they share the machine's load. Prints tokens/s (the
stage's wall time, first step included) and the loss of every step; writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RECIPE = dict(feature_map="favor+", num_features=256, window=256, sinks=4, seed=0)


def one_mode(mode: str, n: int, steps: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rfa
    from hf_rfa.assets.models import smollm2_path
    from hf_rfa.assets.wikipedia import wikipedia_text_file
    from hf_rfa.recipes import evaluation
    from hf_rfa.recipes.conversion import transfer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    text = wikipedia_text_file("train").read_text()[: 40 * n * 8]
    ids = torch.tensor(tok(text)["input_ids"])
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    model = hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPE))
    _, res = transfer.lora_finetune(model, evaluation.shuffled_batches(ids, n, 1, 7), tokens=n * steps, progress=False, autocast=None if mode == "fp32" else mode)
    return {"mode": mode, "n": n, "steps": res.steps, "tokens": res.tokens, "seconds": res.seconds, "tok_s": res.tokens / res.seconds, "losses": res.losses, "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=512, help="tokens per step (batch 1)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--rounds", type=int, default=1, help="alternations of the modes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "lora_autocast.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_mode(args.child, args.n, args.steps, args.threads)), flush=True)
        return
    results = []
    for _ in range(args.rounds):
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--child", mode, "--n", str(args.n), "--steps", str(args.steps), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            r = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"mode": mode, "error": proc.stderr.strip().splitlines()[-1:]}
            print(json.dumps(r), flush=True)
            results.append(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python benchmarks/lora_autocast.py " + " ".join(sys.argv[1:]), "results": results}, indent=1))


if __name__ == "__main__":
    main()
