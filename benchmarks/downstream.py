"""Downstream table: the original SmolLM2, a converted folder and the window-only baseline on the
offline lm-eval tasks, with percentile bootstrap intervals over documents.

    python benchmarks/downstream.py --converted out/quick-rfa --label "quick conversion" \\
        [--limit 100] [--limit-manyshot 20] [--out benchmarks/results/downstream_smollm2.md]

Each model is scored by lm-evaluation-harness (``--model hf`` for the original, ``--model hf_rfa``
for the others); the window-only baseline is the original converted on load with no features
(``feature_map="none"``) and the converted folder's window, sinks and exact memory, untrained.
The first ``--limit`` documents of each short task and ``--limit-manyshot`` of each many-shot task
are scored (the same documents for every model); intervals: 95% percentile bootstrap of the
accuracy, and of the paired difference converted − window-only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("downstream")

WINDOW_ONLY_FIELDS = ("window", "sinks", "memory", "memory_every", "memory_score", "layers")


def _window_only_args(converted: str) -> dict:
    cfg = json.loads((Path(converted) / "config.json").read_text())["rfa_config"]
    return {"feature_map": "none", **{k: cfg[k] for k in WINDOW_ONLY_FIELDS if cfg.get(k) is not None}}


def _score(lm, task: str, limit: int, tm) -> dict:
    import lm_eval

    res = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, limit=limit, log_samples=True)
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return {"acc": res["results"][task]["acc,none"], "correct": [float(s["acc"]) for s in samples]}


def _models(args):
    from lm_eval.models.huggingface import HFLM

    from hf_rfa import assets
    from hf_rfa.integrations.lm_eval import RFALM

    original = args.original or str(assets.smollm2_path())
    common = dict(dtype="float32", device="cpu", batch_size=1)
    yield "original", lambda: HFLM(pretrained=original, **common)
    yield args.label, lambda: RFALM(pretrained=args.converted, **common)
    wo = _window_only_args(args.converted)
    yield "window-only", lambda: RFALM(pretrained=original, **common, **{f"rfa_{k}": v for k, v in wo.items()})


def _table(scores: dict, args) -> str:
    from hf_rfa.integrations.scoring import bootstrap_interval, paired_bootstrap_difference

    names = list(scores)
    tasks = list(next(iter(scores.values())))
    head = "| task | docs | " + " | ".join(names) + f" | {args.label} − window-only |"
    lines = [head, "|" + "---|" * (len(names) + 3)]
    for t in tasks:
        cells = []
        for n in names:
            c = scores[n][t]["correct"]
            lo, hi = bootstrap_interval(c)
            cells.append(f"{100 * sum(c) / len(c):.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
        d, lo, hi = paired_bootstrap_difference(scores[names[1]][t]["correct"], scores[names[2]][t]["correct"])
        lines.append(f"| `{t}` | {len(scores[names[0]][t]['correct'])} | " + " | ".join(cells) + f" | {100 * d:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--converted", required=True, help="a converted folder (hf_rfa save_pretrained / conversion output)")
    p.add_argument("--label", default="converted", help="its name in the table (e.g. 'quick conversion')")
    p.add_argument("--original", default=None, help="the original model folder (default: the offline SmolLM2-135M-Instruct)")
    p.add_argument("--limit", type=int, default=100, help="documents per short task")
    p.add_argument("--limit-manyshot", type=int, default=20, help="documents per many-shot task")
    p.add_argument("--tasks", default=None, help="comma-separated offline tasks (default: all)")
    p.add_argument("--out", default=None, help="write the markdown table here (and the raw scores next to it as .json)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from hf_rfa.integrations.lm_eval_tasks import TASKS, prepare_tasks

    tasks = a.tasks.split(",") if a.tasks else list(TASKS)
    tm = TaskManager(include_path=str(prepare_tasks(tasks=tasks)), include_defaults=False)
    scores: dict = {}
    for name, make in _models(a):
        start = time.perf_counter()
        lm = make()
        scores[name] = {t: _score(lm, t, a.limit_manyshot if "manyshot" in t else a.limit, tm) for t in tasks}
        logger.info("%s: %s (%.0f s)", name, {t: s["acc"] for t, s in scores[name].items()}, time.perf_counter() - start)
        del lm
        if a.out:  # kept after every model, so an interrupted run leaves what it measured
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).with_suffix(".json").write_text(json.dumps(scores, indent=1))
    table = _table(scores, a)
    print(table)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(table + "\n")
        Path(a.out).with_suffix(".json").write_text(json.dumps(scores, indent=1))


if __name__ == "__main__":
    main()
