"""Model-level prefill guard: a converted causal LM's forward over N tokens vs the original's.

Loads the model (default: the offline SmolLM2-135M-Instruct), times one no-grad forward over N
held-out tokens with the original (SDPA) and with a converted copy (default: an earlier main job's
recipe, FAVOR+ m=256 + window 256 + 4 sinks), interleaved ``--reps`` times so both see the same
machine load, and prints the median seconds, the ratio and whether the goal (converted
≥ 1.5× faster at 16,384 tokens) is met. One JSON line per N, then a Markdown table.

    python benchmarks/prefill.py [--n 4096 16384] [--reps 2] [--threads 2] [--goal 1.5]
        [--feature-map favor+ --num-features 256 --window 256 --sinks 4 --decay 0 --feature-input rotated]
        [--out benchmarks/results/prefill.md]
    the main job's recipe: --feature-map hedgehog --num-features 64 --window 64 --decay 128 --feature-input unrotated
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from downstream_table import cpu_name  # noqa: E402 - the sibling script's (lscpu's model name)


def time_forward(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """Seconds of one no-grad forward over ``ids [1, N]`` (logits of the last token only)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0



def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="causal LM folder or Hub id (default: the offline SmolLM2-135M-Instruct)")
    p.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--goal", type=float, default=1.5, help="required speed-up of the converted model at the largest N")
    p.add_argument("--feature-map", default="favor+")
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--decay", type=float, default=0.0, help="half-life of the feature state's decay (0: none)")
    p.add_argument("--feature-input", default="rotated", help="rotated | unrotated (the main job's recipe: unrotated)")
    p.add_argument("--memory", type=int, default=0, help="exact memory keys per kv head (0: none)")
    p.add_argument("--memory-score", default="value_norm", help="value_norm | feature_error (the main job's: feature_error with --memory 128)")
    p.add_argument("--memory-per-layer", default=None, help="comma-separated memory size per layer (RFAConfig.memory_per_layer; e.g. the published model's split), overrides --memory layer by layer")
    p.add_argument("--out", default=None, help="also write the Markdown table here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    import hf_rfa
    from hf_rfa import assets
    from hf_rfa.recipes import evaluation
    from hf_rfa.recipes.conversion.pipeline import load_model

    model, tok, _ = load_model(a.model or str(assets.smollm2_path()))
    cfg = hf_rfa.RFAConfig(feature_map=a.feature_map, num_features=a.num_features, window=a.window, sinks=a.sinks, decay=a.decay, feature_input=a.feature_input,
                            memory=a.memory, memory_score=a.memory_score,
                            memory_per_layer=[int(x) for x in a.memory_per_layer.split(",")] if a.memory_per_layer else None)
    converted = hf_rfa.convert(copy.deepcopy(model), cfg).eval()
    ids = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
    rows = []
    for n in a.n:
        x = ids.repeat((n + len(ids) - 1) // len(ids))[:n].unsqueeze(0)
        times = {"original": [], "converted": []}
        time_forward(converted, x[:, :512])  # warm-up (native kernel load, allocator)
        for _ in range(a.reps):
            times["original"].append(time_forward(model, x))
            times["converted"].append(time_forward(converted, x))
        row = {"n": n, **{k: statistics.median(v) for k, v in times.items()}}
        row["speedup"] = row["original"] / row["converted"]
        rows.append(row)
        print(json.dumps({**row, "config": cfg.to_dict(), "threads": a.threads, "reps": a.reps}), flush=True)
    met = rows[-1]["speedup"] >= a.goal
    lines = [
        f"Prefill (one no-grad forward) of `{a.model or 'SmolLM2-135M-Instruct'}`, original (SDPA) vs converted "
        f"({a.feature_map} m={a.num_features} + window {a.window} + {a.sinks} sinks"
        + (f", decay {a.decay:g}" if a.decay else "") + (", un-rotated q/k" if a.feature_input == "unrotated" else "")
        + (f", exact memory {a.memory} ({a.memory_score})" if a.memory else "")
        + (f", per layer {a.memory_per_layer}" if a.memory_per_layer else "")
        + f"); {cpu_name()}, {a.threads} threads, median of {a.reps} interleaved runs. `python benchmarks/prefill.py --n {' '.join(map(str, a.n))} "
        f"--reps {a.reps} --threads {a.threads} --feature-map {a.feature_map} --num-features {a.num_features} --window {a.window} "
        f"--sinks {a.sinks} --decay {a.decay:g} --feature-input {a.feature_input}"
        + (f" --memory {a.memory} --memory-score {a.memory_score}" if a.memory else "")
        + (f" --memory-per-layer {a.memory_per_layer}" if a.memory_per_layer else "") + "`",
        "", "| N | original s | converted s | speed-up |", "|---|---|---|---|",
    ] + [f"| {r['n']} | {r['original']:.1f} | {r['converted']:.1f} | {r['speedup']:.2f}× |" for r in rows]
    lines += ["", f"Goal: ≥ {a.goal}× at N={rows[-1]['n']}: " + ("MET" if met else "NOT met") + f" ({rows[-1]['speedup']:.2f}×)."]
    md = "\n".join(lines) + "\n"
    print(md)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
