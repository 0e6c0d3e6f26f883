"""One SmolLM2 attention layer in training: the converted recipe's op vs its exact band alone vs SDPA.

    .venv/bin/python benchmarks/layer_train_cost.py --n 1024 4096 --threads 2 [--dtype bf16]

Seeded random q ``[1, 9, N, 64]``, k/v ``[1, 3, N, 64]`` in ``--dtype`` (bf16: what the attention
receives under ``torch.autocast``), the model's rotary embedding; forward, then backward of
``out.float().sum()``. Cases, interleaved round by round (this machine's speed drifts): the main
job's recipe (``train_step.RECIPES["main"]``: Hedgehog m=64 + window 64 + 4 sinks + decay on
un-rotated q/k), its exact band alone (``feature_map="none"``, same window and sinks) and
``scaled_dot_product_attention(is_causal=True, enable_gqa=True)``; with ``--pytorch-band`` also the
recipe with its forward's exact band in PyTorch (``hf_rfa.set_native(False)`` around the call: the
form before the forward's band became the C++ kernel's). Prints one JSON line per N with
the fastest forward and backward milliseconds of each case and the ratios to SDPA's fwd+bwd.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import RECIPES  # noqa: E402


def _time(fn, rounds: int) -> tuple[float, float]:
    """Fastest forward and backward milliseconds of ``fn`` over ``rounds`` calls."""
    fwd, bwd = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        out.float().sum().backward()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return min(fwd) * 1e3, min(bwd) * 1e3


def _without_native(fn):
    """``fn()`` with the C++ kernels off (restored after)."""
    from hf_rfa.ops.backends import native

    old = native.native_enabled()
    native.set_native(False)
    try:
        return fn()
    finally:
        native.set_native(old)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds (the fastest counts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pytorch-band", action="store_true", help="add the recipe with the C++ band kernel off (PyTorch band in forward)")
    args = ap.parse_args(argv)
    window = RECIPES["main"]["window"]
    if min(args.n) <= window:
        raise ValueError(f"--n must be > the recipe's window {window} (the feature part answers keys beyond it), got {args.n}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    import hf_rfa
    from hf_rfa.assets.models import smollm2_path

    base = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    cfg = base.config
    layers = {
        "recipe": hf_rfa.convert(copy.deepcopy(base), hf_rfa.RFAConfig(**RECIPES["main"])).train().model.layers[0].self_attn.rfa,
        "band only": hf_rfa.convert(copy.deepcopy(base), hf_rfa.RFAConfig(feature_map="none", window=window, sinks=RECIPES["main"]["sinks"])).train().model.layers[0].self_attn.rfa,
    }
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // h
    for n in args.n:
        g = torch.Generator().manual_seed(args.seed)
        q = torch.randn(1, h, n, d, generator=g).to(dt).requires_grad_()
        k = torch.randn(1, hkv, n, d, generator=g).to(dt).requires_grad_()
        v = torch.randn(1, hkv, n, d, generator=g).to(dt).requires_grad_()
        rope = base.model.rotary_emb(q.float().transpose(1, 2)[:, :, 0], torch.arange(n)[None])
        scale = d**-0.5
        cases = {name: (lambda m=m: m(q, k, v, None, True, scale, rfa_rope=rope)) for name, m in layers.items()}
        if args.pytorch_band:
            cases["recipe, PyTorch band"] = lambda m=layers["recipe"]: _without_native(lambda: m(q, k, v, None, True, scale, rfa_rope=rope))
        cases["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        best: dict[str, list[float]] = {name: [float("inf"), float("inf")] for name in cases}
        for name, fn in cases.items():  # warm-up
            _time(fn, 1)
        for _ in range(args.rounds):
            for name, fn in cases.items():
                f, b = _time(fn, 1)
                best[name] = [min(best[name][0], f), min(best[name][1], b)]
        sdpa = sum(best["sdpa"])
        row = {"n": n, "dtype": args.dtype, "threads": args.threads,
               "ms": {name: {"fwd": round(f, 1), "bwd": round(b, 1)} for name, (f, b) in best.items()},
               "fwd_bwd_vs_sdpa": {name: round(sum(fb) / sdpa, 2) for name, fb in best.items()}}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
