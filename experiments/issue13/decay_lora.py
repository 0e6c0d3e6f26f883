"""Issue 13 experiment: the transferred Hedgehog W64 map with a decayed feature state, after LoRA.

Each ``--runs`` entry ``H:frozen`` or ``H:train``: convert with ``RFAConfig(decay=H)``, load the
transferred map (``transfer_budget.py --save``), LoRA r=8 for ``--lora`` tokens at context 1024 on
the same seeded stream as ``transfer_budget.py`` (seed 7), the feature maps (and so the decay)
frozen or trained end to end with the adapters (``lora_finetune(train_feature_maps=True)``); then
ppl at ``--contexts`` and copy @512. The window-only + LoRA baseline on the same stream is
``transfer_budget.jsonl``'s "none, LoRA 8192" row (22.35 / 15.28 / 21.57). JSON lines, also
appended to ``--out``.
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
p.add_argument("--state", default="/tmp/e1/hedgehog_w64.pt")
p.add_argument("--m", type=int, default=64)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--runs", default="128:frozen,128:train")
p.add_argument("--lora", type=int, default=8192)
p.add_argument("--lora-context", type=int, default=1024)
p.add_argument("--contexts", default="1024,4096")
p.add_argument("--ppl-tokens", type=int, default=4096)
p.add_argument("--copy-draws", type=int, default=4)
p.add_argument("--out", default="experiments/issue13/decay.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.WARNING)
t0 = time.time()
_, tok, _ = load_model(str(assets.smollm2_path()))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
saved = torch.load(a.state)

for run in a.runs.split(","):
    hl, mode = run.split(":")
    if mode not in ("frozen", "train"):
        raise SystemExit(f"run {run!r}: mode must be frozen or train")
    model, _, _ = load_model(str(assets.smollm2_path()))
    hf_rfa.convert(model, RFAConfig(feature_map="hedgehog", num_features=a.m, window=a.window, sinks=a.sinks, decay=float(hl), feature_map_options={"hybrid_mix": True}))
    model.load_state_dict(saved, strict=False)
    stream = evaluation.shuffled_batches(train, a.lora_context, 1, 7)
    model, res = transfer.lora_finetune(model, stream, a.lora, progress=False, train_feature_maps=(mode == "train"))
    hls = torch.cat([fm.decay_half_life() for fm in hf_rfa.model_feature_maps(model)])
    row = {"variant": f"hedgehog m={a.m} transferred, decay {hl} ({mode}) + LoRA {a.lora} @{a.lora_context}", "window": a.window, "sinks": a.sinks,
           "lora": res.as_dict(), "half_life_after": {"min": round(hls.min().item(), 1), "median": round(hls.median().item(), 1), "max": round(hls.max().item(), 1)}}
    for c in (int(x) for x in a.contexts.split(",")):
        r = evaluation.perplexity(model, ev, c, a.ppl_tokens, progress=False)
        row[f"ppl@{c}"] = round(r["perplexity"], 3)
        row[f"tokens@{c}"] = r["tokens"]
    if a.copy_draws:
        row["copy@512"] = round(long_range.copy_task(model, ev, 512, 256, a.copy_draws, seed=0, progress=False)["second"], 3)
    row["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps({**row, "args": vars(a)}) + "\n")
