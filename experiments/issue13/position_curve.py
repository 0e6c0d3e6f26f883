"""Issue 13 diagnostic: perplexity by position bucket inside 4096-token windows.

Two held-out windows of ``--context`` tokens; each model's mean NLL per position, reported as
perplexity over buckets of ``--bucket`` positions. A learned map applied to rotary-embedded q/k
that only saw positions below its transfer context shows its excess growing with the position even
when a decay keeps the number of far keys it reads constant. Variants: ``original``,
``none`` (window-only) and ``NAME=STATE:HALF_LIFE`` (a Hedgehog W64 map from ``STATE``, a
``transfer_budget.py``/``decay_transfer.py --save`` file, with that decay; 0 = none).
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F

import hf_rfa
from hf_rfa import assets
from hf_rfa.config import RFAConfig
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion.pipeline import load_model

p = argparse.ArgumentParser()
p.add_argument("variants", nargs="+")
p.add_argument("--context", type=int, default=4096)
p.add_argument("--windows", type=int, default=2)
p.add_argument("--bucket", type=int, default=1024)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--m", type=int, default=64)
p.add_argument("--out", default="experiments/issue13/position_curve.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
_, tok, _ = load_model(str(assets.smollm2_path()))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
wins = [w.unsqueeze(0) for w in evaluation.token_windows(ev, a.context, a.windows)]


def curve(m):
    with torch.no_grad():
        nll = torch.stack([F.cross_entropy(m(ids).logits[0, :-1].float(), ids[0, 1:], reduction="none") for ids in wins]).mean(0)
    return [round(float(nll[i:i + a.bucket].mean().exp()), 2) for i in range(0, a.context - 1, a.bucket)]


for v in a.variants:
    m, _, _ = load_model(str(assets.smollm2_path()))
    if v == "none":
        hf_rfa.convert(m, RFAConfig(feature_map="none", window=a.window, sinks=a.sinks))
    elif v != "original":
        name, spec = v.split("=", 1)
        state, hl = spec.rsplit(":", 1)
        hf_rfa.convert(m, RFAConfig(feature_map="hedgehog", num_features=a.m, window=a.window, sinks=a.sinks, decay=float(hl), feature_map_options={"hybrid_mix": True}))
        m.load_state_dict(torch.load(state), strict=False)
    row = {"variant": v, "context": a.context, "windows": a.windows, "bucket": a.bucket, "ppl_by_bucket": curve(m)}
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
