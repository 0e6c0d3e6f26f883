"""Issue 13 probe (session 11): is the learned decay too short for long contexts?

Loads a converted checkpoint with a learned decay (default: the session-10 ``make main`` output),
multiplies every head's half-life by each of ``--scales`` (decay_log_rate − log s; 0 = no decay),
and measures held-out perplexity at ``--contexts`` with the main job's eval budgets (4,096 tokens
at 1024/4096, 8,192 at 8192). No training: it only asks whether a longer memory of the feature state
helps at 8192 (where the recipe is 1.066× the original) and what it costs at 1024.
JSON lines to ``--out``.
"""
import argparse
import json
import math
import os
import time

import torch

from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--model", default="/tmp/s10/fresh2/out/smollm2-135m-rfa")
p.add_argument("--scales", default="1,2,4,0")
p.add_argument("--contexts", default="1024,4096,8192")
p.add_argument("--copy-draws", type=int, default=0)
p.add_argument("--out", default="experiments/issue13/decay_scale.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

model, tok, _ = load_model(a.model)
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
rates = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("decay_log_rate")}
if not rates:
    raise SystemExit(f"{a.model} has no learned decay")
for s in [float(x) for x in a.scales.split(",")]:
    t0 = time.time()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in rates:
                # s = 0: no decay (rate → 0, γ → 1)
                p.copy_(rates[n] - (math.log(s) if s > 0 else 80.0))
    hl = [math.log(2) / math.exp(float(r)) * (s if s > 0 else float("inf")) for r in torch.cat(list(rates.values()))]
    row = {"model": a.model, "half_life_scale": s, "half_life_min": round(min(hl), 1), "half_life_max": round(max(hl), 1)}
    for c in [int(x) for x in a.contexts.split(",")]:
        r = evaluation.perplexity(model, ev, c, 8192 if c >= 8192 else 4096, progress=False)
        row[f"ppl@{c}"] = round(r["perplexity"], 3)
        row[f"tokens@{c}"] = r["tokens"]
    if a.copy_draws:
        r = long_range.copy_task(model, ev, 512, 256, a.copy_draws, seed=0, progress=False)
        row["copy@512"] = round(r["second"], 3)
    row["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
