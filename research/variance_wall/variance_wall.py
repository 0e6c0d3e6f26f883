"""How many positive random features would one far key of a pretrained model need?

For FAVOR+-type positive features φ(x) = exp(w·x − |x|²/2)/√m, w ~ N(0, I), with q̃ = q·D^(−1/4)
and k̃ = k·D^(−1/4) (so that E φ(q̃)·φ(k̃) = exp(q·k/√D)), one feature's relative variance is
exp(|q̃ + k̃|²) − 1, so m features estimate that key's term to a relative standard deviation of
√((exp(|q̃ + k̃|²) − 1)/m): one needs m ≳ exp(|q̃ + k̃|²) just to get it right within a factor of 2.
(Orthogonal projections and FAVOR++ lower the constant, not the exponential.)

On the original SmolLM2-135M-Instruct (softmax; rotated q/k as FAVOR+ reads them), one captured
forward over ``--tokens`` held-out tokens. For every layer, head and query t ≥ ``--from``, the key
outside the window (s ≤ t − W) and after the sinks that gets the largest softmax weight: its weight
and log10 exp(|q̃ + k̃|²) = the log10 of the m it needs. Printed per layer (median over heads and
queries) and overall percentiles. The copy/passkey task needs exactly such keys (the match beyond
the window), so no affordable number of random features can carry it. JSON line to ``--out``.

    python research/variance_wall/variance_wall.py --tokens 1024 --window 64
"""
import argparse
import json
import math
import os

import torch

from hf_rfa import assets
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import calibration
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--tokens", type=int, default=1024)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--from", dest="start", type=int, default=512)
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "result.jsonl"))
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

model, tok, _ = load_model(str(assets.smollm2_path()))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
ids = ev[: a.tokens].unsqueeze(0)
caps = calibration.capture(model, ids)
n = a.tokens
t = torch.arange(n)
far = (t[None, :] <= t[:, None] - a.window) & (t[None, :] >= a.sinks)  # [Nq, Nk]
causal = t[None, :] <= t[:, None]
all_log10m, all_w, per_layer = [], [], []
for idx in sorted(caps):
    c = caps[idx]
    q, k = c.q[0].double(), c.k[0].double()  # [H, N, D], [Hkv, N, D]
    h, d = q.shape[0], q.shape[-1]
    k = k.repeat_interleave(h // k.shape[0], 0)
    scale = c.scale if c.scale is not None else d**-0.5
    s = torch.einsum("hqd,hkd->hqk", q, k) * scale
    w = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    wf = w.masked_fill(~far, -1.0)[:, a.start :]  # [H, Nq', Nk]
    top_w, top_s = wf.max(-1)  # the far key with the largest weight per query
    qt = q[:, a.start :] * scale**0.5
    kt = torch.gather(k * scale**0.5, 1, top_s[..., None].expand(-1, -1, d))
    e = ((qt + kt) ** 2).sum(-1)  # |q̃ + k̃|²
    log10m = e / math.log(10)
    all_log10m.append(log10m.flatten())
    all_w.append(top_w.flatten())
    per_layer.append({"layer": idx, "median_log10_m": round(float(log10m.median()), 2), "median_top_far_weight": round(float(top_w.median()), 4)})
    print(json.dumps(per_layer[-1]), flush=True)
L, W = torch.cat(all_log10m), torch.cat(all_w)
big = W > 0.1  # queries that put > 10 % of their weight on one far key
row = {
    "tokens": n, "window": a.window, "sinks": a.sinks, "queries_from": a.start,
    "log10_m_needed_percentiles_10_50_90": [round(float(L.quantile(x)), 2) for x in (0.1, 0.5, 0.9)],
    "fraction_queries_with_a_far_key_over_10pct": round(float(big.double().mean()), 4),
    "log10_m_needed_for_those_percentiles_10_50_90": [round(float(L[big].quantile(x)), 2) for x in (0.1, 0.5, 0.9)] if big.any() else None,
    "per_layer": per_layer,
}
print(json.dumps({k: v for k, v in row.items() if k != "per_layer"}))
with open(a.out, "a") as f:
    f.write(json.dumps(row) + "\n")
