"""Per-token decode latency and cache bytes vs context length: RFACache vs softmax + DynamicCache.

    python benchmarks/decode.py [--contexts 1024 8192 32768] [--layers 4] [--steps 16]
                                [--out benchmarks/results/decode.md]

A Llama built in code with the shapes of SmolLM2-135M (hidden 576, 9 heads, 3 kv heads, head
dim 64, MLP 1536, vocab 49152) but ``--layers`` layers (SmolLM2 has 30), random weights, fp32,
on this CPU. The softmax baseline (``attn_implementation="sdpa"``) gets its ``DynamicCache`` by
prefilling the context in chunks; the converted copies (favor+, and favor+ with an exact window
and sinks, and with an exact memory of 128 keys) prefill in the chunked linear form into an
``RFACache``; its reported bytes are the whole state, memory included. Then each model decodes
``--steps`` single tokens; the models are timed *alternately* step by step (so load from other
processes hits all of them alike) and the median per-token latency is reported.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import shlex
import statistics
import sys
import time

import torch

import hf_rfa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from downstream_table import cpu_name  # noqa: E402 - the sibling script's (lscpu's model name)

logger = logging.getLogger("benchmarks.decode")

#: the recall preset's attention (hf_rfa.presets)
RECALL = hf_rfa.RFAConfig.from_preset("recall").to_dict()
VARIANTS = {
    "rfa favor+ m=128": dict(feature_map="favor+", num_features=128),
    "rfa favor+ m=128 W=64 S=4": dict(feature_map="favor+", num_features=128, window=64, sinks=4),
    # exact global memory (hf_rfa.ops.memory): its 128 keys/values per kv head (+ the <= 64 keys awaiting
    # the next refresh) are part of the cache bytes reported (RFACache.nbytes)
    "rfa favor+ m=128 W=64 S=4 memory=128": dict(feature_map="favor+", num_features=128, window=64, sinks=4, memory=128, memory_every=64),
    # the recall preset (Hedgehog m=64 -> 128 features on un-rotated q/k, decay; its memory switched on
    # after training) and its equal-state baseline (window-only W128): the cache bytes should match
    # within the shared rotary ring
    "rfa hedgehog m=64 W=64 S=4 decay=128 unrotated": RECALL,
    "window-only W=128 S=4": dict(feature_map="none", window=128, sinks=4),
    # the recall preset with an exact memory of 128 / 256 keys per kv head chosen by the feature
    # state's recall error, and its baseline (window-only W64 + the memory by ||v||)
    "rfa hedgehog m=64 W=64 S=4 decay=128 unrotated memory=128 feature_error": {**RECALL, "memory": 128, "memory_every": 64},
    "window-only W=64 S=4 memory=128": dict(feature_map="none", window=64, sinks=4, memory=128, memory_every=64),
    "rfa hedgehog m=64 W=64 S=4 decay=128 unrotated memory=256 feature_error": {**RECALL, "memory": 256, "memory_every": 64},
    "window-only W=64 S=4 memory=256": dict(feature_map="none", window=64, sinks=4, memory=256, memory_every=64),
    # the same 324 exact keys per query moved from the memory to the window (research/window_vs_memory/
    # induction_split.py), and the equal-state window-only W320 baseline
    "rfa hedgehog m=64 W=192 S=4 decay=128 unrotated memory=128 feature_error": {**RECALL, "window": 192, "memory": 128, "memory_every": 64},
    "rfa hedgehog m=64 W=320 S=4 decay=128 unrotated": {**RECALL, "window": 320},
    # the recall preset with the memory that makes its cache the window-only W320's bytes
    "rfa hedgehog m=64 W=64 S=4 decay=128 unrotated memory=160 feature_error": {**RECALL, "memory": 160, "memory_every": 64},
    "window-only W=320 S=4": dict(feature_map="none", window=320, sinks=4),
}


def build_models(layers: int, variants: list[str] | None = None):
    """The softmax baseline and the converted copies named in ``variants`` (default: all VARIANTS)."""
    unknown = [v for v in (variants or []) if v not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=65536,
        rope_theta=100000.0, tie_word_embeddings=True,
    )
    base = LlamaForCausalLM(cfg).eval()
    base.set_attn_implementation("sdpa")
    models = {"softmax sdpa + DynamicCache": base}
    for name, kw in VARIANTS.items():
        if variants and name not in variants:
            continue
        models[name] = hf_rfa.convert(copy.deepcopy(base), hf_rfa.RFAConfig(**kw)).eval()
    return models


def cache_bytes(cache) -> int:
    if isinstance(cache, hf_rfa.RFACache):
        return cache.nbytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.keys is not None)


#: how state_parts groups a layer state's tensors (the rest is bookkeeping: positions, flags, scores)
PARTS = {
    "exact keys and values": ("win_k", "win_v", "sink_k", "sink_v", "mem_k", "mem_v"),
    "un-rotated key copies": ("win_kf", "mem_kf"),
    "feature state": ("linear.S", "linear.z"),
}


def state_parts(cache) -> dict[str, int]:
    """An RFACache's bytes by part (:data:`PARTS`, ``bookkeeping``, ``rotary ring``), summed over
    its layers; {} for another cache."""
    if not isinstance(cache, hf_rfa.RFACache):
        return {}
    out = dict.fromkeys([*PARTS, "bookkeeping", "rotary ring"], 0)
    part_of = {name: part for part, names in PARTS.items() for name in names}
    for layer in cache.layers:
        for name, t in (layer.state.tensors().items() if layer.state is not None else ()):
            out[part_of.get(name, "bookkeeping")] += t.numel() * t.element_size()
    out["rotary ring"] = cache.nbytes() - sum(out.values())
    return out


@torch.inference_mode()
def prefill(model, ids: torch.Tensor, chunk: int):
    from transformers import DynamicCache

    cache = hf_rfa.RFACache(model) if hf_rfa.hf.cache.uses_rfa(model) else DynamicCache(config=model.config)
    t0 = time.perf_counter()
    for a in range(0, ids.shape[1], chunk):
        out = model(ids[:, a:a + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True), time.perf_counter() - t0


@torch.inference_mode()
def measure(models: dict, context: int, steps: int, chunk: int) -> dict:
    ids = torch.randint(0, 49152, (1, context), generator=torch.Generator().manual_seed(context))
    state = {}
    for name, model in models.items():
        cache, nxt, secs = prefill(model, ids, chunk)
        logger.info("  prefill %-28s %6d tokens: %.1f s", name, context, secs)
        state[name] = [cache, nxt, [], secs]
    for _ in range(steps + 2):  # two warm-up steps, then alternate the models step by step
        for name, model in models.items():
            cache, nxt, times, _ = state[name]
            t0 = time.perf_counter()
            out = model(nxt, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            state[name][1] = out.logits[:, -1].argmax(-1, keepdim=True)
    return {
        name: dict(ms=1e3 * statistics.median(times[2:]), bytes=cache_bytes(cache), prefill_s=secs, parts=state_parts(cache))
        for name, (cache, _, times, secs) in state.items()
    }


def report(results: dict, args) -> str:
    names = list(next(iter(results.values())))
    ctxs = list(results)
    lines = [
        "# Decode latency and cache size vs context (CPU)",
        "",
        f"Llama with SmolLM2-135M shapes (hidden 576, 9 heads, 3 kv heads, head dim 64, MLP 1536, vocab 49152), "
        f"**{args.layers} layers** (SmolLM2 has 30), random weights, fp32, batch 1, {cpu_name()}, torch threads={torch.get_num_threads()}. "
        f"Median of {args.steps} single-token decode steps after prefilling the context in chunks of {args.chunk}; "
        "models timed alternately step by step. Command: `python benchmarks/decode.py"
        + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "") + "`.",
        "",
        "| context | model | ms / token | cache MiB | prefill s |",
        "|---:|---|---:|---:|---:|",
    ]
    for c in ctxs:
        for n in names:
            r = results[c][n]
            lines.append(f"| {c} | {n} | {r['ms']:.1f} | {r['bytes'] / 2**20:.2f} | {r['prefill_s']:.1f} |")
    lo, hi = ctxs[0], ctxs[-1]
    lines += ["", f"Ratios, context {hi} vs {lo} (goal for RFA: latency ≤ 1.3×, bytes 1.0×):", "",
              "| model | latency ratio | cache bytes ratio |", "|---|---:|---:|"]
    for n in names:
        lr = results[hi][n]["ms"] / results[lo][n]["ms"]
        br = results[hi][n]["bytes"] / max(results[lo][n]["bytes"], 1)
        lines.append(f"| {n} | {lr:.2f}× | {br:.2f}× |")
    parts = {n: results[hi][n]["parts"] for n in names if results[hi][n]["parts"]}
    if parts:
        cols = list(next(iter(parts.values())))
        lines += ["", f"Cache KiB by part at context {hi} (all layers; bookkeeping: positions, flags, scores):", "",
                  "| model | " + " | ".join(cols) + " | total |", "|---|" + "---:|" * (len(cols) + 1)]
        for n, pr in parts.items():
            lines.append(f"| {n} | " + " | ".join(f"{pr[c] / 1024:.1f}" for c in cols) + f" | {sum(pr.values()) / 1024:.1f} |")
    base = names[0]
    lines += ["", f"Speed-up of RFA over softmax per context:", "", "| context | " + " | ".join(names[1:]) + " |",
              "|---:|" + "---:|" * (len(names) - 1)]
    for c in ctxs:
        lines.append(f"| {c} | " + " | ".join(f"{results[c][base]['ms'] / results[c][n]['ms']:.2f}×" for n in names[1:]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk length")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings on a shared CPU)")
    p.add_argument("--variants", nargs="+", default=None, help=f"names of VARIANTS to run (default: all): {list(VARIANTS)}")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "decode.md"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    models = build_models(args.layers, args.variants)
    results = {}
    for c in args.contexts:
        logger.info("context %d", c)
        results[c] = measure(models, c, args.steps, args.chunk)
        for n, r in results[c].items():
            logger.info("  %-28s %7.1f ms/token  %8.2f MiB", n, r["ms"], r["bytes"] / 2**20)
    text = report(results, args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
