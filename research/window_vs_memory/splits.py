"""The table of README.md's last section: splits of the same exact keys between window and memory.

Reads grid results (``hf-rfa-evaluate --grid full ... --output FILE.json``, or a model of a kept
file of ``benchmarks/grid_table.py collect``: ``FILE.json#LABEL``) and prints one row per split:
perplexity at each text and context with its ratio to the reference row (``--reference``),
paired over the windows both read (:func:`hf_rfa.recipes.intervals.paired_ratio_ci`), the copy at
each gap and the passkey's digits at each length::

    python research/window_vs_memory/splits.py \\
        "W64 + memory 1,024=research/long_range_recall/grid_memory1024_w1088.json#recipe, memory 1024" \\
        "W1088 (window only)=research/long_range_recall/grid_memory1024_w1088.json#window-only W1088" \\
        --reference "W1088 (window only)"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_rfa.recipes.intervals import paired_ratio_ci


def load(spec: str) -> tuple[str, dict]:
    """``LABEL=FILE.json`` or ``LABEL=KEPT.json#MODEL``: the label and its grid result."""
    label, eq, where = spec.partition("=")
    if not eq:
        raise ValueError(f"give LABEL=FILE.json or LABEL=KEPT.json#MODEL, got {spec!r}")
    path, _, model = where.partition("#")
    data = json.loads(Path(path).expanduser().read_text())
    if model:
        if model not in data.get("models", {}):
            raise ValueError(f"{path} holds no model {model!r} (it holds {sorted(data.get('models', {}))})")
        data = data["models"][model]["result"]
    if data.get("task") != "grid":
        raise ValueError(f"{where} is not a grid result")
    return label, data


def _cells(result: dict, reference: dict | None) -> list[str]:
    out = []
    for text, r in result["texts"].items():
        for ctx, row in r["perplexity"].items():
            cell = f"{row['perplexity']:.2f}"
            if reference is not None and reference is not result:
                ci = paired_ratio_ci(row, reference["texts"][text]["perplexity"][ctx])
                cell += f" ({row['perplexity'] / reference['texts'][text]['perplexity'][ctx]['perplexity']:.3f}"
                cell += f" [{ci[0]:.3f}, {ci[1]:.3f}])" if ci else ")"
            out.append(cell)
    for text, r in result["texts"].items():
        for gap, row in r["copy"].items():
            lo, hi = row["second_ci95"]
            out.append(f"{row['second']:.2f} [{lo:.2f}, {hi:.2f}]")
    for filler, p in result["passkey"].items():
        out.append(" / ".join(f"{100 * v:.0f}" for v in p["key_mean"].values()) + " %")
    return out


def _header(result: dict) -> list[str]:
    short = {"wikipedia:eval": "Wiki", "bbc_news:test": "BBC"}
    head = [f"ppl {short.get(t, t)} @{int(c) // 1024}k" for t, r in result["texts"].items() for c in r["perplexity"]]
    head += [f"copy {short.get(t, t)} @{g}" for t, r in result["texts"].items() for g in r["copy"]]
    head += [f"passkey digits ({f}) {'/'.join(str(int(n) // 1024) + 'k' for n in p['key_mean'])}" for f, p in result["passkey"].items()]
    return head


def render(rows: list[tuple[str, dict]], reference: str | None) -> str:
    ref = dict(rows).get(reference) if reference else None
    if reference and ref is None:
        raise ValueError(f"--reference {reference!r} is none of the labels {[label for label, _ in rows]}")
    head = ["split", *_header(rows[0][1])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([label, *_cells(result, ref)]) + " |" for label, result in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=FILE.json (a grid result) or LABEL=KEPT.json#MODEL (a model of a kept file)")
    p.add_argument("--reference", default=None, help="the label whose perplexity the others are divided by (paired)")
    a = p.parse_args(argv)
    try:
        print(render([load(s) for s in a.runs], a.reference))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
