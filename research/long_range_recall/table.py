"""The README's tables from result.jsonl (recall.py's rows), memory_size.jsonl (recall.py's rows of
the memory-size sweep, where present), decay.jsonl (the decay variants, where present),
copy_budget.jsonl with copy_layers.jsonl (memory budgets by the copy layers, where present) and attention_mass.jsonl.

    python research/long_range_recall/table.py
"""

import argparse
import json
from collections import Counter
from pathlib import Path

from hf_rfa.recipes.intervals import fmt

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--dir", default=str(Path(__file__).parent), help="the folder with result.jsonl and attention_mass.jsonl")
here = Path(p.parse_args().dir)
rows = [json.loads(line) for line in open(here / "result.jsonl")]
print("| variant | ppl @4k | × default | copy @512 | copy @3,584 | passkey 1k / 2k / 4k (all tokens) | digits only | minutes |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    ppl = r["ppl@4096"]
    ratio = ppl.get("ratio_to_reference") or ppl["ratio_to_first"]
    pk = r["passkey"]
    lens = sorted(pk["mean"], key=int)
    acc = " / ".join(fmt(pk["mean"][n], pk["mean_ci95"][n], percent=True) for n in lens)
    key = " / ".join(fmt(pk["key_mean"][n], pk["key_mean_ci95"][n], percent=True) for n in lens)
    print(f"| {r['variant']} | {fmt(ppl['perplexity'], ppl['ci95'])} | {fmt(ratio['ratio'], ratio['ci95'], '.3f')} | "
          f"{fmt(r['copy512']['second'], r['copy512']['second_ci95'])} | {fmt(r['copy3584']['second'], r['copy3584']['second_ci95'])} | {acc} | {key} | {r['minutes']} |")
print()
print("First answer token of the passkey trials (what the model put first, how often; p(right) median):")
for r in rows:
    firsts = r["first_token"]
    got = Counter(repr(f["got"]) for f in firsts)
    ps = sorted(f["p_right"] for f in firsts)
    wrong_digits = sum(1 for f in firsts if not f["digits"])
    only_first = sum(1 for f in firsts if f["digits"] and not f["all"])
    print(f"- {r['variant']}: want {repr(firsts[0]['want'])}; got {dict(got.most_common(4))}; median p(right) {ps[len(ps) // 2]:.2f}; "
          f"{only_first} of {len(firsts)} trials fail only at the first token, {wrong_digits} get a digit wrong")
mass = [json.loads(line) for line in open(here / "attention_mass.jsonl")]
total = sum(m["layer_mass"] for m in mass)
print()
print("| layers | share of the out-of-window mass | memory (proportional) |")
print("|---|---|---|")
for lo, hi in ((0, 2), (3, 8), (9, 11), (12, 19), (20, 29)):
    part = [m for m in mass if lo <= m["layer"] <= hi]
    print(f"| {lo}–{hi} | {sum(m['layer_mass'] for m in part) / total:.0%} | {', '.join(str(m['proportional_memory']) for m in part)} |")


def recall_cells(r: dict) -> str:
    """One recall.py row's perplexity, paired ratio, copy and minutes cells (without the first cell)."""
    ppl = r["ppl@4096"]
    ratio = ppl["ratio_to_reference"]
    return (f"{fmt(ppl['perplexity'], ppl['ci95'])} | {fmt(ratio['ratio'], ratio['ci95'], '.3f')} | "
            f"{fmt(r['copy512']['second'], r['copy512']['second_ci95'])} | {fmt(r['copy3584']['second'], r['copy3584']['second_ci95'])} | {r['minutes']} |")


if (here / "memory_size.jsonl").exists():
    sweep = sorted((json.loads(line) for line in open(here / "memory_size.jsonl")), key=lambda r: r["memory"])
    print()
    print("| memory per kv head | exact keys per query (W64 + 4 sinks + memory) | ppl @4k | × memory 256 | copy @512 | copy @3,584 | minutes |")
    print("|---|---|---|---|---|---|---|")
    for r in sweep:
        print(f"| {r['memory']} | {64 + 4 + r['memory']} | {recall_cells(r)}")
if (here / "decay.jsonl").exists():
    print()
    print("| variant (memory 256, `feature_error`) | ppl @4k | × published | copy @512 | copy @3,584 | minutes |")
    print("|---|---|---|---|---|---|")
    for r in map(json.loads, open(here / "decay.jsonl")):
        print(f"| {r['variant']} | {recall_cells(r)}")
def heads(xs: list[float]) -> str:
    """One figure per kv head."""
    return ", ".join(f"{x:.2f}" for x in xs)


if (here / "copy_budget.jsonl").exists():
    layers = [json.loads(line) for line in open(here / "copy_layers.jsonl")]
    print()
    print("| layer | attention on the first copy (@512 / @3,584, kv heads) | on its source key (@512 / @3,584) |")
    print("|---|---|---|")
    for m in layers:
        if m["induction_score"] >= 0.01:
            print(f"| {m['layer']} | {heads(m['copy_mass@512'])} / {heads(m['copy_mass@3584'])} | {heads(m['induction@512'])} / {heads(m['induction@3584'])} |")
    print()
    print("| memory per layer (sum 7,680 per kv head) | sizes | ppl @4k | × uniform 256 | copy @512 | copy @3,584 | minutes |")
    print("|---|---|---|---|---|---|---|")
    for r in map(json.loads, open(here / "copy_budget.jsonl")):
        per = r["memory_per_layer"]
        sizes = "256 each" if per is None else f"{min(per)}–{max(per)}"
        print(f"| {r['variant']} | {sizes} | {recall_cells(r)}")
