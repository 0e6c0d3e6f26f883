"""Which LoRA keeps the original's few-shot accuracy? Rotten Tomatoes accuracy and perplexity at 4,096
tokens of each model, against the original: ``collect`` gathers lm-eval folders and perplexity files
into result.jsonl; without it, the README's table is printed from result.jsonl.

    python research/short_task_loss/table.py collect --docs 400 \\
        --model "original=LM_EVAL_DIR,WIKI_JSON,BBC_JSON" --model "LABEL=LM_EVAL_DIR[,WIKI_JSON,BBC_JSON]" ...
    python research/short_task_loss/table.py

The first ``--model`` is the reference (the original). A perplexity file is the ``--output`` of
``hf-rfa-evaluate --task perplexity --context 4096 --max-tokens 32768`` or of ``--grid full`` (its
@4096 entry for the text); ratios are paired over the windows both models read
(:func:`hf_rfa.recipes.intervals.ratio_ci`). Accuracy is over the first ``--docs`` test documents,
the paired difference by :func:`hf_rfa.integrations.scoring.paired_bootstrap_difference`.
"""

import argparse
import json
import os
import sys
from pathlib import Path

from hf_rfa.integrations.scoring import bootstrap_interval, paired_bootstrap_difference
from hf_rfa.recipes.intervals import fmt, ratio_ci

TASK = "rfa_rotten_tomatoes"
TEXTS = {"wiki": "wikipedia:eval", "bbc": "bbc_news:test"}
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
import downstream_table  # noqa: E402 - the sibling script's lm-eval reader and path rewriting


def _perplexity(path: str, text: str) -> dict:
    data = json.loads(Path(os.path.expanduser(path)).read_text())
    return data["texts"][text]["perplexity"]["4096"] if "texts" in data else data


def _correct(folder: str, docs: int) -> list[float]:
    task = downstream_table.read_lm_eval_folder(os.path.expanduser(folder))["tasks"][TASK]
    scored = dict(zip(task["doc_ids"], task["correct"]))
    missing = [d for d in range(docs) if d not in scored]
    if missing:
        raise ValueError(f"{folder} has no result for documents {missing[:5]} of the first {docs}")
    return [scored[d] for d in range(docs)]


def collect(specs: list[str], docs: int) -> list[dict]:
    rows = []
    for spec in specs:
        label, sep, paths = spec.partition("=")
        parts = paths.split(",") if sep else []
        if len(parts) not in (1, 3) or not all(parts) or (not rows and len(parts) != 3):
            raise ValueError(f"--model {spec!r}: expected LABEL=LM_EVAL_DIR,WIKI_JSON,BBC_JSON (LABEL=LM_EVAL_DIR: no perplexity; not for the reference)")
        files = dict(zip(("wiki", "bbc"), parts[1:]))
        rows.append({"model": label, "correct": _correct(parts[0], docs), "ppl": {k: _perplexity(p, TEXTS[k]) for k, p in files.items()},
                     "sources": {k: downstream_table._portable(v, home_as="~") for k, v in {"lm_eval": parts[0], **files}.items()}})
    ref = rows[0]
    for r in rows:
        acc = sum(r["correct"]) / docs
        r["rt"] = {"docs": docs, "acc": acc, "ci95": list(bootstrap_interval(r["correct"]))}
        d, lo, hi = paired_bootstrap_difference(r["correct"], ref["correct"])
        r["rt"]["minus_reference"] = {"diff": d, "ci95": [lo, hi]}
        for k, p in r["ppl"].items():
            q = ref["ppl"][k]
            same = p.get("window_tokens") and p.get("window_tokens") == q.get("window_tokens")
            p["ratio_to_reference"] = {"ratio": p["perplexity"] / q["perplexity"],
                                       "ci95": ratio_ci(p["window_nll"], q["window_nll"], p["window_tokens"]) if same else None}
    return rows  # (each row keeps its documents' correctness, in document order: the paired figures can be recomputed)


def table(rows: list[dict]) -> str:
    ref = rows[0]["model"]
    lines = [f"| model | RT accuracy (first {rows[0]['rt']['docs']} docs) | − {ref} | wiki ppl @4k | × {ref} | BBC ppl @4k | × {ref} |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rt, m = r["rt"], r["rt"]["minus_reference"]
        cells = [fmt(100 * rt["acc"], [100 * x for x in rt["ci95"]], ".1f"), fmt(100 * m["diff"], [100 * x for x in m["ci95"]], "+.1f")]
        for k in ("wiki", "bbc"):
            p = r["ppl"].get(k)
            cells += [fmt(p["perplexity"], p["ci95"]), fmt(p["ratio_to_reference"]["ratio"], p["ratio_to_reference"]["ci95"], ".3f")] if p else ["not measured", ""]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=["collect"], help="collect: write result.jsonl from the runs")
    p.add_argument("--model", action="append", default=[], help="LABEL=LM_EVAL_DIR,WIKI_JSON,BBC_JSON (the first: the reference)")
    p.add_argument("--docs", type=int, default=400, help="collect: the first N Rotten Tomatoes test documents")
    p.add_argument("--out", default=str(HERE / "result.jsonl"))
    a = p.parse_args()
    if a.command == "collect":
        if len(a.model) < 2:
            p.error("collect needs the reference and at least one more --model")
        rows = collect(a.model, a.docs)
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        rows = [json.loads(line) for line in Path(a.out).read_text().splitlines() if line.strip()]
    print(table(rows))


if __name__ == "__main__":
    main()
