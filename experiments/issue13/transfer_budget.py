"""Issue 13 experiment: does a learned feature map beat window-only attention once it is given
more attention transfer? SmolLM2-135M-Instruct, narrow exact window.

Rows (one JSON line each, also appended to ``--out``):
  * ``none``: window W + sinks S, every other key dropped (the baseline), untrained;
  * ``<map>@<tokens>``: ``<map>`` (hedgehog by default) m + the same window and sinks (+ hybrid mix),
    after ``tokens`` of hybrid attention transfer (the pipeline's ``attention_transfer``: only the
    feature maps train, layer outputs under the shared normaliser), evaluated at each checkpoint
    of ``--budgets`` (one continuing seeded stream, so 131072 continues the 65536 run);
  * with ``--lora``: the final transferred model and the baseline each after the same LoRA budget.
Each row: ppl at the ``--contexts`` (``--ppl-tokens`` held-out tokens each) and, with
``--copy-draws``, the copy task at gap 512. The original's figures are in conversion/RESULTS.md.
"""
import argparse
import copy
import json
import logging
import os
import time

import torch

import hf_rfa
from hf_rfa import assets
from hf_rfa.config import RFAConfig
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion import transfer
from hf_rfa.recipes.conversion.pipeline import load_model

p = argparse.ArgumentParser()
p.add_argument("--map", default="hedgehog")
p.add_argument("--m", type=int, default=64)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--budgets", default="65536,131072,262144")
p.add_argument("--context", type=int, default=1024)
p.add_argument("--queries", type=int, default=256, help="fit the last Q queries (0: all)")
p.add_argument("--lr", type=float, default=1e-2)
p.add_argument("--contexts", default="1024")
p.add_argument("--ppl-tokens", type=int, default=4096)
p.add_argument("--copy-draws", type=int, default=0)
p.add_argument("--lora", type=int, default=0, help="LoRA tokens for both final models (0: none)")
p.add_argument("--skip-baseline", action="store_true")
p.add_argument("--original", action="store_true", help="also measure the unconverted model first")
p.add_argument("--save", default="", help="save the transferred feature-map tensors here")
p.add_argument("--out", default="experiments/issue13/transfer_budget.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.WARNING)
torch.manual_seed(0)

model, tok, _ = load_model(str(assets.smollm2_path()))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
contexts = [int(c) for c in a.contexts.split(",")]
t_start = time.time()


def measure(m, name, extra=None):
    row = {"variant": name, "window": a.window, "sinks": a.sinks, **(extra or {})}
    for c in contexts:
        r = evaluation.perplexity(m, ev, c, a.ppl_tokens, progress=False)
        row[f"ppl@{c}"] = round(r["perplexity"], 3)
        row[f"tokens@{c}"] = r["tokens"]
    if a.copy_draws:
        r = long_range.copy_task(m, ev, 512, 256, a.copy_draws, seed=0, progress=False)
        row["copy@512"] = round(r["second"], 3)
    row["minutes_since_start"] = round((time.time() - t_start) / 60, 2)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps({**row, "args": vars(a)}) + "\n")


def lora(m):
    stream = evaluation.shuffled_batches(train, a.context, 1, 7)
    out, res = transfer.lora_finetune(m, stream, a.lora, progress=False)
    return out, res.as_dict()


if a.original:
    measure(model, "original (softmax)")
if not a.skip_baseline:
    base = copy.deepcopy(model)
    hf_rfa.convert(base, RFAConfig(feature_map="none", window=a.window, sinks=a.sinks))
    measure(base, "none, untrained")
    if a.lora:
        trained, st = lora(base)
        measure(trained, f"none, LoRA {a.lora}", {"lora": st})
    del base

opts = {"hybrid_mix": True} if a.map == "hedgehog" else {"learnable": True}
hf_rfa.convert(model, RFAConfig(feature_map=a.map, num_features=a.m, window=a.window, sinks=a.sinks, feature_map_options=opts))
stream = evaluation.shuffled_batches(train, a.context, 1, 0)
done = 0
for i, budget in enumerate(int(b) for b in a.budgets.split(",")):
    res = transfer.attention_transfer(
        model, stream, budget - done, lr=a.lr, init_mix=(i == 0), progress=False, queries=a.queries or None,
    )
    done += res.tokens
    measure(model, f"{a.map} m={a.m}, transfer {done}", {"transfer": res.as_dict(), "transfer_tokens": done})
if a.save:
    torch.save({k: v for k, v in model.state_dict().items() if ".rfa." in k}, a.save)
if a.lora:
    trained, st = lora(model)
    measure(trained, f"{a.map} m={a.m}, transfer {done} + LoRA {a.lora}", {"lora": st, "transfer_tokens": done})
