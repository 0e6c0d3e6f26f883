"""Speed of one causal *hybrid* attention layer (exact window + sinks + FAVOR+ for the rest) against
SDPA, with the compiled CPU kernels (``hf_rfa.ops.backends.native``) and without (the PyTorch path).

This is the layer of the main job's converted SmolLM2-135M (H=9 query heads, 3 kv heads, d=64,
W=256, S=4, favor+ m=256). One command::

    .venv/bin/python benchmarks/hybrid_layer.py                       # N = 1024 … 16384
    .venv/bin/python benchmarks/hybrid_layer.py --n 4096 --reps 9

The three are run alternately in the same process (native, pytorch, sdpa, native, …), forward
only, no autograd (prefill / evaluation); medians are reported with their ratios. Writes
``hybrid_layer.md`` and ``hybrid_layer.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

import hf_rfa
from hf_rfa.ops.backends import native


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--num-features", type=int, default=256)
    ap.add_argument("--feature-map", default="favor+")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hybrid_layer"))
    args = ap.parse_args(argv)
    for name in ("heads", "kv_heads", "head_dim", "num_features", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads:
        raise ValueError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    have_native = native.usable(torch.device("cpu"), torch.float32)
    fm = hf_rfa.build_feature_map(args.feature_map, head_dim=args.head_dim, num_features=args.num_features)

    def rfa(q, k, v, on: bool):
        native.set_native(on)
        try:
            return hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=args.window, sinks=args.sinks)
        finally:
            native.set_native(True)

    impls = {
        "native": lambda q, k, v: rfa(q, k, v, True),
        "pytorch": lambda q, k, v: rfa(q, k, v, False),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    }
    if not have_native:
        impls.pop("native")
    rows = []
    for n in args.n:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, args.heads, n, args.head_dim, generator=gen)
        k, v = (torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen) for _ in range(2))
        times = {name: [] for name in impls}
        with torch.no_grad():
            for name, fn in impls.items():  # warm-up
                fn(q, k, v)
            for _ in range(args.reps):
                for name, fn in impls.items():
                    t0 = time.perf_counter()
                    fn(q, k, v)
                    times[name].append(time.perf_counter() - t0)
        row = {"n": n, **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}, "times": times}
        rows.append(row)
        sys.stderr.write(f"N={n}: " + ", ".join(f"{name} {row[name + '_ms']:.1f} ms" for name in impls) + "\n")
    cols = list(impls)
    lines = [
        "# One causal hybrid attention layer vs SDPA (forward, no autograd)",
        "",
        f"Command: `python benchmarks/hybrid_layer.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ",
        f"H={args.heads}, Hkv={args.kv_heads}, d={args.head_dim}, window {args.window}, sinks {args.sinks}, "
        f"{args.feature_map} m={args.num_features}, B=1, {threads} threads, fp32; medians of {args.reps} interleaved repetitions.  ",
        f"Native CPU kernels: {'available' if have_native else 'not available here (PyTorch path only)'}; "
        f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}.",
        "",
        "| N | " + " | ".join(f"{c} ms" for c in cols) + " | SDPA / hybrid" + (" (native)" if have_native else "") + " | pytorch / native |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for r in rows:
        best = r["native_ms"] if have_native else r["pytorch_ms"]
        nat = f"{r['pytorch_ms'] / r['native_ms']:.2f}×" if have_native else "—"
        lines.append(f"| {r['n']} | " + " | ".join(f"{r[c + '_ms']:.1f}" for c in cols) + f" | {r['sdpa_ms'] / best:.2f}× | {nat} |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hybrid_layer.md").write_text(text)
    (out / "hybrid_layer.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
