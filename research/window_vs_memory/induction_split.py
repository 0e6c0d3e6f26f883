"""At the same number of exact keys per query, a wider window or a larger memory?

The recipe's 324 exact keys per query (window 64 + 4 sinks + a memory of 256 keys per kv head on
average) are moved between the window and the memory: window W + 4 sinks + a memory of 320 − W
keys per kv head on average, split over the layers by the original's induction share
(``memory_split="induction"``, the floor a share of 0.625 of the average, or 0 with
``--floor 0``). ``sizes`` prints the per-layer sizes and the ``hf-rfa-evaluate`` commands of one
window (they read the shares from the model's report.json). ``collect`` gathers their results
(``LABEL@TEXT=FILE.json``, perplexity or copy) into the kept file; without a subcommand the table is
printed from the kept file, each perplexity paired over the same windows with the rows of a
``hf-rfa-evaluate --grid`` file collected by ``benchmarks/grid_table.py`` (the window-only W320
and the original)::

    python research/window_vs_memory/induction_split.py sizes --model out/smollm2-135m-rfa --window 192
    python research/window_vs_memory/induction_split.py collect "W192 + memory 128@wikipedia:eval=RUN.json" ... [--add]
    python research/window_vs_memory/induction_split.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_rfa.recipes.conversion.memory_split import layer_sizes
from hf_rfa.recipes.intervals import fmt, paired_ratio_ci

HERE = Path(__file__).resolve().parent
KEPT = HERE / "induction_split.json"
GRID = HERE.parents[1] / "benchmarks" / "results" / "grid_smollm2_v0.2.0.json"
EXACT = 320  # window + memory per kv head on average (the 4 sinks come on top: 324 exact keys per query)


def sizes(model: Path, window: int, floor: float, exact: int = EXACT) -> list[int]:
    """The per-layer memory sizes of window ``window`` at ``exact`` exact keys (window + memory per
    kv head on average), from the induction shares the conversion measured (``report.json``'s
    ``memory_split``)."""
    if not 0 <= window <= exact:
        raise ValueError(f"--window must be in [0, --exact={exact}], got {window}")
    if not (model / "report.json").is_file():
        raise ValueError(f"--model {model} has no report.json: give the folder of a conversion (make main's out/smollm2-135m-rfa)")
    report = json.loads((model / "report.json").read_text())
    if "memory_split" not in report:
        raise ValueError(f"{model}/report.json has no memory_split: convert with --memory-split induction")
    return layer_sizes(report["memory_split"]["induction"], exact - window, floor)


def collect(specs: list[str], out: Path, add: bool = False) -> dict:
    """``LABEL@TEXT=FILE.json`` results of ``hf-rfa-evaluate`` on TEXT into ``{label: {kind:
    result}}``, kind ``perplexity@TEXT@CONTEXT`` or ``copy@TEXT@GAP``."""
    rows: dict = json.loads(out.read_text()) if add and out.exists() else {}
    for spec in specs:
        key, eq, path = spec.partition("=")
        label, at, text = key.rpartition("@")
        if not eq or not at:
            raise ValueError(f"give LABEL@TEXT=FILE.json, got {spec!r}")
        r = json.loads(Path(path).expanduser().read_text())
        if r.get("task") == "perplexity":
            kind = f"perplexity@{text}@{r['context']}"
        elif r.get("task") == "copy":
            kind = f"copy@{text}@{r['gap']}"
        else:
            raise ValueError(f"{path} is neither a perplexity nor a copy result (task {r.get('task')!r})")
        rows.setdefault(label, {})[kind] = r
    out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def render(rows: dict, grid: dict) -> str:
    """Per text with rows: one line per label, perplexity at 4k and 8k with its ratios to the
    grid's window-only W320 and original (paired over the windows), and the copy at gap 512."""
    ref = grid["models"]
    kept = ref["recipe"]["result"]["texts"]
    published = {f"perplexity@{t}@{c}": kept[t]["perplexity"][c] for t in kept for c in ("4096", "8192")}
    published.update({f"copy@{t}@512": kept[t]["copy"]["512"] for t in kept})
    measured = {k.split("@")[1] for r in rows.values() for k in r}
    rows = {"W64 + memory 256 (the grid's recipe row)": published, **rows}
    lines = []
    for text in [t for t in kept if t in measured]:
        lines += [*([""] if lines else []), f"{text}:", "", "| exact keys per query | ppl @4k | × W320 | × original | ppl @8k | × W320 | × original | copy @512 |", "|" + "---|" * 8]
        for label, r in rows.items():
            if not any(k.split("@")[1] == text for k in r):
                continue
            cells = []
            for ctx in ("4096", "8192"):
                row = r.get(f"perplexity@{text}@{ctx}")
                if row is None:
                    cells += ["", "", ""]
                    continue
                cells.append(fmt(row["perplexity"], row["ci95"]))
                for name in ("window-only W320", "original"):
                    other = ref[name]["result"]["texts"][text]["perplexity"][ctx]
                    cells.append(fmt(row["perplexity"] / other["perplexity"], paired_ratio_ci(row, other), ".3f"))
            cp = r.get(f"copy@{text}@512")
            cells.append(fmt(cp["second"], cp["second_ci95"]) if cp else "")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="'sizes', or 'collect' then LABEL@TEXT=FILE.json results")
    p.add_argument("--model", default="out/smollm2-135m-rfa", help="sizes: the converted model (its report.json)")
    p.add_argument("--window", type=int, default=192, help="sizes: the window W (memory EXACT - W on average)")
    p.add_argument("--exact", type=int, default=EXACT, help="sizes: window + memory per kv head on average (320: the recipe's; fewer: the recipe's decode-state bytes with its feature state counted as keys)")
    p.add_argument("--floor", type=float, default=0.625, help="sizes: keys every layer keeps, a share of the average")
    p.add_argument("--out", default=str(KEPT), help="collect: the kept file to write")
    p.add_argument("--add", action="store_true", help="collect: keep the rows the kept file holds and add these")
    p.add_argument("--grid", default=str(GRID), help="the grid file whose window-only W320 and original rows the ratios pair with")
    a = p.parse_args(argv)
    try:
        if a.runs[:1] == ["sizes"]:
            s = ",".join(map(str, sizes(Path(a.model), a.window, a.floor, a.exact)))
            rfa = f"--rfa window={a.window} memory_per_layer={s}" if a.window < a.exact else f"--rfa window={a.window} memory=0 memory_per_layer=none"
            for task in ("--context 4096 --max-tokens 32768", "--context 8192 --max-tokens 32768", "--task copy --gap 512 --draws 8"):
                print(f"hf-rfa-evaluate --model {a.model} --text wikipedia:eval {task} {rfa} --no-progress --output RUN.json")
            return
        rows = collect(a.runs[1:], Path(a.out), a.add) if a.runs[:1] == ["collect"] else json.loads(KEPT.read_text())
        print(render(rows, json.loads(Path(a.grid).read_text())))
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
