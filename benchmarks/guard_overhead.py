"""Overhead of the input guard of ``random_feature_attention``: the same call with
the guard and with it replaced by identity, measured in the same run (one thread, median of 9).

    python benchmarks/guard_overhead.py
"""

from __future__ import annotations

import argparse
import time

import torch

import hf_rfa
import hf_rfa.ops.attention as att

B, H, N, D = 1, 8, 2048, 64


def _median_ms(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9, help="timed calls per case (median reported)")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    padded = torch.ones(B, N, dtype=torch.bool)
    padded[:, :16] = False
    fm = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=64, seed=0)
    real = att.guard_inputs
    with torch.no_grad():
        for name, mask in (("no mask", None), ("all-ones mask", torch.ones(B, N, dtype=torch.bool)), ("16 padded", padded)):
            def call():
                return hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask)

            att.guard_inputs = lambda q, k, v, km, causal: (q, k, v, None)
            base = _median_ms(call, a.repeats)
            att.guard_inputs = real
            guarded = _median_ms(call, a.repeats)
            print(f"{name}: without guard {base:.1f} ms, with guard {guarded:.1f} ms, ratio {guarded / base:.3f}")


if __name__ == "__main__":
    main()
