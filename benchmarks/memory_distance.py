"""Prefill cost of the exact memory's clamped rotary distance (``memory_distance``) on a converted model.

Loads a converted causal LM with an exact memory (default: ``out/smollm2-135m-rfa``, the main job's
output), and times one no-grad forward over N random tokens with each ``--distances`` value in
turn (``hf_rfa.reconfigure``; 0 = true distances, the baseline), interleaved ``--reps`` times so
all see the same machine load. Prints one JSON line per N with the median seconds and each
distance's ratio to the baseline measured in the same run, then a Markdown table::

    python benchmarks/memory_distance.py [--model out/smollm2-135m-rfa] [--n 8192 16384] [--distances 0 8191] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time

import torch

logger = logging.getLogger("benchmarks.memory_distance")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="out/smollm2-135m-rfa", help="converted causal LM folder with an exact memory")
    p.add_argument("--n", type=int, nargs="+", default=[8192, 16384], help="prefill lengths (tokens)")
    p.add_argument("--distances", type=int, nargs="+", default=[0, 8191], help="memory_distance values; the first is the baseline")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if a.reps < 1 or any(n < 1 for n in a.n) or any(d < 0 for d in a.distances):
        p.error(f"--reps and --n must be >= 1 and --distances >= 0, got reps={a.reps}, n={a.n}, distances={a.distances}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import hf_rfa

    torch.set_num_threads(a.threads)
    model = hf_rfa.from_pretrained(a.model).eval()
    cfg = hf_rfa.rfa_config_of(model)
    if cfg is None or not cfg.any_memory:
        p.error(f"--model {a.model} has no exact memory (rfa_config.memory = 0): nothing to clamp")
    rows = []
    for n in a.n:
        ids = torch.randint(100, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        times: dict[int, list[float]] = {d: [] for d in a.distances}
        for _ in range(a.reps):
            for d in a.distances:
                hf_rfa.reconfigure(model, memory_distance=d)
                t0 = time.perf_counter()
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                times[d].append(time.perf_counter() - t0)
        med = {d: statistics.median(v) for d, v in times.items()}
        base = med[a.distances[0]]
        row = {"n": n, "cpu": _cpu(), "threads": a.threads, "reps": a.reps, "median_s": med, "ratio": {d: med[d] / base for d in a.distances}}
        print(json.dumps(row))
        rows.append(row)
    head = "| N | " + " | ".join(f"memory_distance={d}" for d in a.distances) + " |"
    lines = [f"{_cpu()}, {a.threads} threads, median of {a.reps}; ratios to memory_distance={a.distances[0]} in the same run", "", head, "|" + "---|" * (len(a.distances) + 1)]
    for row in rows:
        lines.append(f"| {row['n']} | " + " | ".join(f"{row['median_s'][d]:.2f} s (×{row['ratio'][d]:.3f})" for d in a.distances) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
