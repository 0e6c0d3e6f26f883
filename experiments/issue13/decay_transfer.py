"""Issue 13 experiment: continue the hybrid attention transfer of the Hedgehog W64 map *with* the
decay in place (the features then learn the keys the decayed state can still reach), then LoRA.

Starts from the session-7 map (``transfer_budget.py --save``, 65,536 transfer tokens without
decay), converts with ``RFAConfig(decay=--decay)`` (γ trainable), re-initialises the hybrid mix
from data (``init_mixing`` weighs the far keys by their decay), transfers ``--tokens`` more tokens
at context ``--context`` (the pipeline's ``attention_transfer``, last ``--queries`` queries, stream
seed ``--seed``: different windows from the first 65,536 tokens' stream, seed 0), measures, then
LoRA r=8 for ``--lora`` tokens at 1024 on the stream of ``transfer_budget.py`` (seed 7) and measures
again. ``--max-position P``: the transfer sees each sequence at a random position offset up to P
(``attention_transfer(max_position=)``). Rows: JSON lines, also appended to ``--out``; ``--save`` keeps the map after transfer.
"""
import argparse
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
p.add_argument("--state", default="/tmp/e1/hedgehog_w64.pt", help="feature-map tensors to start from ('': a fresh map, --prior-tokens 0)")
p.add_argument("--feature-input", default="rotated", choices=["rotated", "unrotated"], help="RFAConfig(feature_input=)")
p.add_argument("--m", type=int, default=64)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--decay", type=float, default=128.0)
p.add_argument("--tokens", type=int, default=65536)
p.add_argument("--context", type=int, default=1024)
p.add_argument("--queries", type=int, default=256)
p.add_argument("--lr", type=float, default=1e-2)
p.add_argument("--seed", type=int, default=1)
p.add_argument("--lora", type=int, default=8192)
p.add_argument("--contexts", default="1024,4096")
p.add_argument("--ppl-tokens", type=int, default=4096)
p.add_argument("--copy-draws", type=int, default=4)
p.add_argument("--max-position", type=int, default=0, help="random position offsets in transfer up to this position (0: positions from 0)")
p.add_argument("--prior-tokens", type=int, default=65536, help="transfer tokens already in --state (for the row's name)")
p.add_argument("--save", default="")
p.add_argument("--out", default="experiments/issue13/decay.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.WARNING)
t0 = time.time()
model, tok, _ = load_model(str(assets.smollm2_path()))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
hf_rfa.convert(model, RFAConfig(feature_map="hedgehog", num_features=a.m, window=a.window, sinks=a.sinks, decay=a.decay, feature_map_options={"hybrid_mix": True}, feature_input=a.feature_input))
if a.state:
    model.load_state_dict(torch.load(a.state), strict=False)


def measure(m, name, extra=None):
    hls = torch.cat([fm.decay_half_life() for fm in hf_rfa.model_feature_maps(m)])
    row = {"variant": name, "window": a.window, "sinks": a.sinks, **(extra or {}),
           "half_life": {"min": round(hls.min().item(), 1), "median": round(hls.median().item(), 1), "max": round(hls.max().item(), 1)}}
    for c in (int(x) for x in a.contexts.split(",")):
        r = evaluation.perplexity(m, ev, c, a.ppl_tokens, progress=False)
        row[f"ppl@{c}"] = round(r["perplexity"], 3)
        row[f"tokens@{c}"] = r["tokens"]
    if a.copy_draws:
        row["copy@512"] = round(long_range.copy_task(m, ev, 512, 256, a.copy_draws, seed=0, progress=False)["second"], 3)
    row["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps({**row, "args": vars(a)}) + "\n")


res = transfer.attention_transfer(model, evaluation.shuffled_batches(train, a.context, 1, a.seed), a.tokens, lr=a.lr, init_mix=True,
                                  progress=False, queries=a.queries or None, max_position=a.max_position or None, seed=a.seed)
name = f"hedgehog m={a.m}, {a.prior_tokens} transfer tokens + {res.tokens} with decay {a.decay:g} (trained)" + (f", positions up to {a.max_position}" if a.max_position else "") + (", un-rotated q/k" if a.feature_input == "unrotated" else "")
measure(model, name, {"transfer": res.as_dict()})
if a.save:
    torch.save({k: v for k, v in model.state_dict().items() if ".rfa." in k}, a.save)
if a.lora:
    trained, st = transfer.lora_finetune(model, evaluation.shuffled_batches(train, 1024, 1, 7), a.lora, progress=False)
    measure(trained, name + f" + LoRA {a.lora}", {"lora": st.as_dict()})
