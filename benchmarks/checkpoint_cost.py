"""Time cost of ``checkpoint_blocks=True`` (recompute each causal block in backward).

    .venv/bin/python benchmarks/checkpoint_cost.py --n 4096 16384

hf_rfa's causal favor+ m=256 forward+backward, B=1, H=12, d=64, fp32, with and without
checkpointed blocks, *interleaved* in one process (so both see the same machine load); prints the
median forward and backward times and the ratio. Memory is measured by ``speed.py
--checkpoint-blocks`` (fresh subprocesses).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import hf_rfa


def run(q, k, v, fm, go, ckpt: bool) -> tuple[float, float]:
    for x in (q, k, v):
        x.grad = None
    t0 = time.perf_counter()
    out = hf_rfa.random_feature_attention(q, k, v, fm, checkpoint_blocks=ckpt)
    t1 = time.perf_counter()
    out.backward(go)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fm = hf_rfa.build_feature_map("favor+", head_dim=64, num_features=256)
    print("| N | fwd+bwd ms | with checkpoint_blocks ms | ratio |\n|---|---|---|---|")
    for n in args.n:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 12, n, 64, generator=g).requires_grad_() for _ in range(3))
        go = torch.randn(1, 12, n, 64, generator=g)
        times: dict[bool, list[float]] = {False: [], True: []}
        for ck in (False, True):
            run(q, k, v, fm, go, ck)  # warm-up
        for _ in range(args.reps):
            for ck in (False, True):
                times[ck].append(sum(run(q, k, v, fm, go, ck)))
        a, b = (statistics.median(times[ck]) * 1e3 for ck in (False, True))
        print(f"| {n} | {a:.0f} | {b:.0f} | {b / a:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
