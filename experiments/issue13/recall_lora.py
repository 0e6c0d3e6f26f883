"""Issue 13 probe (session 15): can the features learn to carry a passage past the window when the
LoRA data asks for it?

Every earlier LoRA trained on plain Wikipedia windows, where almost nothing beyond 64 tokens back
is needed, so the features had no reason to carry recall. Here the extra LoRA stream alternates
plain 1,024-token windows with *recall sequences* from the training split: ``[prefix text]
[passage P][gap text G][the same passage]`` (P uniform in [128, 256], G uniform in [256, 1024 −
2P], prefix filling the rest; passages and gaps from disjoint halves of the training text, a
seeded generator). The recipe (the ``make main`` output) and the window-only W64 baseline (rebuilt
as in the main job: convert + LoRA 32,768 tokens @4096 on the main job's stream) get the same
extra LoRA (``--tokens`` at 1,024, lr 1e-3, r 8); the recipe trains its feature maps (and decay)
too unless ``--frozen-maps``. Evaluation on the held-out split: copy @512 (``--copy-draws`` draws,
seed 0, second and first copy) and perplexity @1024 / @4096 (4,096 tokens each), before and after.
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
from hf_rfa.recipes.conversion import transfer
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--recipe-model", default="/tmp/s14/fresh_main/out/smollm2-135m-rfa")
p.add_argument("--variants", default="recipe,none64", help="recipe (the --recipe-model), none<W> (window-only W + 4 sinks, rebuilt)")
p.add_argument("--tokens", type=int, default=65536)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--recall-fraction", type=float, default=0.5, help="share of recall sequences in the extra LoRA stream")
p.add_argument("--frozen-maps", action="store_true", help="the recipe's feature maps stay frozen (default: trained with the adapters)")
p.add_argument("--copy-draws", type=int, default=8)
p.add_argument("--seed", type=int, default=15)
p.add_argument("--out", default="experiments/issue13/recall_lora.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

orig, tok, _ = load_model(str(assets.smollm2_path()))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))
L = 1024


def recall_stream(ids: torch.Tensor, seed: int, fraction: float):
    """Endless ``(input_ids [1, 1024], None)``: recall sequences with probability ``fraction``,
    else plain windows of the first half of ``ids`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    half = ids.numel() // 2
    while True:
        if float(torch.rand((), generator=g)) < fraction:
            P = int(torch.randint(128, 257, (), generator=g))
            G = int(torch.randint(256, L - 2 * P + 1, (), generator=g))
            pre = L - 2 * P - G
            s = int(torch.randint(0, half - P - pre, (), generator=g))
            q = int(torch.randint(half, ids.numel() - G, (), generator=g))
            passage = ids[s + pre : s + pre + P]
            x = torch.cat([ids[s : s + pre], passage, ids[q : q + G], passage])
        else:
            s = int(torch.randint(0, half - L, (), generator=g))
            x = ids[s : s + L]
        yield x[None], None


def measure(model) -> dict:
    c = long_range.copy_task(model, ev, gap=512, passage=256, draws=a.copy_draws, seed=0, progress=False)
    out = {"copy512_second": round(c["second"], 3), "copy512_first": round(c["first"], 3)}
    for ctx in (1024, 4096):
        out[f"ppl@{ctx}"] = round(evaluation.perplexity(model, ev, ctx, 4096, progress=False)["perplexity"], 3)
    return out


for v in a.variants.split(","):
    t0 = time.time()
    train_maps = False
    if v == "recipe":
        model, _, _ = load_model(a.recipe_model)
        train_maps = not a.frozen_maps
    else:
        model = hf_rfa.convert(copy.deepcopy(orig), hf_rfa.RFAConfig(feature_map="none", window=int(v.removeprefix("none")), sinks=4, seed=0))
        model, _ = transfer.lora_finetune(model, evaluation.shuffled_batches(train, 4096, 1, 7), 32768, lr=1e-3, r=8, progress=False)
    row = {"variant": v, "extra_lora_tokens": a.tokens, "lr": a.lr, "recall_fraction": a.recall_fraction, "train_feature_maps": train_maps, "seed": a.seed, "before": measure(model)}
    print(json.dumps(row), flush=True)
    t1 = time.time()
    model, res = transfer.lora_finetune(model, recall_stream(train, a.seed, a.recall_fraction), a.tokens, lr=a.lr, r=8, progress=False, train_feature_maps=train_maps)
    row["extra_lora_minutes"] = round((time.time() - t1) / 60, 2)
    row["after"] = measure(model)
    row["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    del model
