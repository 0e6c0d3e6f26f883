"""The main job (``make main``): convert SmolLM2-135M on a fresh machine without the Hub.

1. prepares the offline assets (:mod:`hf_rfa.assets`): SmolLM2-135M-Instruct from its GGUF,
   the Wikipedia articles split into disjoint calibration / train / eval files;
2. converts SmolLM2 with the **recall preset** (``--preset recall``, :mod:`hf_rfa.presets`) to a hybrid — exact window of 64 + 4 exact sink tokens + a learned Hedgehog map
   (m=64, 128 features) for every other key, reading q/k before the rotary embedding
   (``feature_input="unrotated"``), with a learned decay of the feature state (half-life 128 at
   start) — trains the map by attention transfer on 131,072 train tokens at context 1024 (four
   optimiser steps per sequence: its last 256 queries, then the 256 before them, and so on down to
   its first 256, all from one teacher forward; ``--transfer-query-blocks 4``), then LoRA-tunes the model on 65,536 tokens at context
   4096 and learning rate 3e-4 (token budgets: the 30-min limits are only safety limits that fail the run). It keeps
   glibc's own heap (``--malloc-mmap-threshold 0``) and every layer's activations for LoRA's backward
   (no ``--activation-checkpointing``): the LoRA stage peaks at about 5.6 GiB instead of 1.9 with
   both, for 0.63× its time (``benchmarks/lora_stage_memory.py``; the whole run peaks at 6.1 GiB);
3. does the same for the **window-only baseline** (``--window-only-baseline``; ``feature_map="none"``: the
   same window and sinks, every other key dropped, its own LoRA with the same budget), the strongest
   trivial baseline;
4. switches on an **exact memory** of 256 keys per kv head on average after training (``--memory-after-training
   256``, :func:`hf_rfa.set_memory`; it has no parameters), split over the layers as 160 keys each
   and the rest by the original's induction share on calibration copy sequences (``--memory-split
   induction``, measured before conversion; 996 keys in layer 18). In the recipe the features choose it —
   the keys whose value the feature state recalls worst (``--memory-score feature_error``) — in the
   window-only baseline (no features) the keys with the largest ‖v‖; both are evaluated again and the
   published model keeps its memory. (The equal-decode-state window-only 128 baseline is left out
   to make room; ``--baseline-windows 128`` brings it back);
5. evaluates every variant (original / window-only untrained, after LoRA, and + memory / hybrid after
   transfer, after transfer + LoRA, and + memory) on the held-out eval articles: perplexity at contexts 1024, 4096 and 8192 (4,096,
   4,096 and 8,192 predicted tokens), the copy task at gaps 512 and 3,584 (2 seeded draws each)
   and, for the original and the trained variants, passkey retrieval at 1,024 tokens (4 trials × 3
   depths), every figure with its 95% bootstrap interval where it averages more than one window,
   draw or trial (the 4,096-token window is the 8,192-token window's first half and is read from its forward). These budgets keep ``make main`` within 30 min on a 2-core CPU; the full
   evaluation of the published model (perplexity on 32k tokens per context up to 16k, copy up to
   gap 7,680 with 8 draws, passkey 1k–8k with natural-text filler too, a second held-out domain) is
   ``hf-rfa-evaluate --model OUTPUT --grid full`` (``docs/conversion.md``);
6. prints the table, a greedy generation sample (decoded with the constant-memory cache) and the
   output folder (Hub-ready export, ``report.json`` with every figure), and writes the run file
   ``conversion/results/runs/smollm2-recall_v<version>.json``: that report with paths under the
   home folder written as ``~/…`` (``python conversion/report.py --docs`` renders it into
   ``docs/results.md``).
``--quick`` is a few-minute run (context 512, window 64, a few LoRA steps, small eval); flags after the
known ones go to ``conversion/convert.py`` (e.g. ``--transfer-tokens 100000``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time


#: the recall preset (hf_rfa.presets: its attention settings and training budgets) and what the main
#: job adds: the window-only baseline, safety limits, its evaluation grid (docstring above)
DEFAULT = [
    "--preset", "recall", "--window-only-baseline", "--transfer-minutes", "30", "--lora-minutes", "30", "--no-evaluate-before-transfer",
    "--eval-contexts", "1024", "4096", "8192", "--eval-tokens", "4096", "--error-tokens", "1024", "--eval-twin-max", "0",
    "--copy-gaps", "512", "3584", "--copy-draws", "2", "--passkey-lengths", "1024", "--passkey-trials", "4",
    "--malloc-mmap-threshold", "0",
]
QUICK = [
    "--preset", "favor+", "--num-features", "128", "--window", "64", "--sinks", "4", "--baselines", "--no-random-hybrid",
    "--context", "512", "--lora-tokens", "1024", "--lora-context", "256", "--lora-minutes", "10",
    "--eval-contexts", "512", "--eval-tokens", "2048", "--error-tokens", "512", "--random-num-features", "128",
    "--copy-gaps", "128", "--copy-draws", "2",
]


def without(flags: list[str], names: set[str]) -> list[str]:
    """``flags`` (e.g. :data:`DEFAULT`) with the flags in ``names`` and their values left out."""
    out, skip = [], False
    for x in flags:
        if x.startswith("--"):
            skip = x in names
        if not skip:
            out.append(x)
    return out


def asset_args(output: str) -> list[str]:
    """The offline model and the Wikipedia splits (prepared on first use) as ``convert.py`` flags,
    writing to ``output`` (replaced if it exists)."""
    from hf_rfa import assets

    files = {s: assets.wikipedia_text_file(s) for s in assets.WIKIPEDIA_SPLITS}
    return [
        "--model", str(assets.smollm2_path()), "--output", output, "--overwrite",
        "--calibration-text", str(files["calibration"]), "--train-text", str(files["train"]), "--eval-text", str(files["eval"]),
    ]


def run_file_name() -> str:
    """Where the run is kept: ``conversion/results/runs/<model>-<preset>_v<version>.json``."""
    import hf_rfa

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "runs", f"smollm2-recall_v{hf_rfa.__version__}.json")


def portable(obj, home: str | None = None):
    """``obj`` (a report) with every string under the home folder written as ``~/…``, so that a
    committed run names no folder of the machine it ran on."""
    home = (home or os.path.expanduser("~")).rstrip("/")
    if isinstance(obj, dict):
        return {k: portable(v, home) for k, v in obj.items()}
    if isinstance(obj, list):
        return [portable(v, home) for v in obj]
    if isinstance(obj, str) and home and (obj == home or obj.startswith(home + "/")):
        return "~" + obj[len(home):]
    return obj


def write_run_file(output: str, path: str, command: str) -> None:
    """Copy ``output/report.json`` to ``path`` (:func:`portable`, with the ``command`` that made it)."""
    with open(os.path.join(output, "report.json"), encoding="utf-8") as f:
        report = portable(json.load(f))
    report["command"] = command
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(report, indent=2) + "\n")


def wrote_report(output: str, since: float) -> bool:
    """Whether ``output/report.json`` was written at or after ``since`` (a ``--dry-run`` writes none,
    and an earlier run's report must not be kept as this one's)."""
    path = os.path.join(output, "report.json")
    return os.path.exists(path) and os.path.getmtime(path) >= since


def run_command(given: list[str]) -> str:
    """The command a run file names: ``make main [ARGS=...]`` under make (``MAKELEVEL`` set), else
    the script with ``given``."""
    if os.environ.get("MAKELEVEL"):
        return "make main" + (f" ARGS={shlex.quote(shlex.join(given))}" if given else "")
    return shlex.join(["python", "conversion/main_job.py", *given])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few-minute run")
    p.add_argument("--output", default=os.path.join("out", "smollm2-135m-rfa"))
    p.add_argument("--run-file", default=None, help="where to keep the run's report (default: conversion/results/runs/smollm2-recall_v<version>.json; none with --quick; '' for none)")
    a, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    start = time.time()
    import convert

    convert.main((QUICK if a.quick else DEFAULT) + asset_args(a.output) + rest)
    if "--dry-run" in rest:  # a plan only: no job ran, no report to keep
        return
    run_file = a.run_file if a.run_file is not None else ("" if a.quick else run_file_name())
    if run_file and not wrote_report(a.output, start):
        logging.getLogger("main_job").info("no run file: this run wrote no report to %s", a.output)
    elif run_file:
        given = argv if argv is not None else sys.argv[1:]
        write_run_file(a.output, run_file, run_command(given))
        logging.getLogger("main_job").info("run file: %s", run_file)
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"main job: {(time.time() - start) / 60:.1f} min wall ({where})")


if __name__ == "__main__":
    from hf_rfa.cli import _command

    raise SystemExit(_command(main, "conversion/main_job.py")())  # a user error: one line, status 2, as hf-rfa-convert
