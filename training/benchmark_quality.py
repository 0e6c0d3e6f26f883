#!/usr/bin/env python
"""Quality of converted models after fine-tuning, on this machine's CPU; writes training/RESULTS.md.

1. all-MiniLM-L6-v2 fine-tuned as a Rotten Tomatoes classifier with the same budget, softmax vs
   converted (favor+, hedgehog, hybrid favor+ with an exact local window): test accuracy.
2. SmolLM2-135M converted (hedgehog + window + sinks), perplexity on held-out Wikipedia text
   before and after a short LoRA run (LoRA on q/k/v/o, feature maps trained too).

Every run is the Accelerate recipe (``training/train_accelerate.py``) in a subprocess; the exact
commands are written into RESULTS.md. Assets come from ``hf_rfa.assets`` (offline, PyPI only).

    python training/benchmark_quality.py                  # both parts (~15 min on 2 cores)
    python training/benchmark_quality.py --skip_lm true   # classification only
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_rfa import assets

logger = logging.getLogger("benchmark_quality")
HERE = os.path.dirname(os.path.abspath(__file__))

CLS_VARIANTS = {
    "softmax": ["--feature_map", "softmax"],
    "favor+ (m=64)": ["--preset", "favor+", "--num_features", "64"],
    "hedgehog (m=32)": ["--preset", "favor+", "--feature_map", "hedgehog", "--num_features", "32"],
    "hybrid favor+ (m=64) + window 8": ["--preset", "favor+", "--num_features", "64", "--window", "8"],
}


@dataclass
class BenchArguments:
    output_dir: str = field(default=os.path.join("out", "hf_rfa_bench"), metadata={"help": "scratch folder for the runs"})
    results_file: str = field(default=os.path.join(HERE, "RESULTS.md"), metadata={"help": "markdown file to write"})
    skip_cls: bool = field(default=False, metadata={"help": "skip the classification part"})
    skip_lm: bool = field(default=False, metadata={"help": "skip the SmolLM2 part"})
    jobs: int = field(default=2, metadata={"help": "runs in parallel"})
    reuse: bool = field(default=False, metadata={"help": "reuse a run folder's results.json when its command.txt holds the same command"})
    threads: int = field(default=0, metadata={"help": "OMP/torch threads per run (0: library default); use 1 when jobs > 1"})
    cls_train_samples: int = field(default=640, metadata={"help": "Rotten Tomatoes training snippets"})
    cls_epochs: int = field(default=1, metadata={"help": "epochs over them"})
    cls_batch: int = field(default=16, metadata={"help": "batch size"})
    cls_lr: float = field(default=1e-4, metadata={"help": "learning rate"})
    cls_max_len: int = field(default=48, metadata={"help": "tokens per snippet (truncation)"})
    cls_eval_samples: int = field(default=600, metadata={"help": "test snippets evaluated (the first N)"})
    cls_converted: str | None = field(
        default=None, metadata={"help": "also fine-tune this converted MiniLM checkpoint (e.g. a conversion/convert.py output) with the same budget"}
    )
    lm_block: int = field(default=128, metadata={"help": "tokens per LM block"})
    lm_window: int = field(default=256, metadata={"help": "exact window of the converted SmolLM2"})
    lm_steps: int = field(default=12, metadata={"help": "LoRA optimizer steps"})
    lm_batch: int = field(default=2, metadata={"help": "LM batch size"})
    lm_lr: float = field(default=5e-4, metadata={"help": "LoRA learning rate"})
    lm_eval_blocks: int = field(default=12, metadata={"help": "held-out blocks for perplexity"})


def run_all(jobs: list[tuple[list[str], str]], a: BenchArguments) -> list[dict]:
    """Run recipe commands, ``a.jobs`` at a time; results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        return list(pool.map(lambda job: run(*job, reuse=a.reuse, threads=a.threads), jobs))


def run(cmd: list[str], out: str, reuse: bool = False, threads: int = 0) -> dict:
    """Run one recipe command; returns its results.json. The command is recorded in
    ``out/command.txt``; with ``--reuse`` a finished run of the identical command is not repeated."""
    text = shlex.join(cmd)
    done = os.path.join(out, "results.json")
    record = os.path.join(out, "command.txt")
    if reuse and os.path.isfile(done) and os.path.isfile(record):
        with open(record) as f:
            if f.read().strip() == text:
                logger.info("reusing %s (same command)", done)
                with open(done) as g:
                    return json.load(g)
    logger.info("running: %s", text)
    start = time.perf_counter()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"command failed ({proc.returncode}): {text}\n{proc.stderr[-4000:]}")
    with open(done) as f:
        res = json.load(f)
    res["wall_seconds"] = time.perf_counter() - start
    with open(record, "w") as f:
        f.write(text + "\n")
    return res


