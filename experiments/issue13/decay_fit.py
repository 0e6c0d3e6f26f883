"""Issue 13 experiment: a per-kv-head decay of the feature state, chosen from measured layer error.

Starts from the Hedgehog W64 map transferred at context 1024 (``transfer_budget.py --save``),
converted with ``RFAConfig(decay=...)``. For every layer and kv head, the half-life is picked from
``--grid`` (1 ≈ the feature part off for that head: its nearest far key is W tokens back) by the
squared error of the layer's op output against softmax on ``--calib-tokens`` of calibration
(train split) text at context ``--calib-context``; then ppl at ``--contexts`` and copy @512 on the
held-out split. Rows are JSON lines, also appended to ``--out``; the fitted half-lives are saved
with ``--save``.
"""
import argparse
import json
import logging
import math
import os
import time
from collections import Counter

import torch

import hf_rfa
from hf_rfa import assets
from hf_rfa.config import RFAConfig
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion import calibration
from hf_rfa.recipes.conversion.pipeline import load_model

p = argparse.ArgumentParser()
p.add_argument("--state", default="/tmp/e1/hedgehog_w64.pt", help="transferred feature-map tensors (transfer_budget.py --save)")
p.add_argument("--m", type=int, default=64)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--grid", default="1,32,64,128,256,512,1024,4096,1e9")
p.add_argument("--calib-context", type=int, default=4096)
p.add_argument("--calib-tokens", type=int, default=4096)
p.add_argument("--contexts", default="1024,4096")
p.add_argument("--ppl-tokens", type=int, default=4096)
p.add_argument("--copy-draws", type=int, default=4)
p.add_argument("--save", default="")
p.add_argument("--out", default="experiments/issue13/decay.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.WARNING)
t0 = time.time()

model, tok, _ = load_model(str(assets.smollm2_path()))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
hf_rfa.convert(model, RFAConfig(feature_map="hedgehog", num_features=a.m, window=a.window, sinks=a.sinks, decay=128.0, feature_map_options={"hybrid_mix": True}))
saved = torch.load(a.state)
missing = [k for k in saved if k not in model.state_dict()]
if missing:
    raise SystemExit(f"{len(missing)} saved tensors have no place in the model, e.g. {missing[:3]}")
model.load_state_dict(saved, strict=False)
layers = calibration.rfa_layers(model)
grid = [float(x) for x in a.grid.split(",")]

# --- fit: per layer, per kv head, the half-life of least output error ---------------------------
windows = [w.unsqueeze(0) for w in evaluation.token_windows(train, a.calib_context, max(1, a.calib_tokens // a.calib_context))]
err = {i: torch.zeros(len(grid), layers[i].feature_map.num_kv_heads) for i in layers}
with torch.no_grad():
    for ids in windows:
        caps = calibration.capture(model, ids)
        for i, rfa in layers.items():
            cap, fm = caps[i], rfa.feature_map
            hkv = cap.k.shape[1]
            g = cap.q.shape[1] // hkv
            for j, h in enumerate(grid):
                fm.decay_log_rate.fill_(math.log(math.log(2.0) / h))
                o = calibration.rfa_output(rfa, cap)
                d = (o - cap.out).float()[:, :, a.window:]  # [B,H,N-W,Dv]: earlier rows have no far key
                err[i][j] += d.pow(2).sum((0, 2, 3)).view(hkv, g).sum(1)
        del caps
chosen = {}
for i, rfa in layers.items():
    best = err[i].argmin(0)  # [Hkv]
    hl = torch.tensor([grid[b] for b in best])
    rfa.feature_map.decay_log_rate.data.copy_(torch.log(math.log(2.0) / hl))
    chosen[i] = hl.tolist()
counts = Counter(h for v in chosen.values() for h in v)
fit_minutes = round((time.time() - t0) / 60, 2)
print(json.dumps({"chosen_half_lives": {str(k): v for k, v in chosen.items()}, "counts": {f"{k:g}": c for k, c in sorted(counts.items())}, "fit_minutes": fit_minutes}), flush=True)
if a.save:
    torch.save(chosen, a.save)

# --- measure ----------------------------------------------------------------------------------
row = {"variant": f"hedgehog m={a.m} transferred, decay per kv head fitted on layer error @{a.calib_context}", "window": a.window, "sinks": a.sinks,
       "half_life_counts": {f"{k:g}": c for k, c in sorted(counts.items())}}
for c in (int(x) for x in a.contexts.split(",")):
    r = evaluation.perplexity(model, ev, c, a.ppl_tokens, progress=False)
    row[f"ppl@{c}"] = round(r["perplexity"], 3)
    row[f"tokens@{c}"] = r["tokens"]
if a.copy_draws:
    r = long_range.copy_task(model, ev, 512, 256, a.copy_draws, seed=0, progress=False)
    row["copy@512"] = round(r["second"], 3)
row["minutes"] = round((time.time() - t0) / 60, 2)
print(json.dumps(row), flush=True)
with open(a.out, "a") as f:
    f.write(json.dumps({**row, "chosen": {str(k): v for k, v in chosen.items()}, "args": vars(a)}) + "\n")
