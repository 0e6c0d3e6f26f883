"""Where the training time of one causal hybrid layer goes: the pieces of
:class:`hf_rfa.ops.hybrid.function.HybridFunction` (forward and backward together).

    python benchmarks/hybrid_parts.py --n 1024 4096 --threads 1

The main job's layer (SmolLM2-shaped: B=1, 9 query / 3 kv heads, D=64; Hedgehog m=64 + window 64 +
4 sinks + decay half-life 128, the feature part reading q/k with a rotary embedding undone), seeded
random q/k/v; one warm-up, then ``--repeats`` forward + backward calls. Each piece of the Function
(module-level helpers of :mod:`hf_rfa.ops.hybrid.function`) is timed by a wrapper: its
milliseconds per call of the layer, summed over the blocks and over forward and backward (the
forward helpers run again in backward's recomputation). ``autograd.grad`` is the autograd backward
of the recomputed scan and merge. One JSON line per N.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch

#: the helpers the recomputing hybrid (hf_rfa.ops.hybrid.function) calls that are timed (each wraps a
#: part of forward and/or backward)
PARTS = ("band_unit", "band_partial", "feature_unit", "combine", "_scatter_band_grads", "_scatter_feature_grads", "feature_inputs", "block_queries", "grads")


def _instrument(times: dict) -> list:
    """Wrap :data:`PARTS` in ``hf_rfa.ops.hybrid.function`` with timers; returns the originals."""
    from hf_rfa.ops.hybrid import function as hr

    saved = []
    for name in PARTS:
        fn = getattr(hr, name)
        saved.append((name, fn))

        def timed(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times[_name] += time.perf_counter() - t

        setattr(hr, name, timed)
    return saved


def measure(n: int, repeats: int, seed: int = 0) -> dict:
    import hf_rfa
    from hf_rfa.ops.hybrid import function as hr

    fm = hf_rfa.build_feature_map("hedgehog", head_dim=64, num_features=64, seed=seed, hybrid_mix=True)
    fm.enable_decay(128.0)
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(1, 9, n, 64, generator=g)).requires_grad_()
    k = (2 * torch.randn(1, 3, n, 64, generator=g)).requires_grad_()
    v = torch.randn(1, 3, n, 64, generator=g).requires_grad_()
    angles = torch.arange(n, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(32) / 32))[None]
    emb = torch.cat([angles, angles], -1)
    rope = (emb.cos()[None], emb.sin()[None])
    times: dict = collections.defaultdict(float)

    def call() -> float:
        out = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=64, sinks=4, feature_rope=rope)
        t = time.perf_counter()
        out.sum().backward()
        return time.perf_counter() - t

    saved = _instrument(times)
    try:
        call()
        times.clear()
        start, backward = time.perf_counter(), 0.0
        for _ in range(repeats):
            backward += call()
        total = time.perf_counter() - start
    finally:
        for name, fn in saved:
            setattr(hr, name, fn)
    parts = {("autograd.grad" if k_ == "grads" else k_.lstrip("_")): round(v_ / repeats * 1e3, 1) for k_, v_ in sorted(times.items(), key=lambda x: -x[1])}
    return {"n": n, "ms_per_call": round(total / repeats * 1e3, 1), "backward_ms": round(backward / repeats * 1e3, 1), "parts_ms": parts, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    if any(n <= 64 for n in a.n):
        raise ValueError(f"--n must be > 64 (the window), got {a.n}")
    torch.set_num_threads(a.threads)
    for n in a.n:
        print(json.dumps(measure(n, a.repeats)), flush=True)


if __name__ == "__main__":
    main()
