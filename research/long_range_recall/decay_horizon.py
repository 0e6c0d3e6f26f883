"""How far does a converted model's feature state reach? The learned decay of every layer and kv
head (``S_t = γ S_{t−1} + φ(k_t) v_tᵀ``, ``γ = exp(−exp(decay_log_rate))``) as a half-life in
tokens, and the weight ``γ^d`` a key keeps in the state ``d`` tokens later. With ``--output``, also
writes a copy of the model whose decays are changed without retraining (every half-life times
``--scale-half-life``; the kv heads in ``--no-decay-heads`` of every layer without decay), for
``recall.py --model``.

    python research/long_range_recall/decay_horizon.py --model out/smollm2-135m-rfa --distances 512 3584
    python research/long_range_recall/decay_horizon.py --model out/smollm2-135m-rfa --scale-half-life 8 --output ~/runs/recipe-decay-slow8
"""

import argparse
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SUFFIX = "decay_log_rate"
NO_DECAY = -30.0  # −log γ = e^−30: γ = 1 to float precision

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", required=True, help="a converted model's folder with the decay (e.g. a make main output)")
p.add_argument("--distances", type=int, nargs="+", default=[512, 3584])
p.add_argument("--output", default=None, help="write a copy of the model with the changed decays here")
p.add_argument("--scale-half-life", type=float, default=1.0, help="with --output: multiply every half-life by this")
p.add_argument("--no-decay-heads", type=int, nargs="*", default=[], help="with --output: these kv heads of every layer get no decay")
a = p.parse_args()
if a.scale_half_life <= 0:
    p.error(f"--scale-half-life must be > 0, got {a.scale_half_life}")

weights = load_file(str(Path(a.model) / "model.safetensors"))
names = sorted(k for k in weights if k.endswith(SUFFIX))
if not names:
    p.error(f"{a.model} has no learned decay (no *.{SUFFIX} tensor): convert with a decay, e.g. the recall preset")
heads = weights[names[0]].numel()
if any(not 0 <= h < heads for h in a.no_decay_heads):
    p.error(f"--no-decay-heads must be kv heads in 0..{heads - 1}, got {a.no_decay_heads}")
if a.output:
    for k in names:
        rate = weights[k].float() - math.log(a.scale_half_life)  # half-life ∝ 1 / exp(rate)
        rate[a.no_decay_heads] = NO_DECAY
        weights[k] = rate.to(weights[k].dtype).contiguous()
    shutil.copytree(a.model, a.output)
    save_file(weights, str(Path(a.output) / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {a.output}")

rate = torch.cat([weights[k].float() for k in names]).exp()  # −log γ per kv head
half = math.log(2.0) / rate
print(f"{len(names)} layers × {heads} kv heads")
print("| | min | median | max |")
print("|---|---|---|---|")
print(f"| half-life (tokens) | {half.min():.0f} | {half.median():.0f} | {half.max():.0f} |")
for d in a.distances:
    w = torch.exp(-d * rate)
    print(f"| weight kept after {d:,} tokens | {w.min():.1e} | {w.median():.1e} | {w.max():.1e} |")