def _display(cmd: list[str]) -> str:
    text = shlex.join(["python" if c == sys.executable else c for c in cmd])
    text = text.replace(str(assets.cache_dir()), "$HF_RFA_CACHE").replace(HERE + "/", "training/")
    try:  # the MiniLM folder inside its installed package: named by a variable, not by this machine's path
        return text.replace(str(assets.minilm_path()), "$HF_RFA_MINILM")
    except (ImportError, FileNotFoundError):
        return text


def classification(a: BenchArguments) -> tuple[str, list[str]]:
    from transformers import AutoTokenizer

    train_csv, test_csv = str(assets.rotten_tomatoes_csv("train")), str(assets.rotten_tomatoes_csv("test"))
    model = str(assets.minilm_path())
    tok = AutoTokenizer.from_pretrained(model)
    texts = [ex["text"] for ex in assets.rotten_tomatoes()["test"]]
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    mean_len = sum(lengths) / len(lengths)
    jobs, names = [], []
    variants = {name: (model, extra) for name, extra in CLS_VARIANTS.items()}
    if a.cls_converted:
        from hf_rfa.config import CONFIG_ATTR
        from transformers import AutoConfig

        rc = getattr(AutoConfig.from_pretrained(a.cls_converted), CONFIG_ATTR, None)
        if not rc:
            raise ValueError(f"cls_converted={a.cls_converted!r} is not a converted (hf_rfa) checkpoint")
        label = f"converted checkpoint ({rc['feature_map']} m={rc['num_features']}, window {rc['window']}, sinks {rc['sinks']})"
        variants[label] = (a.cls_converted, [])
    for name, (model_path, extra) in variants.items():
        out = os.path.join(a.output_dir, "cls-" + "".join(c if c.isalnum() else "_" for c in name))
        cmd = [
            sys.executable, os.path.join(HERE, "train_accelerate.py"), "--model_name_or_path", model_path, "--task", "classification",
            "--train_file", train_csv, "--validation_file", test_csv, "--max_train_samples", str(a.cls_train_samples),
            "--max_seq_length", str(a.cls_max_len), "--per_device_train_batch_size", str(a.cls_batch), "--per_device_eval_batch_size", "64",
            "--num_train_epochs", str(a.cls_epochs), "--learning_rate", str(a.cls_lr), "--warmup_steps", "10", "--seed", "0",
            "--max_eval_samples", str(a.cls_eval_samples),
            "--output_dir", out, "--save_final_model", "false", "--disable_tqdm", "true", "--logging_steps", "10", *extra,
        ]
        jobs.append((cmd, out))
        names.append(name)
    rows, cmds = [], []
    for name, (cmd, _), res in zip(names, jobs, run_all(jobs, a)):
        rows.append((name, res["eval_accuracy"], res["eval_loss"], res["final_loss"], res["train_seconds"]))
        cmds.append(_display(cmd))
        logger.info("%s: accuracy %.4f (%.0f s)", name, res["eval_accuracy"], res["train_seconds"])
    soft = rows[0][1]
    lines = [
        f"all-MiniLM-L6-v2 (6 layers, 12 heads of dim 32) + a fresh 2-way head, fine-tuned in full on the first "
        f"{a.cls_train_samples} Rotten Tomatoes training snippets for {a.cls_epochs} epoch(s) (batch {a.cls_batch}, lr {a.cls_lr:g}, "
        f"linear schedule, 10 warm-up steps, seed 0), evaluated on the first {min(a.cls_eval_samples, len(texts))} of the {len(texts)} test snippets "
        f"(mean length {mean_len:.1f} tokens, max_seq_length {a.cls_max_len}). Same budget for every row.",
        "",
        "| attention | test accuracy | Δ vs softmax (points) | eval loss | last train loss | train time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, acc, el, tl, secs in rows:
        lines.append(f"| {name} | {100 * acc:.2f}% | {100 * (acc - soft):+.2f} | {el:.4f} | {tl:.4f} | {secs:.0f} |")
    best = max(rows[1:], key=lambda r: r[1])
    met = soft - best[1] <= 0.01
    lines += ["", f"Best converted variant: **{best[0]}**, {100 * (best[1] - soft):+.2f} points vs softmax — goal (within 1 point) **{'met' if met else 'not met'}**."]
    return "\n".join(lines), cmds


def language_model(a: BenchArguments) -> tuple[str, list[str]]:
    model = str(assets.smollm2_path())
    train_txt, eval_txt = str(assets.wikipedia_text_file("train")), str(assets.wikipedia_text_file("eval"))
    rfa = ["--preset", "favor+", "--num_features", "256", "--window", str(a.lm_window), "--sinks", "4"]
    common = [
        sys.executable, os.path.join(HERE, "train_accelerate.py"), "--model_name_or_path", model, "--task", "causal-lm",
        "--train_file", train_txt, "--validation_file", eval_txt, "--max_seq_length", str(a.lm_block),
        "--max_eval_samples", str(a.lm_eval_blocks), "--per_device_eval_batch_size", "4", "--seed", "0",
        "--disable_tqdm", "true", "--save_final_model", "false",
    ]
    runs = {
        "softmax (original)": [*common, "--feature_map", "softmax", "--do_train", "false"],
        "converted, before tuning": [*common, *rfa, "--do_train", "false"],
        f"converted, after LoRA ({a.lm_steps} steps)": [
            *common, *rfa, "--lora_r", "8", "--max_train_steps", str(a.lm_steps), "--per_device_train_batch_size", str(a.lm_batch),
            "--learning_rate", str(a.lm_lr), "--warmup_steps", "3", "--logging_steps", "5",
        ],
    }
    jobs = [([*cmd, "--output_dir", os.path.join(a.output_dir, f"lm-{i}")], os.path.join(a.output_dir, f"lm-{i}")) for i, cmd in enumerate(runs.values())]
    rows, cmds = [], []
    for name, (cmd, _), res in zip(runs, jobs, run_all(jobs, a)):
        rows.append((name, res["eval_perplexity"], res["eval_loss"], res.get("train_seconds", 0.0) if res["completed_steps"] else 0.0))
        cmds.append(_display(cmd))
        logger.info("%s: perplexity %.2f", name, res["eval_perplexity"])
    lines = [
        f"SmolLM2-135M-Instruct (30 layers, GQA 9/3 heads of dim 64) converted on the fly with FAVOR+ (m=256), exact "
        f"window {a.lm_window} and 4 sinks in every layer (a generic FAVOR+ hybrid, not the recall preset); perplexity on the first {a.lm_eval_blocks} blocks of {a.lm_block} tokens of the "
        f"held-out Wikipedia split. LoRA r=8 on q/k/v/o (FAVOR+ has no trainable feature-map parameters), {a.lm_steps} steps of batch "
        f"{a.lm_batch} × {a.lm_block} tokens from the training split, lr {a.lm_lr:g}.",
        "",
        "| model | perplexity | eval loss | train time (s) |",
        "|---|---|---|---|",
    ]
    for name, ppl, loss, secs in rows:
        lines.append(f"| {name} | {ppl:.2f} | {loss:.4f} | {secs:.0f} |")
    return "\n".join(lines), cmds


def main() -> None:
    (a,) = HfArgumentParser(BenchArguments).parse_args_into_dataclasses()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    os.makedirs(a.output_dir, exist_ok=True)
    sections = ["# Fine-tuning quality (CPU, measured)", "", f"Produced by `python training/benchmark_quality.py` on {os.cpu_count()} CPU cores "
                "(a shared machine: times are pessimistic). Metrics are computed offline (`hf_rfa.recipes.training.metrics`), not with `evaluate.load`.", ""]
    all_cmds = []
    if not a.skip_cls:
        text, cmds = classification(a)
        sections += ["## Rotten Tomatoes classification (all-MiniLM-L6-v2)", "", text, ""]
        all_cmds += cmds
    if not a.skip_lm:
        text, cmds = language_model(a)
        sections += ["## SmolLM2 language modelling on Wikipedia (LoRA)", "", text, ""]
        all_cmds += cmds
    sections += ["## Commands", "", "```bash", *all_cmds, "```", ""]
    with open(a.results_file, "w") as f:
        f.write("\n".join(sections))
    logger.info("wrote %s", a.results_file)


if __name__ == "__main__":
    main()
