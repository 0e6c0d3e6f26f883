"""Matmul FLOPs of one SmolLM2-135M training step, original vs converted: the best speed ratio
the converted model could reach if both ran their matmuls equally fast.

    .venv/bin/python benchmarks/train_flops.py                     # N = 1024 … 16384, the main recipe
    .venv/bin/python benchmarks/train_flops.py --n 1024 4096 --recipe favor256

Counts with ``torch.utils.flop_counter.FlopCounterMode`` (matmul-type ops: mm, bmm, addmm,
baddbmm, and SDPA through torch's formulas; elementwise ops are not counted) over one ``model(ids,
labels=ids).loss.backward()`` at batch 1 — forward, backward and every recomputation the
converted model's recomputing autograd Functions do. PyTorch's CPU flash-attention ops
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward) are counted with the formulas
torch uses for its GPU flash attention, which count all N × N scores; a causal kernel skips about
half, so the original's SDPA FLOPs are reported both as counted and halved (``causal``), and the
ratio uses the halved figure (the original's best case). The models are SmolLM2-135M's
architecture with 1 and 2 decoder layers (random weights: the counts do not depend on values); a
layer's FLOPs are the difference, and the 30-layer step = the 1-layer step + 29 layers. The
``measured`` column is the tokens/s ratio of ``benchmarks/results/train_step_recipe.json`` (fp32,
when present) for comparison: below the FLOP ratio, the converted model's kernels run slower per
FLOP than the original's. Writes ``benchmarks/results/train_flops.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import RECIPE_NAMES, RECIPES, RESULTS  # noqa: E402

log = logging.getLogger("train_flops")


def _sdpa_cpu_formulas() -> dict:
    """FlopCounterMode formulas for PyTorch's CPU flash-attention forward and backward (the GPU
    ones' formulas; GQA key/value heads repeated to the query heads first)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def heads(q, k):
        return (*k[:1], q[1], *k[2:])

    def fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query_shape, heads(query_shape, key_shape), heads(query_shape, value_shape))

    def bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, heads(query_shape, key_shape), heads(query_shape, value_shape))

    return {aten._scaled_dot_product_flash_attention_for_cpu: fwd, aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}


def step_flops(kind: str, n: int, layers: int, recipe: str) -> dict:
    """Matmul FLOPs of one fwd+bwd step of a ``layers``-layer SmolLM2-135M (``kind``: original or
    converted): ``{"total", "sdpa"}`` (sdpa: the CPU flash-attention ops' share, as counted)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_rfa
    from hf_rfa.assets.models import smollm2_path

    cfg = AutoConfig.from_pretrained(smollm2_path())
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if kind == "converted":
        model = hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPES[recipe]))
    model.train()
    ids = torch.randint(10, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    formulas = _sdpa_cpu_formulas()
    counter = FlopCounterMode(display=False, custom_mapping=formulas)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    by_op = counter.get_flop_counts().get("Global", {})
    sdpa = sum(v for op, v in by_op.items() if op in formulas or "scaled_dot_product" in str(op))
    return {"total": counter.get_total_flops(), "sdpa": sdpa}


def model_flops(kind: str, n: int, recipe: str, layers: int = 30) -> dict:
    """FLOPs of the ``layers``-layer step from the 1- and 2-layer counts: ``{"total", "causal",
    "per_layer", "sdpa"}`` (causal: the SDPA share halved; sdpa: the 30 layers' SDPA as counted)."""
    one, two = step_flops(kind, n, 1, recipe), step_flops(kind, n, 2, recipe)
    per_layer = two["total"] - one["total"]
    total = one["total"] + (layers - 1) * per_layer
    sdpa = layers * (two["sdpa"] - one["sdpa"]) if two["sdpa"] else layers * one["sdpa"]
    return {"total": total, "causal": total - sdpa / 2, "per_layer": per_layer, "sdpa": sdpa}


def measured_ratios() -> dict[int, float]:
    """fp32 tokens/s ratios (converted / original) of ``results/train_step_recipe.json``, by N."""
    path = RESULTS / "train_step_recipe.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())
    rows = rows.get("rows", rows) if isinstance(rows, dict) else rows
    got: dict[int, dict] = {}
    for r in rows:
        if isinstance(r, dict) and r.get("dtype") == "fp32" and "tok_s" in r and not r.get("mmap_threshold"):
            got.setdefault(int(r["n"]), {})[r["model"]] = r["tok_s"]
    return {n: d["converted"] / d["original"] for n, d in got.items() if "converted" in d and "original" in d}


def render(rows: list[dict], recipe: str) -> str:
    lines = [
        "# Matmul FLOPs of one training step: original vs converted SmolLM2-135M",
        "",
        f"`python benchmarks/train_flops.py --recipe {recipe}` (FlopCounterMode over one fwd+bwd with labels=ids, batch 1; see the script's docstring). "
        f"Converted = {RECIPE_NAMES[recipe]}. GFLOP per step; *original causal* halves the SDPA FLOPs torch's formula counts (a causal kernel skips half the scores). "
        "*FLOP ratio* = original causal / converted: the tokens/s ratio the converted model would reach if its matmuls ran as fast per FLOP as the original's; "
        "*measured* = the fp32 tokens/s ratio in `results/train_step_recipe.md` (2 threads).",
        "",
        "| N | original GFLOP (as counted) | original causal GFLOP | of which SDPA (causal) | converted GFLOP | converted attention-layer GFLOP per layer | FLOP ratio | measured tok/s ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r.get("measured")
        lines.append(
            f"| {r['n']} | {r['original']['total'] / 1e9:.0f} | {r['original']['causal'] / 1e9:.0f} | {r['original']['sdpa'] / 2e9:.0f} | {r['converted']['total'] / 1e9:.0f} | "
            f"{(r['converted']['per_layer'] - r['original']['per_layer'] + r['original']['sdpa'] / 30) / 1e9:.1f} | {r['ratio']:.2f}× | {f'{m:.2f}×' if m else '—'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="main")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="output stem (default: benchmarks/results/train_flops[_<recipe>])")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    measured = measured_ratios() if a.recipe == "main" else {}
    rows = []
    for n in a.n:
        o, c = model_flops("original", n, a.recipe), model_flops("converted", n, a.recipe)
        row = {"n": n, "original": o, "converted": c, "ratio": o["causal"] / c["total"], "measured": measured.get(n)}
        log.info(json.dumps(row))
        rows.append(row)
    out = a.out or RESULTS / ("train_flops" if a.recipe == "main" else f"train_flops_{a.recipe}")
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"recipe": a.recipe, "rows": rows}, indent=1))
    Path(f"{out}.md").write_text(render(rows, a.recipe))
    print(render(rows, a.recipe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
