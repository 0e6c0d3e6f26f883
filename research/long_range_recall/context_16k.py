"""(i) of README.md: perplexity past the model's positions, with and without the exact memory.

``collect`` gathers ``hf-rfa-evaluate --task perplexity --output FILE.json`` results
(``LABEL=FILE.json``) into the kept file; without it, the table is printed from the kept file:
perplexity per text and context, and each row's ratio to the reference row (``--reference``),
paired over the windows both read::

    python research/long_range_recall/context_16k.py collect "original@wikipedia:eval=RUN.json" ... --out context_16k.json [--add]
    python research/long_range_recall/context_16k.py --reference "recipe, memory 0"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_rfa.recipes.intervals import paired_ratio_ci

KEPT = Path(__file__).resolve().parent / "context_16k.json"


def collect(specs: list[str], out: Path, add: bool = False) -> dict:
    """``LABEL@TEXT=FILE.json`` perplexity results into ``{label: {text@context: result}}``; with
    ``add``, into the rows ``out`` already holds."""
    rows: dict = json.loads(out.read_text()) if add and out.exists() else {}
    for spec in specs:
        key, eq, path = spec.partition("=")
        label, at, text = key.partition("@")
        if not eq or not at:
            raise ValueError(f"give LABEL@TEXT=FILE.json, got {spec!r}")
        r = json.loads(Path(path).expanduser().read_text())
        if r.get("task") != "perplexity":
            raise ValueError(f"{path} is not a perplexity result")
        rows.setdefault(label, {})[f"{text}@{r['context']}"] = r
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def render(rows: dict, reference: str | None) -> str:
    if reference is not None and reference not in rows:
        raise ValueError(f"--reference {reference!r} is none of the labels {sorted(rows)}")
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (c.split("@")[0] != "wikipedia:eval", int(c.split("@")[1])))
    lines = ["| model | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for label, r in rows.items():
        cells = []
        for c in cols:
            row = r.get(c)
            if row is None:
                cells.append("")
                continue
            lo, hi = row["ci95"]
            cell = f"{row['perplexity']:.2f} [{lo:.2f}, {hi:.2f}]"
            ref = rows[reference].get(c) if reference and label != reference else None
            if ref is not None:
                ci = paired_ratio_ci(row, ref)
                cell += f", ×{row['perplexity'] / ref['perplexity']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="'collect' then LABEL@TEXT=FILE.json perplexity results")
    p.add_argument("--out", default=str(KEPT), help="collect: the kept file to write")
    p.add_argument("--add", action="store_true", help="collect: keep the rows the kept file holds and add these")
    p.add_argument("--reference", default=None, help="the label the ratios are to (paired over the windows)")
    a = p.parse_args(argv)
    try:
        rows = collect(a.runs[1:], Path(a.out), a.add) if a.runs and a.runs[0] == "collect" else json.loads(KEPT.read_text())
        print(render(rows, a.reference))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
