"""Issue 13 probe (session 16): the `make main` recipe (transferred Hedgehog, un-rotated q/k,
learned decay, W64 + 4 sinks, after LoRA) with an exact memory of M keys per kv head added
afterwards (no retraining), ranked by ‖v‖ or by the feature state's recall error
(``memory_score="feature_error"``), against the same recipe without memory.

Tasks as ``memory.py`` (copy @512 second copy over --draws seeded draws, passkey at --length with
--trials per depth, ppl @1024 on 4,096 eval tokens). JSON lines to ``--out``.
"""
import argparse
import json
import os
import time

import torch

from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--model", default="/tmp/s14/fresh_main/out/smollm2-135m-rfa")
p.add_argument("--variants", default="mem128err,mem128,nomem", help="nomem | mem<M> | mem<M>err")
p.add_argument("--tasks", default="passkey2048,copy512,ppl1024")
p.add_argument("--draws", type=int, default=4)
p.add_argument("--trials", type=int, default=10)
p.add_argument("--depths", default="0.1,0.5,0.9")
p.add_argument("--out", default="experiments/issue13/recipe_memory.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
for name in a.variants.split(","):
    model, tok, _ = load_model(a.model)
    model.eval()
    memory = 0 if name == "nomem" else int(name[3:].removesuffix("err"))
    score = "feature_error" if name.endswith("err") else "value_norm"
    for mod in model.modules():
        if hasattr(mod, "rfa") and hasattr(mod.rfa, "memory"):
            mod.rfa.memory, mod.rfa.memory_every, mod.rfa.memory_score = memory, 64, score
    ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
    with torch.no_grad():
        for task in a.tasks.split(","):
            t0 = time.time()
            if task.startswith("copy"):
                r = long_range.copy_task(model, ev, gap=int(task[4:]), draws=a.draws, seed=0, progress=False)
            elif task.startswith("passkey"):
                r = long_range.passkey_task(model, tok, lengths=(int(task[7:]),), depths=tuple(float(x) for x in a.depths.split(",")), trials=a.trials, seed=0, progress=False)
            elif task.startswith("ppl"):
                r = evaluation.perplexity(model, ev, int(task[3:]), 4096, progress=False)
            else:
                raise ValueError(task)
            row = {"model": a.model, "variant": name, "memory": memory, "memory_score": score, "task": task, **r, "sec": round(time.time() - t0, 1)}
            print(json.dumps(row), flush=True)
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
