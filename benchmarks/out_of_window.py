"""What the feature part of a hybrid has to estimate in a real model, and how well it does.

For every layer of a causal LM (default: the offline SmolLM2-135M-Instruct) on held-out text, with
the exact window W and S sinks of the hybrid recipe, this prints:

- ``mass_out``: the softmax attention mass that falls *outside* the window and the sinks (mean
  over query rows that have such keys) — the most any feature part could recover;
- ``exponent``: mean ‖x‖² + ‖y‖² of the scaled queries x = q·√scale and keys y = k·√scale. The
  relative variance of a positive random feature estimate of exp(x·y) is (exp(‖x + y‖²) − 1)/m
  (Choromanski et al. 2021), so with exponents of tens the estimate is carried by a few features;
- for each feature map: ``err_map`` = median over query rows of ‖o_map − o_softmax‖ / ‖o_softmax‖
  of the layer's attention output (the hybrid: exact window + sinks + the map for the rest), next
  to ``err_none`` = the same with the feature part switched off (``feature_map="none"``), and
  ``zrel`` = median relative error of the estimated out-of-window normaliser Σ_j exp(x·y_j).

A map earns its place in a layer only where ``err_map < err_none``. Every figure is from one
seeded draw of the projections per layer (``--seed``) on the first ``--tokens`` tokens of the
eval split.

    python benchmarks/out_of_window.py [--model PATH_OR_HUB_ID] [--maps favor+ positive favor++]
        [--num-features 256] [--window 256] [--sinks 4] [--tokens 1024] [--out benchmarks/results/out_of_window.md]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

import torch

from hf_rfa.feature_maps import build_feature_map, derive_seed
from hf_rfa.ops import random_feature_attention
from hf_rfa.recipes.conversion.calibration import capture

logger = logging.getLogger("out_of_window")


def out_of_window_mask(n: int, window: int, sinks: int) -> torch.Tensor:
    """``[N, N]`` bool: key j is causal-visible to query i but neither in its window nor a sink."""
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    return (j <= i - window) & (j >= sinks)


def layer_figures(cap, maps: list[str], num_features: int, window: int, sinks: int, seed: int, layer: int) -> dict:
    """Figures of one captured layer (batch 1): see the module docstring."""
    q, k, v, out = cap.q.double(), cap.k.double(), cap.v.double(), cap.out.double()
    h, hk, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    s = cap.scale if cap.scale is not None else d**-0.5
    g = h // hk
    x = q[0] * s**0.5  # [H, N, D]
    y = k[0].repeat_interleave(g, 0) * s**0.5
    logits = x @ y.transpose(-1, -2)  # [H, N, N]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
    o_mask = out_of_window_mask(n, window, sinks)
    rows = o_mask.any(-1)
    figures = {
        "layer": layer,
        "mass_out": float((p * o_mask).sum(-1)[:, rows].mean()),
        "exponent": float(x.pow(2).sum(-1).mean() + y.pow(2).sum(-1).mean()),
    }
    ref = out[0]  # [H, N, Dv]
    ref_norm = ref.norm(dim=-1).clamp_min(1e-30)

    def rel_err(o: torch.Tensor) -> float:
        return float(((o[0] - ref).norm(dim=-1) / ref_norm)[:, rows].median())

    none = build_feature_map("none", head_dim=d, num_features=1)
    figures["err_none"] = rel_err(random_feature_attention(q, k, v, none, causal=True, window=window, sinks=sinks, scale=s))
    log_z = torch.logsumexp(logits.masked_fill(~o_mask, float("-inf")), -1)  # [H, N]
    for name in maps:
        fm = build_feature_map(name, head_dim=d, num_features=num_features, seed=derive_seed(seed, "layer", layer)).double()
        if hasattr(fm, "calibrate"):
            fm.calibrate(x, y)
        o = random_feature_attention(q, k, v, fm, causal=True, window=window, sinks=sinks, scale=s)
        figures[f"err_{name}"] = rel_err(o)
        fq, fk = fm.forward_queries(x), fm.forward_keys(y)
        lq = fq.log_scale if fq.log_scale is not None else torch.zeros(x.shape[:-1], dtype=x.dtype)
        lk = fk.log_scale if fk.log_scale is not None else torch.zeros(y.shape[:-1], dtype=y.dtype)
        est = (fq.phi @ fk.phi.transpose(-1, -2)) * o_mask  # [H, N, N] without the per-token scales
        log_est = torch.log(est.clamp_min(1e-300)) + lq.unsqueeze(-1) + lk.unsqueeze(-2)
        log_zhat = torch.logsumexp(log_est.masked_fill(~o_mask, float("-inf")), -1)
        figures[f"zrel_{name}"] = float((log_zhat - log_z).exp().sub(1).abs()[:, rows].median())
    return figures


def table_markdown(rows: list[dict], maps: list[str], header: str) -> str:
    cols = ["layer", "mass_out", "exponent", "err_none"] + [f"err_{m}" for m in maps] + [f"zrel_{m}" for m in maps]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[c]) if c == "layer" else f"{r[c]:.3g}" for c in cols) + " |")
    mean = {c: sum(r[c] for r in rows) / len(rows) for c in cols[1:]}
    lines.append("| mean | " + " | ".join(f"{mean[c]:.3g}" for c in cols[1:]) + " |")
    wins = {m: sum(r[f"err_{m}"] < r["err_none"] for r in rows) for m in maps}
    lines += ["", "Layers where the map's hybrid output is closer to softmax than window + sinks alone: "
              + ", ".join(f"{m} {wins[m]}/{len(rows)}" for m in maps) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="causal LM folder or Hub id (default: the offline SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None, help="text file or dataset (default: the offline Wikipedia eval split)")
    p.add_argument("--maps", nargs="+", default=["favor+", "positive", "favor++"])
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tqdm.auto import tqdm

    from hf_rfa import assets
    from hf_rfa.recipes import evaluation
    from hf_rfa.recipes.conversion.pipeline import load_model

    t0 = time.time()
    model, tok, _ = load_model(a.model or str(assets.smollm2_path()))
    text = evaluation.load_text(a.text or str(assets.wikipedia_text_file("eval")))
    ids = evaluation.tokenize(tok, text)[: a.tokens]
    caps = capture(model, ids.unsqueeze(0))
    rows = []
    for layer in tqdm(sorted(caps), desc="layers"):
        r = layer_figures(caps[layer], a.maps, a.num_features, a.window, a.sinks, a.seed, layer)
        rows.append(r)
        logger.info(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    header = (
        f"Out-of-window attention of `{a.model or 'SmolLM2-135M-Instruct'}` on {len(ids)} held-out tokens; "
        f"window {a.window}, sinks {a.sinks}, m={a.num_features}, seed {a.seed}. "
        f"`python benchmarks/out_of_window.py --window {a.window} --sinks {a.sinks} --num-features {a.num_features} --tokens {a.tokens}` "
        f"({(time.time() - t0) / 60:.1f} min)."
    )
    md = table_markdown(rows, a.maps, header)
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)
    if not all(math.isfinite(r["err_none"]) for r in rows):
        raise SystemExit("non-finite figures")


if __name__ == "__main__":
    main()
