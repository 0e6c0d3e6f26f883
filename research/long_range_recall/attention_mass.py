"""Where does the original model's attention go beyond the recall preset's exact window?

For every layer and kv head of the original SmolLM2-135M-Instruct (exact softmax), the share of
attention probability that lands on keys outside the last ``--window`` positions and the first
``--sinks`` tokens (the keys the feature state or the exact memory must answer), averaged over
the queries past position ``window + sinks`` and over the query heads of each kv head, on
``--windows`` held-out Wikipedia windows of ``--context`` tokens. Writes one JSON line per layer
(``mass`` per kv head, ``layer_mass`` their mean) and the per-layer memory sizes that split a
total of ``--memory`` keys per kv head over the layers in proportion to ``layer_mass``.

    NT=2 python research/long_range_recall/attention_mass.py --context 4096 --windows 2
"""

import argparse
import json
import os
from pathlib import Path

import torch
import transformers
from transformers import AttentionInterface

from hf_rfa import assets
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--context", type=int, default=4096)
p.add_argument("--windows", type=int, default=2)
p.add_argument("--window", type=int, default=64)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--memory", type=int, default=256, help="keys per kv head on average over the layers (the recipe's uniform memory)")
p.add_argument("--out", default=str(Path(__file__).with_name("attention_mass.jsonl")))
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

SUMS: dict[int, torch.Tensor] = {}


def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """sdpa's output, and on the side the out-of-window mass per kv head (row chunks of 512)."""
    b, h, n, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    kk = key.repeat_interleave(g, dim=1)
    scale = scaling if scaling is not None else d**-0.5
    s = torch.arange(n)
    tot = torch.zeros(hkv, dtype=torch.float64)
    for c0 in range(a.window + a.sinks, n, 512):
        t = torch.arange(c0, min(n, c0 + 512))
        logits = (query[:, :, t].float() @ kk.float().transpose(-1, -2)) * scale  # [B,H,C,N]
        logits = logits.masked_fill((s.view(1, -1) > t.view(-1, 1)), float("-inf"))
        prob = logits.softmax(-1)
        far = (s.view(1, -1) <= t.view(-1, 1) - a.window) & (s.view(1, -1) >= a.sinks)
        tot += (prob * far).sum(-1).sum(-1).sum(0).view(hkv, g).sum(-1).double()
    SUMS[module.layer_idx] = SUMS.get(module.layer_idx, 0) + tot / (g * (n - a.window - a.sinks))
    out = torch.nn.functional.scaled_dot_product_attention(query, kk, value.repeat_interleave(g, dim=1), is_causal=True, scale=scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("mass_probe", probe)
model, tok, _ = load_model(str(assets.smollm2_path()))
model.set_attn_implementation("mass_probe")
ids = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
windows = evaluation.token_windows(ids, a.context, a.windows)
with torch.no_grad():
    for w in windows:
        model(input_ids=w.unsqueeze(0), use_cache=False)
layers = sorted(SUMS)
mass = {i: (SUMS[i] / len(windows)).tolist() for i in layers}
layer_mass = {i: sum(m) / len(m) for i, m in mass.items()}
total = a.memory * len(layers)
raw = {i: total * layer_mass[i] / sum(layer_mass.values()) for i in layers}
sizes = {i: int(round(raw[i])) for i in layers}
with open(a.out, "w") as f:
    for i in layers:
        f.write(json.dumps({"layer": i, "mass": [round(x, 4) for x in mass[i]], "layer_mass": round(layer_mass[i], 4), "proportional_memory": sizes[i],
                            "context": a.context, "windows": len(windows), "window": a.window, "sinks": a.sinks}) + "\n")
print(json.dumps({"per_layer_memory": [sizes[i] for i in layers], "sum": sum(sizes.values()), "target": total}))
for i in layers:
    print(i, f"{layer_mass[i]:.3f}", [f"{x:.3f}" for x in mass[i]], sizes[i])
