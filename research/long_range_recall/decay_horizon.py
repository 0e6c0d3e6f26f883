"""How far does a converted model's feature state reach? The learned decay of every layer and kv
head (``S_t = γ S_{t−1} + φ(k_t) v_tᵀ``, ``γ = exp(−exp(decay_log_rate))``) as a half-life in
tokens, and the weight ``γ^d`` a key keeps in the state ``d`` tokens later.

    python research/long_range_recall/decay_horizon.py --model out/smollm2-135m-rfa --distances 512 3584
"""

import argparse
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", required=True, help="a converted model's folder with the decay (e.g. a make main output)")
p.add_argument("--distances", type=int, nargs="+", default=[512, 3584])
a = p.parse_args()

weights = load_file(str(Path(a.model) / "model.safetensors"))
rates = [v.float() for k, v in sorted(weights.items()) if k.endswith("decay_log_rate")]
if not rates:
    p.error(f"{a.model} has no learned decay (no *.decay_log_rate tensor): convert with a decay, e.g. the recall preset")
rate = torch.cat(rates).exp()  # −log γ per kv head
half = math.log(2.0) / rate
print(f"{len(rates)} layers × {rate.numel() // len(rates)} kv heads")
print("| | min | median | max |")
print("|---|---|---|---|")
print(f"| half-life (tokens) | {half.min():.0f} | {half.median():.0f} | {half.max():.0f} |")
for d in a.distances:
    w = torch.exp(-d * rate)
    print(f"| weight kept after {d:,} tokens | {w.min():.1e} | {w.median():.1e} | {w.max():.1e} |")
