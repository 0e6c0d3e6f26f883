"""Recall at every distance on the published model, without retraining: which exact memory — the
uniform 256 keys per kv head ranked by feature error (the published default), per-layer budgets in
proportion to the original's attention beyond the window (same total), selection by the query
side (``memory_score="query_mass"``), or both — recalls best, and at what perplexity?

Each variant switches the memory of the one loaded model (``hf_rfa.set_memory``) and is evaluated
in the same run on held-out Wikipedia: the copy task at gaps 512 and 3,584 (``--draws`` draws),
passkey at 1k / 2k / 4k with a natural filler (``--trials`` trials × 3 depths; every answer token,
and the digits alone), perplexity at 4,096 (``--ppl-windows`` windows), each with its 95 %
bootstrap interval; perplexity also as a paired ratio to the first variant (or ``--reference``). For the passkey's
first answer token it records, per trial, the token the model put first and the probability it
gave the right one (why does the first token fail?). One JSON line per variant; ``--label`` names
the row of one variant of another model (e.g. one trained with the memory on).

    NT=2 python research/long_range_recall/recall.py --model out/smollm2-135m-rfa \\
        --per-layer research/long_range_recall/attention_mass.jsonl
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

import hf_rfa
from hf_rfa.recipes import evaluation, intervals, long_range
from hf_rfa.recipes.conversion.loading import load_model

VARIANTS = {  # name: (memory_score, per-layer sizes?)
    "default": ("feature_error", False),
    "per_layer": ("feature_error", True),
    "query_mass": ("query_mass", False),
    "query_mass+per_layer": ("query_mass", True),
    "value_norm": ("value_norm", False),
}

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", required=True, help="the converted model's folder (a make main output)")
p.add_argument("--per-layer", default=str(Path(__file__).with_name("attention_mass.jsonl")), help="attention_mass.py's output: its proportional_memory column")
p.add_argument("--per-layer-key", default="proportional_memory", help="the column of --per-layer that holds the sizes (copy_layers.py writes several)")
p.add_argument("--variants", default="default,per_layer,query_mass,query_mass+per_layer")
p.add_argument("--memory", type=int, default=256)
p.add_argument("--draws", type=int, default=4)
p.add_argument("--gaps", default="512,3584", help="copy gaps ('': no copy)")
p.add_argument("--trials", type=int, default=3)
p.add_argument("--lengths", default="1024,2048,4096", help="passkey lengths ('': no passkey)")
p.add_argument("--ppl-context", type=int, default=4096)
p.add_argument("--ppl-windows", type=int, default=2)
p.add_argument("--out", default=str(Path(__file__).with_name("result.jsonl")))
p.add_argument("--reference", default=None, help="a variant already in --out whose perplexity windows the ratios pair with (default: this run's first variant)")
p.add_argument("--label", default=None, help="the row's name in --out instead of the variant's (one variant only), e.g. for another model's row")
a = p.parse_args()
if a.label and "," in a.variants:
    p.error("--label names one row: give one variant")
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

_rows = [json.loads(line) for line in open(a.per_layer)]
if any(a.per_layer_key not in r for r in _rows):
    p.error(f"--per-layer-key {a.per_layer_key!r} is not a column of every line of {a.per_layer}; its columns: {sorted(_rows[0]) if _rows else []}")
per_layer = [r[a.per_layer_key] for r in _rows]

model, tok, _ = load_model(a.model)
model.eval()
ids = evaluation.tokenize(tok, evaluation.load_text("wikipedia:eval"))
filler = long_range.natural_filler(tok, evaluation.load_text("wikipedia:eval"), "wikipedia:eval")

FIRST: list[dict] = []  # the first answer token of every passkey trial of the current variant
_hits = long_range._passkey_hits


def _hits_and_first_token(m, x, la, lead=0):
    """long_range._passkey_hits, also recording the first answer position's argmax and p(right)."""
    w = x.shape[1]
    with torch.no_grad():
        logits = m(input_ids=x, use_cache=False).logits[:, w - la - 1 : w - 1].float()
    prob = logits.softmax(-1)
    ok = logits.argmax(-1).cpu() == x[:, w - la :].cpu()
    for r in range(x.shape[0]):
        want, got = int(x[r, w - la]), int(logits[r, 0].argmax())
        FIRST.append({"length": w - la, "want": tok.decode([want]), "got": tok.decode([got]), "p_right": round(float(prob[r, 0, want]), 4),
                      "p_digit1": round(float(prob[r, lead, int(x[r, w - la + lead])]), 4) if lead else None, "all": bool(ok[r].all()), "digits": bool(ok[r, lead:].all())})
    return torch.stack([ok.all(-1), ok[:, lead:].all(-1)], dim=1)


long_range._passkey_hits = _hits_and_first_token
ref_ppl = None
if a.reference:  # the same windows of an earlier run of this script (the ratio is paired window by window)
    ref_ppl = next(r[f"ppl@{a.ppl_context}"] for r in map(json.loads, open(a.out)) if r["variant"] == a.reference)
for name in a.variants.split(","):
    score, by_layer = VARIANTS[name]
    hf_rfa.set_memory(model, a.memory, 64, score, per_layer if by_layer else None)
    t0 = time.time()
    FIRST.clear()
    row = {"variant": a.label or name, "model": Path(a.model).name, "memory_score": score, "memory": a.memory, "memory_per_layer": per_layer if by_layer else None}
    with torch.no_grad():
        ppl = evaluation.perplexity(model, ids, a.ppl_context, a.ppl_context * a.ppl_windows, progress=False)
        row[f"ppl@{a.ppl_context}"] = {k: ppl[k] for k in ("perplexity", "ci95", "window_nll", "window_tokens")}
        ref_ppl = ref_ppl or ppl
        row[f"ppl@{a.ppl_context}"]["ratio_to_reference"] = {"ratio": ppl["perplexity"] / ref_ppl["perplexity"], "ci95": intervals.paired_ratio_ci(ppl, ref_ppl)}
        for gap in (int(g) for g in a.gaps.split(",") if g.strip()):
            r = long_range.copy_task(model, ids, gap=gap, draws=a.draws, seed=0, progress=False)
            row[f"copy{gap}"] = {k: r[k] for k in ("second", "second_ci95", "first", "per_draw")}
        if a.lengths:
            pk = long_range.passkey_task(model, tok, lengths=tuple(int(x) for x in a.lengths.split(",")), depths=(0.1, 0.5, 0.9),
                                         trials=a.trials, seed=0, progress=False, filler=filler)
            row["passkey"] = {k: pk[k] for k in ("mean", "mean_ci95", "key_mean", "key_mean_ci95", "hits", "key_hits", "filler")}
    row["first_token"] = list(FIRST)
    row["minutes"] = round((time.time() - t0) / 60, 2)
    print(json.dumps({k: v for k, v in row.items() if k != "first_token"}), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
