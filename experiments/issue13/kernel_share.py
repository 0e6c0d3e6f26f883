"""Issue 13 probe (session 16): which kernel of the attention logits could carry a passage
beyond the window? The selectivity of candidate kernels on the original's own q, k.

Same copy sequences and match keys as ``recall_share.py`` (P 256, gap 512, match = the first
copy's positions t − 768 ± 1 for every second-copy query from token 16 on). For each head whose
softmax puts > 30 % of the query's attention on the match keys (induction-like), the share of the
match keys *among the far keys* (older than the window, not sinks: what a feature part answers)
under a kernel κ(s) of the scaled logit s = scale · q·k:

- ``exp``: κ = exp(s) — softmax restricted to the far keys (what an exact kernel would give);
- ``taylor2``: κ = 1 + s + s²/2 (the second-order Taylor map of Based, Arora et al. 2024;
  positive for every s; features 1, x, vec(x xᵀ)/√2 — 1 + d + d(d+1)/2 of them after folding the
  symmetric products);
- ``taylor2/τ``: the same on s/τ; ``uniform``: 3 / the number of far keys;
- each on the logits of the rotated q/k (``rot``) and of the un-rotated ones (``unrot``, what the
  recipe's feature maps read).

Medians over the induction heads are printed and appended as one JSON line to ``--out``.
"""
import argparse
import json
import os

import torch

from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion import calibration
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--model", default="/tmp/s14/fresh_main/out/smollm2-135m-rfa")
p.add_argument("--draws", type=int, default=2)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--out", default="experiments/issue13/kernel_share.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

model, tok, _ = load_model(a.model)
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
P, G, SKIP = 256, 512, 16
seqs = long_range.copy_sequences(ev, P, G, a.draws, 0)
n, D = seqs.shape[1], P + G
rfas = calibration.rfa_layers(model)
t = torch.arange(n)
qpos = torch.arange(D + SKIP, n)
match = torch.zeros(len(qpos), n, dtype=torch.bool)
for off in (-1, 0, 1):
    match[torch.arange(len(qpos)), qpos - D + off] = True
far = (t[None, :] <= qpos[:, None] - a.window) & (t[None, :] >= a.sinks)  # [Q,N]

KERNELS = {
    "exp": lambda s: torch.exp(s - s.amax(-1, keepdim=True)),
    "taylor2": lambda s: 1 + s + s * s / 2,
    "taylor2/2": lambda s: 1 + s / 2 + (s / 2) ** 2 / 2,
    "taylor2/0.5": lambda s: 1 + 2 * s + (2 * s) ** 2 / 2,
    "taylor4": lambda s: 1 + s + s**2 / 2 + s**3 / 6 + s**4 / 24,
    "taylor6": lambda s: sum(s**i / float(torch.arange(1, i + 1).prod()) for i in range(7)),
    "relu2": lambda s: torch.relu(s) ** 2 + 1e-6,
}
RANKS = (4, 8, 16)  # exp of the logit of q, k projected on the top-r principal directions of [q; k]

stats = {}
for draw in range(a.draws):
    caps = calibration.capture(model, seqs[draw : draw + 1])
    for idx, c in sorted(caps.items()):
        rfa = rfas[idx]
        q, k = c.q[0].double(), c.k[0].double()
        h, d, hkv = q.shape[0], q.shape[-1], k.shape[0]
        g = h // hkv
        scale = c.scale if c.scale is not None else d**-0.5
        fq, fk = calibration.feature_inputs(rfa, c)
        inputs = {"rot": (q, k)}
        if fq is not None:
            inputs["unrot"] = (fq[0].double(), fk[0].double())
        causal = t[None, :] <= t[:, None]
        s_rot = scale * q @ k.repeat_interleave(g, 0).transpose(-1, -2)
        sm = torch.softmax(s_rot.masked_fill(~causal, float("-inf")), -1)[:, qpos]
        row = {"softmax": (sm * match).sum(-1).mean(-1), "uniform": (match.sum(-1) / far.sum(-1)).double().mean().expand(h)}
        for iname, (qq, kk) in inputs.items():
            s = (scale * qq @ kk.repeat_interleave(g, 0).transpose(-1, -2))[:, qpos]
            s = s.masked_fill(~far, float("-inf"))
            for kname, fn in KERNELS.items():
                kv = fn(s.masked_fill(~far, 0.0)) * far if kname != "exp" else fn(s)
                row[f"{kname}:{iname}"] = ((kv * match).sum(-1) / kv.sum(-1)).mean(-1)
            if iname == "unrot":
                kf = s.masked_fill(~far, float("nan"))
                row["far_logit_p01"] = kf.nanquantile(0.01, dim=-1).mean(-1)
                row["far_logit_p99"] = kf.nanquantile(0.99, dim=-1).mean(-1)
                row["match_logit"] = (s.masked_fill(~match, 0).sum(-1) / 3).mean(-1)
                kr = kk.repeat_interleave(g, 0)
                for r in RANKS:
                    basis = torch.linalg.svd(torch.cat([qq, kr], 1), full_matrices=False).Vh[:, :r]  # [H,r,D]
                    sr = scale * (qq @ basis.transpose(-1, -2)) @ (kr @ basis.transpose(-1, -2)).transpose(-1, -2)
                    sr = sr[:, qpos].masked_fill(~far, float("-inf"))
                    kv = torch.exp(sr - sr.amax(-1, keepdim=True))
                    row[f"exp_rank{r}:unrot"] = ((kv * match).sum(-1) / kv.sum(-1)).mean(-1)
        stats.setdefault(idx, []).append(row)

induction = {}
per_layer = []
for idx in sorted(stats):
    avg = {k: torch.stack([r[k] for r in stats[idx]]).mean(0) for k in stats[idx][0]}
    sel = avg["softmax"] > 0.3
    for k2, v in avg.items():
        induction.setdefault(k2, []).extend(v[sel].tolist())
    if sel.any():
        per_layer.append({"layer": idx, "heads": sel.nonzero().flatten().tolist(), **{k2: [round(x, 4) for x in v[sel].tolist()] for k2, v in avg.items()}})
        print(json.dumps(per_layer[-1]), flush=True)
med = {k2: round(float(torch.tensor(v).median()), 4) for k2, v in induction.items() if v}
summary = {"model": a.model, "draws": a.draws, "window": a.window, "sinks": a.sinks, "induction_heads": len(induction.get("softmax", [])), "median_over_induction_heads": med, "heads": per_layer}
print(json.dumps(med), flush=True)
with open(a.out, "a") as f:
    f.write(json.dumps(summary) + "\n")
