"""Issue 13 probe (session 11): how many random features would recall need?

Untrained SmolLM2-135M-Instruct, window W + 4 sinks, rotated q/k, no decay; the feature part is an
unbiased positive random-feature estimate of the out-of-window softmax terms, so as m → ∞ the
converted model tends to the original (copy @512 second copy 1.21 in the main job's eval). This
measures the copy task (passage 256, gap 512, second-copy perplexity over ``--draws`` seeded
draws, the same draws for every row) and ppl @1024 for window-only (``none``) and FAVOR+/FAVOR++
with m = ``--ms``, to show where on the m axis exact recall starts to come through.
JSON lines to ``--out``.
"""
import argparse
import copy
import json
import os
import time

import torch

import hf_rfa
from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--maps", default="none,favor+,favor++")
p.add_argument("--ms", default="64,256,1024,4096")
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--draws", type=int, default=4)
p.add_argument("--ppl-tokens", type=int, default=4096)
p.add_argument("--out", default="experiments/issue13/recall_scaling.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

base, tok, _ = load_model(str(assets.smollm2_path()))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
variants = []
for fm in a.maps.split(","):
    for m in ([0] if fm in ("none", "original") else [int(x) for x in a.ms.split(",")]):
        variants.append((fm, m))
for fm, m in variants:
    t0 = time.time()
    if fm == "original":
        model = base
    else:
        cfg = hf_rfa.RFAConfig(feature_map=fm, num_features=max(m, 1) if fm != "none" else 64, window=a.window, sinks=a.sinks, seed=0)
        model = hf_rfa.convert(copy.deepcopy(base), cfg).eval()
    r = long_range.copy_task(model, ev, 512, 256, a.draws, seed=0, progress=False)
    row = {"map": fm, "m": m, "window": a.window, "sinks": a.sinks, "draws": a.draws, "copy@512_first": round(r["first"], 3), "copy@512_second": round(r["second"], 3)}
    if a.ppl_tokens:
        row["ppl@1024"] = round(evaluation.perplexity(model, ev, 1024, a.ppl_tokens, progress=False)["perplexity"], 3)
    row["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    del model
