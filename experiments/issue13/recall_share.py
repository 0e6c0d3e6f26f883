"""Issue 13 probe (session 15): how much attention does the converted model's feature part put
on the first copy of a passage, where the original's induction heads put theirs?

Copy sequences of the held-out split (passage P = 256, gap G = 512, the same passage; the copy
test's draws, seed 0). One softmax forward of the converted model (``calibration.capture``: its
merged weights, softmax attention) gives q, k per layer; for every query t of the second copy
(from token 16 on) the *match* keys are the first copy's positions s ∈ {t − D − 1, t − D, t − D + 1}
(D = P + G = 768, far beyond the window). Per layer and head:

- ``softmax``: the share of the query's softmax attention on the match keys (what an induction
  head puts there);
- ``hybrid``: the same share under the converted layer's weights — exp(scale·q·k) for the window
  and sinks, the feature kernel φ(q)·φ(k) with its log scales and decay for every other key, one
  normaliser (the quadratic twin's weights, ``hf_rfa.ops.reference.quadratic_kernel_attention``);
- ``far_mass``: the hybrid's share on all feature-answered keys;
- ``match_in_far``: the match keys' share *within* the feature part (with its decay);
  ``match_in_far_nodecay``: the same without the decay, ``uniform_share``: what a flat kernel
  would give them (3 / the number of feature-answered keys) (the kernel's selectivity:
  with a Hedgehog map φ is a probability vector over F = 2m features, so φ(q)·φ(k) / mean_s
  φ(q)·φ(k_s) ≤ 1 / min_i mean_s φ(k_s)_i ≈ F for near-uniform key features; softmax has no such cap).

Printed: per layer the head with the largest softmax match share and its three hybrid numbers;
over all heads whose softmax match share is > 0.3 (induction-like), the medians. JSON line to
``--out``.
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
p.add_argument("--out", default="experiments/issue13/recall_share.jsonl")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

model, tok, _ = load_model(a.model)
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
P, G, SKIP = 256, 512, 16
seqs = long_range.copy_sequences(ev, P, G, a.draws, 0)
n, D = seqs.shape[1], P + G
rfas = calibration.rfa_layers(model)
t = torch.arange(n)
qpos = torch.arange(D + SKIP, n)  # second-copy queries
match = torch.zeros(len(qpos), n, dtype=torch.bool)
for off in (-1, 0, 1):
    match[torch.arange(len(qpos)), qpos - D + off] = True

stats = {}  # layer -> [draws][heads] tensors
for draw in range(a.draws):
    caps = calibration.capture(model, seqs[draw : draw + 1])
    for idx, c in sorted(caps.items()):
        rfa = rfas[idx]
        fmap = rfa.feature_map
        q, k = c.q[0].double(), c.k[0].double()  # [H,N,D], [Hkv,N,D]
        h, d, hkv = q.shape[0], q.shape[-1], k.shape[0]
        g = h // hkv
        scale = c.scale if c.scale is not None else d**-0.5
        root = scale**0.5
        fq_in, fk_in = calibration.feature_inputs(rfa, c)
        fq_in = (q if fq_in is None else fq_in[0].double()) * root
        fk_in = (k if fk_in is None else fk_in[0].double()) * root
        with torch.no_grad():
            fmap_d = fmap.double()
            fq, fk = fmap_d.forward_queries(fq_in[None]), fmap_d.forward_keys(fk_in[None])
            phi_q, phi_k = fq.phi[0], fk.phi[0].repeat_interleave(g, 0)  # [H,N,F]
            lq = fq.log_scale[0] if fq.log_scale is not None else torch.zeros(h, n, dtype=torch.float64)
            lk = fk.log_scale[0].repeat_interleave(g, 0) if fk.log_scale is not None else torch.zeros(h, n, dtype=torch.float64)
            logmag = lq[:, :, None] + lk[:, None, :]
            logmag_nodecay = logmag
            if fmap.has_gate:
                logg, log1mg = fmap_d.log_gate(fk_in[None])
                cg = torch.cumsum(logg[0], -1).repeat_interleave(g, 0)  # [H,N]
                logmag = logmag + cg[:, :, None] - cg[:, None, :] + log1mg[0].repeat_interleave(g, 0)[:, None, :]
            fmap.float()
        scores = (q * root) @ (k * root).repeat_interleave(g, 0).transpose(-1, -2)  # [H,N,N]
        causal = t[None, :] <= t[:, None]
        exact = causal & ((t[None, :] > t[:, None] - rfa.window) | (t[None, :] < rfa.sinks))
        feat = causal & ~exact
        sm = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)[:, qpos]
        log_w = torch.where(exact, scores, torch.where(feat, logmag, torch.full_like(scores, -1e30)))
        off = log_w.amax(-1, keepdim=True)
        w = torch.exp(torch.where(exact, scores - off, torch.full_like(scores, -1e30))) + (phi_q @ phi_k.transpose(-1, -2)) * torch.exp(torch.where(feat, logmag - off, torch.full_like(scores, -1e30)))
        w = (w / w.sum(-1, keepdim=True))[:, qpos]
        fm = feat[qpos]
        # the feature part alone, without its decay: the kernel's own selectivity
        kern = (phi_q @ phi_k.transpose(-1, -2) * torch.exp(logmag_nodecay - logmag_nodecay.amax(-1, keepdim=True)))[:, qpos] * fm
        row = {
            "softmax": (sm * match).sum(-1).mean(-1),
            "hybrid": (w * match).sum(-1).mean(-1),
            "far_mass": (w * fm).sum(-1).mean(-1),
            "match_in_far": ((w * match).sum(-1) / (w * fm).sum(-1).clamp_min(1e-30)).mean(-1),
            "match_in_far_nodecay": ((kern * match).sum(-1) / kern.sum(-1).clamp_min(1e-30)).mean(-1),
            "uniform_share": (match.sum(-1) / fm.sum(-1)).double().mean().expand(h),
        }
        stats.setdefault(idx, []).append(row)

layers, induction = [], {k: [] for k in ("softmax", "hybrid", "far_mass", "match_in_far", "match_in_far_nodecay", "uniform_share")}
for idx in sorted(stats):
    avg = {k: torch.stack([r[k] for r in stats[idx]]).mean(0) for k in stats[idx][0]}  # [H]
    best = int(avg["softmax"].argmax())
    layers.append({"layer": idx, "head": best, **{k: round(float(v[best]), 4) for k, v in avg.items()}})
    sel = avg["softmax"] > 0.3
    for k in induction:
        induction[k] += avg[k][sel].tolist()
    print(json.dumps(layers[-1]), flush=True)
med = {k: (round(float(torch.tensor(v).median()), 4) if v else None) for k, v in induction.items()}
summary = {"model": a.model, "draws": a.draws, "passage": P, "gap": G, "induction_heads": len(induction["softmax"]), "median_over_induction_heads": med, "layers": layers}
print(json.dumps({k: v for k, v in summary.items() if k != "layers"}), flush=True)
with open(a.out, "a") as f:
    f.write(json.dumps(summary) + "\n")
