"""Issue 13 experiment: does a decay of the feature state let a learned map generalise to long
contexts (and beat window-only there)?

The Hedgehog W64 map transferred at context 1024 (``transfer_budget.py --save``) is worse than
dropping the far keys at 4096: its feature part's mass grows with the number of far keys. Here the
feature state decays, S_t = γ S_{t−1} + φ(k_t) v_tᵀ (no (1−γ) factor, so the mass the map learned
near the window is unchanged), through the ops' generic gate path (``has_gate`` / ``log_gate``).
γ = 2^(−1/half_life) per head, the same for every head.

Rows (JSON lines, also appended to ``--out``): ``none`` (window-only baseline, same window and
sinks) and ``hedgehog, half-life H`` for each ``--half-lives`` (0 = no decay), ppl at each of
``--contexts`` over ``--ppl-tokens`` held-out tokens, and with ``--copy-draws`` the copy task @512.
"""
import argparse
import copy
import json
import logging
import math
import os
import time
import types

import torch

import hf_rfa
from hf_rfa import assets
from hf_rfa.config import RFAConfig
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.pipeline import load_model

p = argparse.ArgumentParser()
p.add_argument("--state", default="/tmp/e1/hedgehog_w64.pt", help="transferred feature-map tensors (transfer_budget.py --save)")
p.add_argument("--m", type=int, default=64)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--half-lives", default="0,2048,512,128")
p.add_argument("--contexts", default="1024,4096")
p.add_argument("--ppl-tokens", type=int, default=4096)
p.add_argument("--copy-draws", type=int, default=0)
p.add_argument("--skip-baseline", action="store_true")
p.add_argument("--out", default="experiments/issue13/decay.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.WARNING)

model, tok, _ = load_model(str(assets.smollm2_path()))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
contexts = [int(c) for c in a.contexts.split(",")]
t0 = time.time()


def measure(m, name, extra=None):
    row = {"variant": name, "window": a.window, "sinks": a.sinks, **(extra or {})}
    for c in contexts:
        r = evaluation.perplexity(m, ev, c, a.ppl_tokens, progress=False)
        row[f"ppl@{c}"] = round(r["perplexity"], 3)
        row[f"tokens@{c}"] = r["tokens"]
    if a.copy_draws:
        r = long_range.copy_task(m, ev, 512, 256, a.copy_draws, seed=0, progress=False)
        row["copy@512"] = round(r["second"], 3)
    row["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps({**row, "args": vars(a)}) + "\n")


if not a.skip_baseline:
    base = copy.deepcopy(model)
    hf_rfa.convert(base, RFAConfig(feature_map="none", window=a.window, sinks=a.sinks))
    measure(base, "none, untrained")
    del base

hf_rfa.convert(model, RFAConfig(feature_map="hedgehog", num_features=a.m, window=a.window, sinks=a.sinks, feature_map_options={"hybrid_mix": True}))
saved = torch.load(a.state)
missing = [k for k in saved if k not in model.state_dict()]
if missing:
    raise SystemExit(f"{len(missing)} saved tensors have no place in the model, e.g. {missing[:3]}")
model.load_state_dict(saved, strict=False)
maps = [mod for mod in model.modules() if isinstance(mod, hf_rfa.feature_maps.FeatureMap)]


def set_half_life(h: float) -> None:
    for fm in maps:
        if h <= 0:
            fm.has_gate = False
            continue
        logg = -math.log(2.0) / h

        def log_gate(self, x, logg=logg):
            lg = torch.full(x.shape[:-1], logg, dtype=x.dtype, device=x.device)
            return lg, torch.zeros_like(lg)

        fm.log_gate = types.MethodType(log_gate, fm)
        fm.has_gate = True


for h in (float(x) for x in a.half_lives.split(",")):
    set_half_life(h)
    measure(model, f"hedgehog m={a.m} transferred, half-life {h:g}", {"half_life": h})
