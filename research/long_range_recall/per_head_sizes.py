"""Memory budgets per kv head instead of per layer, as per-layer sizes the op can take.

Reads the induction shares per layer and kv head that the conversion measured (``report.json``'s
``memory_split``) and splits ``--memory`` × kv heads × layers keys over the kv heads: ``F`` keys in
every kv head (``--floors``), the rest in proportion to each kv head's share
(``split_budget``). The op keeps one memory size per layer, so each layer's column
``per_head_maxF`` is its largest kv head's size (an upper bound: more keys in all than the per-kv-head
split); ``per_headF`` lists the kv heads' own sizes. ``recall.py --per-layer FILE --per-layer-key
per_head_max160`` reads it.

    python research/long_range_recall/per_head_sizes.py --model out/smollm2-135m-rfa
"""

import argparse
import json
from pathlib import Path

from hf_rfa.recipes.conversion.memory_split import split_budget


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="out/smollm2-135m-rfa", help="a converted model with report.json (memory_split induction)")
    p.add_argument("--memory", type=int, default=256, help="keys per kv head on average")
    p.add_argument("--floors", type=int, nargs="+", default=[96, 128, 160])
    p.add_argument("--out", default=str(Path(__file__).with_name("per_head_sizes.jsonl")))
    a = p.parse_args()
    if not (Path(a.model) / "report.json").is_file():
        p.error(f"--model {a.model} has no report.json: give the folder of a conversion (make main's out/smollm2-135m-rfa)")
    report = json.loads((Path(a.model) / "report.json").read_text())
    if "memory_split" not in report:
        p.error(f"{a.model}/report.json has no memory_split: convert with --memory-split induction")
    shares = report["memory_split"]["induction"]
    heads = len(shares[0])
    rows = [{"layer": i} for i in range(len(shares))]
    for floor in a.floors:
        sizes = split_budget(a.memory * heads * len(shares), [x for layer in shares for x in layer], floor)
        for i, row in enumerate(rows):
            own = sizes[heads * i : heads * (i + 1)]
            row[f"per_head_max{floor}"], row[f"per_head{floor}"] = max(own), own
    Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    totals = {f: sum(r[f"per_head_max{f}"] for r in rows) for f in a.floors}
    print(f"wrote {a.out}; per_head_maxF keys per kv head over the layers: {totals}")


if __name__ == "__main__":
    main()
