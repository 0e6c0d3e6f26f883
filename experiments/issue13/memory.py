"""Exact global memory (RFAConfig.memory, hf_rfa/ops/memory.py) on SmolLM2-135M, untrained.

For each variant: convert, then the copy task at gap 512 (second-copy perplexity, 4 draws, seed 0)
and perplexity at context 1024 (4096 eval tokens) on the held-out Wikipedia eval split. One JSON
line per measurement on stdout (and appended to --out).

    OMP_NUM_THREADS=1 .venv/bin/python experiments/issue13/memory.py --threads 1 \
        --variants none,none+mem,favor+mem --out experiments/issue13/memory.jsonl
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hf_rfa
from hf_rfa import assets
from hf_rfa.feature_maps import register_feature_map
from hf_rfa.feature_maps.base import FeatureMap, Features
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.pipeline import load_model

BASE = dict(window=256, sinks=4, seed=0)
VARIANTS = {
    "none": dict(feature_map="none", **BASE),
    "none+mem": dict(feature_map="none", memory=128, memory_every=64, **BASE),
    "favor+mem": dict(feature_map="favor+", num_features=256, memory=128, memory_every=64, **BASE),
    "favor+": dict(feature_map="favor+", num_features=256, **BASE),
    "none+mem256": dict(feature_map="none", memory=256, memory_every=64, **BASE),
    "favor+mem256": dict(feature_map="favor+", num_features=256, memory=256, memory_every=64, **BASE),
}
# session 16: window 64 + 4 sinks (the main job's window); the memory ranked by ||v|| or by the
# feature state's recall error (memory_score="feature_error", LoLA-style)
W64 = dict(window=64, sinks=4, seed=0)
for _m in (64, 128, 256):
    VARIANTS[f"w64:none+mem{_m}"] = dict(feature_map="none", memory=_m, memory_every=64, **W64)
    VARIANTS[f"w64:favor+mem{_m}"] = dict(feature_map="favor+", num_features=256, memory=_m, memory_every=64, **W64)
    VARIANTS[f"w64:favor+mem{_m}err"] = dict(feature_map="favor+", num_features=256, memory=_m, memory_every=64, memory_score="feature_error", **W64)
VARIANTS["w64:none"] = dict(feature_map="none", **W64)
# a control: the same recall-error ranking with a trivial one-feature map φ ≡ 1 (the state then
# predicts every key's value as the mean of the folded values: novelty w.r.t. the mean, no
# random features; its feature part is a flat average of the far keys)
VARIANTS["w64:uniform+mem128err"] = dict(feature_map="uniform", num_features=1, memory=128, memory_every=64, memory_score="feature_error", **W64)


@register_feature_map("uniform")
class UniformFeatures(FeatureMap):
    """φ(x) = 1 (one feature): a flat kernel, every far key weighs exp(0)."""

    @property
    def feature_dim(self) -> int:
        return 1

    def forward_queries(self, x: torch.Tensor) -> Features:
        return Features(torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device), None)

    forward_keys = forward_queries
VARIANTS["w64:favor+"] = dict(feature_map="favor+", num_features=256, **W64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="none,none+mem,favor+mem", help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--tasks", default="copy512,ppl1024", help="of copy512, copy3584, ppl1024, passkeyN (N tokens)")
    p.add_argument("--trials", type=int, default=20, help="passkey trials per depth")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="passkey depths")
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tasks = args.tasks.split(",")
    path = str(assets.smollm2_path())
    _, tok, _ = load_model(path)
    ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
    for name in args.variants.split(","):
        model, _, _ = load_model(path)
        cfg = hf_rfa.RFAConfig(**VARIANTS[name])
        model = hf_rfa.convert(model, cfg).eval()
        with torch.no_grad():
            for task in tasks:
                t0 = time.time()
                if task in ("copy512", "copy3584"):
                    r = long_range.copy_task(model, ev, gap=int(task[4:]), draws=args.draws, seed=0, progress=False)
                elif task.startswith("passkey"):
                    r = long_range.passkey_task(model, tok, lengths=(int(task[7:]),), depths=tuple(float(x) for x in args.depths.split(",")), trials=args.trials, seed=0, progress=False)
                elif task == "ppl1024":
                    r = evaluation.perplexity(model, ev, 1024, args.ppl_tokens, progress=False)
                else:
                    raise ValueError(f"unknown task {task!r}")
                row = {"variant": name, "config": VARIANTS[name], "task": task, **r, "sec": round(time.time() - t0, 1)}
                line = json.dumps(row)
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
