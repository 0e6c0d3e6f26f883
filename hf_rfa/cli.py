"""Command lines installed as entry points (``[project.scripts]``); the repo scripts are thin wrappers.

    hf-rfa-convert      conversion/convert.py        convert + transfer + (LoRA) + report + export
    hf-rfa-evaluate     conversion/evaluate.py       perplexity / copy / passkey of a checkpoint (one JSON line)
    hf-rfa-finetune     training/finetune.py         transformers.Trainer recipe
    hf-rfa-train        training/train_accelerate.py Accelerate loop with exact resume

Flags: conversion flags are spelled ``--feature-map``; every one also accepts the underscore form
(``--feature_map``) that the training commands (``HfArgumentParser``) use, and those accept the
dash form — so either spelling works everywhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

CONVERT_DESCRIPTION = "Convert a checkpoint to random feature attention: transfer, (LoRA), quality report, export."
EVALUATE_DESCRIPTION = "Perplexity, copy or passkey of any causal-LM checkpoint, original or converted; prints one JSON line."
EVALUATE_TASKS = ("perplexity", "copy", "passkey")


def _log_info(level: int = logging.INFO) -> None:
    """Command lines show hf_rfa's progress (INFO; other ranks: WARNING) whatever transformers' verbosity is."""
    logging.getLogger("hf_rfa").setLevel(level)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` except on on/off switches (a ``--no-...`` flag defaulting to True misleads)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.required:
            return action.help or ""
        return super()._get_help_string(action)


def _feature_map_names() -> list[str]:
    from .feature_maps import available_feature_maps

    return sorted(available_feature_maps())


def _add(p: argparse.ArgumentParser, flag: str, *more: str, **kwargs) -> argparse.Action:
    """``p.add_argument(flag)`` that also accepts the underscore spelling (``--feature_map``)."""
    names = [flag, *more]
    alias = "--" + flag[2:].replace("-", "_")
    if alias != flag:
        names.append(alias)
    return p.add_argument(*names, **kwargs)


# --------------------------------------------------------------------------- hf-rfa-convert
def convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=CONVERT_DESCRIPTION, formatter_class=_DefaultsFormatter)
    _add(p, "--model", required=True, help="Hub id (e.g. gpt2), local folder or .gguf file")
    _add(p, "--output", required=True, help="folder to create (written to a temp dir, renamed at the end)")
    _add(p, "--feature-map", default="hedgehog", choices=_feature_map_names(), help="feature map of the converted layers")
    _add(p, "--num-features", type=int, default=64, help="random / learned features m per head")
    _add(p, "--window", type=int, default=64, help="exact-softmax local window W (0: none)")
    _add(p, "--sinks", type=int, default=4, help="first S tokens attended exactly (attention sinks)")
    _add(p, "--no-hybrid-mix", dest="hybrid_mix", action="store_false", help="no learned feature/exact mixing weight")
    _add(p, "--learnable-projections", action="store_true", help="favor+/positive/rff…: attention transfer trains the projections")
    _add(p, "--transfer-tokens", type=int, default=500_000, help="tokens of attention transfer (learned maps; 0: skip)")
    _add(p, "--lora-tokens", type=int, default=0, help="tokens of the LoRA stage (causal LMs; 0: skip)")
    _add(p, "--transfer-minutes", type=float, default=None, help="safety limit of attention transfer: reaching it before --transfer-tokens fails the run (budgets are tokens)")
    _add(p, "--lora-minutes", type=float, default=None, help="safety limit of LoRA: reaching it before --lora-tokens fails the run (budgets are tokens)")
    _add(p, "--calibration-text", required=True, help="text for the per-layer error table: file, wikipedia:<split>, rotten_tomatoes:<split> or name[:config]:split")
    _add(p, "--train-text", default=None, help="transfer/LoRA text (default: calibration text)")
    _add(p, "--eval-text", required=True, help="held-out evaluation text (same forms as --calibration-text)")
    _add(p, "--context", type=int, default=1024, help="sequence length of transfer and LoRA")
    _add(p, "--lora-context", type=int, default=None, help="sequence length of LoRA (default: --context)")
    _add(p, "--eval-contexts", type=int, nargs="+", default=[1024], help="contexts at which perplexity is measured")
    _add(p, "--eval-tokens", type=int, default=16384, help="predicted tokens per evaluation (0: all)")
    _add(p, "--error-tokens", type=int, default=2048, help="calibration tokens of the per-layer error table")
    _add(p, "--eval-sentences", type=int, default=1000, help="encoders: held-out sentences for embedding cosine / accuracy")
    _add(p, "--transfer-queries", type=int, default=256, help="causal: fit the last Q queries of each sequence (0: all)")
    _add(p, "--transfer-lr", type=float, default=1e-2, help="learning rate of attention transfer")
    _add(p, "--lora-lr", type=float, default=1e-3, help="learning rate of LoRA")
    _add(p, "--lora-r", type=int, default=8, help="LoRA rank")
    _add(p, "--no-window-only-baseline", dest="window_only_baseline", action="store_false", help="hybrids: skip the window-only baseline (feature_map='none', same window and sinks, its own LoRA with the same budget)")
    _add(p, "--copy-gaps", type=int, nargs="*", default=[], help="long range: copy task at these gaps, every variant (e.g. 512 3584)")
    _add(p, "--copy-draws", type=int, default=8, help="long range: seeded draws of the copy task")
    _add(p, "--passkey-lengths", type=int, nargs="*", default=[], help="long range: passkey accuracy at these lengths, original and trained variants")
    _add(p, "--passkey-trials", type=int, default=20, help="long range: seeded passkey trials per (length, depth)")
    _add(p, "--no-baselines", dest="baselines", action="store_false", help="skip the untrained baselines")
    _add(p, "--no-random-hybrid", dest="random_hybrid", action="store_false", help="skip the random-feature hybrid baseline")
    _add(p, "--eval-twin-max", type=int, default=2048, help="evaluate converted models up to this context with the op's quadratic twin (0: never)")
    _add(p, "--random-num-features", type=int, default=256, help="features of the random-feature baselines")
    _add(p, "--seed", type=int, default=0, help="seed of projections and training")
    _add(p, "--push-to-hub", default=None, metavar="ID", help="upload the output folder to this Hub repo (a failed upload keeps the folder and says how to retry)")
    _add(p, "--base-model", default=None, metavar="ID", help="Hub id the model was converted from, for the model card (default: --model when it is a Hub id)")
    _add(p, "--overwrite", action="store_true", help="replace an existing --output folder")
    _add(p, "--no-progress", dest="progress", action="store_false", help="no progress bars")
    return p


def config_from_args(argv: list[str] | None = None) -> ConversionConfig:
    a = vars(convert_parser().parse_args(argv))
    a["eval_tokens"] = a["eval_tokens"] or None
    a["transfer_queries"] = a["transfer_queries"] or None
    from .recipes.conversion.pipeline import ConversionConfig

    return ConversionConfig(**a)


def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C, so the temp folder is removed
    raise KeyboardInterrupt(f"signal {signum}")


def convert_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-convert`` / ``conversion/convert.py``: run one conversion, print the result table."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _log_info()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    from .recipes.conversion.pipeline import _rows_markdown, run

    report = run(config_from_args(argv))
    print(_rows_markdown(report["rows"]))
    if "generation" in report:
        print(f"\ngeneration ({report['generation']['prompt']!r}): {report['generation']['text']!r}")
    print(f"\noutput: {report['output']}")
    if "push_error" in report:
        print(f"\npush to the Hub failed: {report['push_error']}")
    return report


# --------------------------------------------------------------------------- hf-rfa-evaluate
def evaluate_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-evaluate`` / ``conversion/evaluate.py``: one JSON line per call.

    Tasks: ``perplexity`` (standard non-overlapping windows; ``tokens`` = predicted tokens), ``copy``
    (a passage of held-out text, ``--gap`` tokens of other text, the passage again: perplexity of
    the first and the second copy), ``passkey`` (a 5-digit key at depths 10/50/90% of filler text,
    greedy retrieval accuracy per length and depth). Seeded and deterministic.
    """
    from .recipes import evaluation, long_range
    from .recipes.conversion.pipeline import CAUSAL_LM, load_model

    p = argparse.ArgumentParser(description=EVALUATE_DESCRIPTION, formatter_class=_DefaultsFormatter)
    _add(p, "--model", required=True, help="folder, Hub id or .gguf file")
    _add(p, "--task", choices=EVALUATE_TASKS, default="perplexity", help="what to measure")
    _add(p, "--text", default=None, help="perplexity and copy: file, wikipedia:<split> or name[:config]:split")
    _add(p, "--context", type=int, default=1024, help="perplexity: window length")
    _add(p, "--max-tokens", type=int, default=None, help="perplexity: evaluate this many tokens (evenly spread windows)")
    _add(p, "--gap", type=int, default=512, help="copy: tokens of other text between the two copies")
    _add(p, "--passage", type=int, default=256, help="copy: passage length in tokens")
    _add(p, "--draws", type=int, default=8, help="copy: seeded draws")
    _add(p, "--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="passkey: prompt lengths")
    _add(p, "--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="passkey: depths of the key in [0, 1]")
    _add(p, "--trials", type=int, default=20, help="passkey: seeded trials per (length, depth)")
    _add(p, "--seed", type=int, default=0, help="seed of the copy draws and pass keys")
    _add(p, "--no-progress", dest="progress", action="store_false", help="no progress bars")
    a = p.parse_args(argv)
    if a.task in ("perplexity", "copy") and a.text is None:
        p.error(f"--task {a.task} needs --text")
    if a.max_tokens is not None and a.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1 (or omitted: all), got {a.max_tokens}")
    if a.context < 2:
        p.error(f"--context must be >= 2, got {a.context}")
    model, tok, kind = load_model(a.model)
    if kind != CAUSAL_LM:
        p.error(f"--model {a.model} is a {kind}, not a causal LM: {a.task} is undefined")
    if a.task == "passkey":
        r = long_range.passkey_task(model, tok, a.lengths, a.depths, a.trials, a.seed, progress=a.progress)
        out = {"task": a.task, **r}
    else:
        ids = evaluation.tokenize(tok, evaluation.load_text(a.text))
        if a.task == "copy":
            r = long_range.copy_task(model, ids, a.gap, a.passage, a.draws, seed=a.seed, progress=a.progress)
            out = {"task": a.task, **r}
        else:
            r = evaluation.perplexity(model, ids, a.context, a.max_tokens, progress=a.progress)
            out = {"task": a.task, "perplexity": r["perplexity"], "tokens": r["tokens"], "windows": r["windows"], "context": r["context"]}
    print(json.dumps(out))
    return out


# --------------------------------------------------------------------------- training
def _parse_training(dataclasses: tuple, argv: list[str] | None, files: tuple[str, ...]) -> tuple:
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclasses)
    if argv is None and len(sys.argv) == 2 and sys.argv[1].endswith(files):
        path = sys.argv[1]
        return tuple(parser.parse_json_file(path) if path.endswith(".json") else parser.parse_yaml_file(path))
    return tuple(parser.parse_args_into_dataclasses(args=argv))


def finetune_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-finetune`` / ``training/finetune.py``: the ``transformers.Trainer`` recipe."""
    from transformers import TrainingArguments

    from .recipes.training import DataArguments, ModelArguments, RFAArguments, run_trainer

    model_args, data_args, rfa_args, training_args = _parse_training(
        (ModelArguments, DataArguments, RFAArguments, TrainingArguments), argv, (".json", ".yaml", ".yml"))
    level = logging.INFO if training_args.process_index == 0 else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    _log_info(level)
    return run_trainer(model_args, data_args, rfa_args, training_args)


def train_accelerate_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-train`` / ``training/train_accelerate.py``: the Accelerate loop."""
    from .recipes.training import DataArguments, LoopArguments, ModelArguments, RFAArguments, train

    args = _parse_training((ModelArguments, DataArguments, RFAArguments, LoopArguments), argv, (".json",))
    # (no PartialState() here: it would fix the distributed setup before Accelerator(cpu=...) reads it)
    main_process = os.environ.get("RANK", "0") == "0"
    level = logging.INFO if main_process else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    _log_info(level)
    return train(*args)
