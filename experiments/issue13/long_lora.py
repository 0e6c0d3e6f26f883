"""Issue 13 probe (session 11): does a second LoRA at a long context close the recipe's gap at 8192?

The recipe (session-10 ``make main`` output: transfer + LoRA 8,192 tokens @1024) is 1.066× the
original at 8192. Each variant gets the same extra budget on the same seeded stream: a second LoRA
of ``--tokens`` tokens at ``--context`` (merged). The window-only baselines are first rebuilt as in
the main job (convert the original, LoRA 8,192 tokens @1024 on the main job's stream: seed 0 + 7),
so every row has had 8,192 @1024 + the extra LoRA. Held-out perplexity at 1024 / 4096 / 8192 with
the main job's budgets (4,096 / 4,096 / 8,192 tokens), before and after the extra LoRA.
``original`` is the unconverted model with the same LoRA budgets: the reference for how much of a
LoRA's gain is adaptation to the Wikipedia text rather than to the conversion (with
``--first-tokens 0 --tokens 32768 --context 4096 --stream-seed 7`` it gets exactly the session-11
main job's LoRA).
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
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import transfer
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--recipe-model", default="/tmp/s10/fresh2/out/smollm2-135m-rfa")
p.add_argument("--variants", default="recipe,none64,none128", help="recipe, none<W> (window-only W + 4 sinks), original (SDPA)")
p.add_argument("--tokens", type=int, default=32768)
p.add_argument("--context", type=int, default=4096)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--first-tokens", type=int, default=8192, help="the main job's (session 10) first LoRA @1024 for the rebuilt baselines and the original (0: none)")
p.add_argument("--stream-seed", type=int, default=101, help="seed of the extra LoRA's stream (7: the main job's LoRA stream with seed 0)")
p.add_argument("--contexts", default="1024,4096,8192")
p.add_argument("--out", default="experiments/issue13/long_lora.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

orig, tok, _ = load_model(str(assets.smollm2_path()))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))


def ppl(model):
    return {f"ppl@{c}": round(evaluation.perplexity(model, ev, c, 8192 if c >= 8192 else 4096, progress=False)["perplexity"], 3) for c in [int(x) for x in a.contexts.split(",")]}


for v in a.variants.split(","):
    t0 = time.time()
    if v == "recipe":
        model, _, _ = load_model(a.recipe_model)
    else:
        model = copy.deepcopy(orig)  # "original": the unconverted model with the same LoRA budgets (domain adaptation)
        if v != "original":
            model = hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="none", window=int(v.removeprefix("none")), sinks=4, seed=0))
        if a.first_tokens:
            model, _ = transfer.lora_finetune(model, evaluation.shuffled_batches(train, 1024, 1, 7), a.first_tokens, lr=1e-3, r=8, progress=False)
    row = {"variant": v, "first_lora_tokens": a.first_tokens if v != "recipe" else "(in the checkpoint)", "extra_lora_tokens": a.tokens, "extra_lora_context": a.context, "lr": a.lr, "stream_seed": a.stream_seed, "before": ppl(model)}
    t1 = time.time()
    model, res = transfer.lora_finetune(model, evaluation.shuffled_batches(train, a.context, 1, a.stream_seed), a.tokens, lr=a.lr, r=8, progress=False)
    row["extra_lora_minutes"] = round((time.time() - t1) / 60, 2)
    row["after"] = ppl(model)
    row["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    del model
