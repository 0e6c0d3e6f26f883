"""Command lines installed as entry points (``[project.scripts]``); the repo scripts are thin wrappers.

    hf-rfa-convert      conversion/convert.py        convert + transfer + (LoRA) + report + export
    hf-rfa-evaluate     conversion/evaluate.py       perplexity / copy / passkey of a checkpoint with intervals, or --grid full (one JSON line)
    hf-rfa-finetune     training/finetune.py         transformers.Trainer recipe
    hf-rfa-train        training/train_accelerate.py Accelerate loop with exact resume

Flags: every command parses with ``transformers.HfArgumentParser`` over the
recipe dataclasses (:mod:`hf_rfa.recipes.flags`: the contained ``RFAConfig`` becomes flags of its
own); ``--preset NAME`` (default ``recall``, :mod:`hf_rfa.presets`) gives every other flag its
default, and flags given explicitly override it; every flag takes either spelling
(``--feature-map`` / ``--feature_map``).

``hf-rfa-convert`` prints its results table and ``hf-rfa-evaluate`` one JSON line on stdout; the
training commands log their results and write ``results.json`` in the output folder. Each exits 0
on success (``hf-rfa-convert``: 1 when the ``--push-to-hub`` upload failed). A user error (a bad
value, a missing file, a length the model cannot take) is one line on stderr naming the fix, exit
status 2, no traceback; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Literal

CONVERT_DESCRIPTION = ("Convert a checkpoint to random feature attention: transfer, (LoRA), quality report, export. "
                       "--preset NAME gives every flag's default (flags given override it); --debug shows tracebacks.")
EVALUATE_DESCRIPTION = ("Perplexity, copy or passkey of any causal-LM checkpoint, original or converted, each figure with its 95% "
                        "bootstrap interval; --grid full runs the evaluation of a published model. Prints one JSON line.")
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


# --------------------------------------------------------------------------- installed entry points
#: what a command reports as a user error in one line (bad values, missing files, unreachable Hub ids)
USER_ERRORS = (ValueError, OSError)
DEBUG_FLAG = "--debug"


def user_error(prog: str, e: BaseException) -> int:
    """Report ``e`` as a command's user error: one line on stderr; the exit status, 2."""
    from ._logging import error_line

    print(f"{prog}: error: {error_line(e)} ({DEBUG_FLAG} shows the traceback)", file=sys.stderr)
    return 2


def _command(main, prog: str):
    """An installed command around ``main``: the console-script wrapper calls ``sys.exit(command())``,
    so the command returns 0 on success (``main`` itself returns its report for Python callers; a dict
    given to ``sys.exit`` would be printed to stderr and exit with status 1). A user error
    (:data:`USER_ERRORS`) becomes one line on stderr and status 2, unless ``--debug`` is given; a
    report whose ``--push-to-hub`` upload failed (``push_error``: the folder is kept) status 1."""

    def command(argv: list[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        debug = DEBUG_FLAG in argv
        argv = [a for a in argv if a != DEBUG_FLAG]
        try:
            result = main(argv)
        except USER_ERRORS as e:
            if debug:
                raise
            return user_error(prog, e)
        if isinstance(result, dict) and result.get("push_error"):
            return 1  # the folder is complete and kept, but the upload asked for did not happen
        return 0

    command.__name__ = command.__qualname__ = f"{main.__name__}_command"
    command.__doc__ = f"Installed command ``{prog}``: runs :func:`{main.__name__}`, exits 0 on success, 2 on a user error."
    return command


# --------------------------------------------------------------------------- hf-rfa-convert
def convert_parser(preset: str | None = None):
    """``HfArgumentParser`` over :class:`ConversionConfig` (its ``RFAConfig`` spread into flags);
    defaults: ``preset``'s settings and budgets (None: the default preset, ``recall``)."""
    from .recipes import flags
    from .recipes.conversion.config import ConversionConfig

    return flags.parser([ConversionConfig], formatter_class=_DefaultsFormatter, description=CONVERT_DESCRIPTION, preset=preset)


def config_from_args(argv: list[str] | None = None) -> "ConversionConfig":
    """``ConversionConfig`` from command-line flags (``--preset``: the defaults of the others;
    ``--eval-tokens 0`` / ``--transfer-queries 0``: all)."""
    from .recipes import flags
    from .recipes.conversion.config import ConversionConfig

    argv = _dry_run_defaults(list(sys.argv[1:] if argv is None else argv))
    (view,) = convert_parser(flags.preset_of(argv)).parse_args_into_dataclasses(args=argv)
    return flags.from_flags(ConversionConfig, view)


DRY_RUN_UNUSED = ("--output", "--calibration-text", "--eval-text")


def _dry_run_defaults(argv: list[str]) -> list[str]:
    """``--dry-run`` reads only the model's config: the texts and the output folder may be left out."""
    if not any(a in ("--dry-run", "--dry_run") for a in argv):
        return argv
    given = {a.replace("_", "-").split("=")[0] for a in argv if a.startswith("--")}
    return argv + [x for flag in DRY_RUN_UNUSED if flag not in given for x in (flag, "unused-in-dry-run")]


def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C, so the temp folder is removed
    raise KeyboardInterrupt(f"signal {signum}")


def convert_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-convert`` / ``conversion/convert.py``: run one conversion, print the result table."""
    main_process = os.environ.get("RANK", "0") == "0"  # under `accelerate launch`: one report, from the main process
    level = logging.INFO if main_process else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s")
    _log_info(level)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    from .recipes.conversion.pipeline import rows_markdown, run

    cfg = config_from_args(argv)
    if cfg.dry_run:
        from .recipes.conversion.memory_plan import plan

        p = plan(cfg)
        if main_process:
            print(p.markdown())
        return {"dry_run": True, "peak_bytes": p.peak, "parts": p.parts, "decode": p.decode}
    try:
        report = run(cfg)
    finally:
        _end_process_group()
    if not main_process:
        return report
    print(rows_markdown(report["rows"]))
    if "generation" in report:
        print(f"\ngeneration ({report['generation']['prompt']!r}): {report['generation']['text']!r}")
    print(f"\noutput: {report['output']} (report.json, RESULTS.md, layer_errors.md, model card)")
    if "push_error" in report:
        print(f"\npush to the Hub failed: {report['push_error']}")
    return report


# --------------------------------------------------------------------------- hf-rfa-evaluate
@dataclass
class EvaluateArguments:
    """``hf-rfa-evaluate`` flags. Invalid values raise ``ValueError`` naming the flag."""

    model: str = field(metadata={"help": "folder, Hub id or .gguf file"})
    task: Literal["perplexity", "copy", "passkey"] = field(default="perplexity", metadata={"help": "what to measure"})
    text: str | None = field(default=None, metadata={"help": "perplexity and copy: file, wikipedia:<split> or name[:config]:split"})
    context: int = field(default=1024, metadata={"help": "perplexity: window length"})
    max_tokens: int | None = field(default=None, metadata={"help": "perplexity: evaluate this many tokens (evenly spread windows; None: all)"})
    gap: int = field(default=512, metadata={"help": "copy: tokens of other text between the two copies"})
    passage: int = field(default=256, metadata={"help": "copy: passage length in tokens"})
    draws: int = field(default=8, metadata={"help": "copy: seeded draws"})
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192], metadata={"help": "passkey: prompt lengths"})
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9], metadata={"help": "passkey: depths of the key in [0, 1]"})
    trials: int = field(default=20, metadata={"help": "passkey: seeded trials per (length, depth)"})
    fillers: list[str] = field(default_factory=lambda: ["repeated"], metadata={"help": "passkey: filler kinds, 'repeated' (one block of sentences) and/or 'natural' (--filler-text)"})
    filler_text: str = field(default="wikipedia:eval", metadata={"help": "passkey: held-out text of the natural filler"})
    grid: str | None = field(default=None, metadata={"help": "run a named evaluation grid instead of --task: 'full' (perplexity on 32,768 tokens per "
                                                     "context at 1k-16k, copy at gaps 512-7680 with 8 draws, passkey 1k-8k x 3 depths x 10 trials with "
                                                     "repeated and natural filler; on wikipedia:eval and bbc_news:test); flags given override its settings"})
    texts: list[str] = field(default_factory=list, metadata={"help": "grid: texts of perplexity and copy (not given: the grid's)"})
    contexts: list[int] = field(default_factory=list, metadata={"help": "grid: perplexity contexts (not given: the grid's)"})
    gaps: list[int] = field(default_factory=list, metadata={"help": "grid: copy gaps (not given: the grid's)"})
    output: str | None = field(default=None, metadata={"help": "also write the result to this JSON file (with --grid, its tables to the same name with .md)"})
    seed: int = field(default=0, metadata={"help": "seed of the copy draws, pass keys, filler spans and bootstrap resamples"})
    rfa: list[str] = field(default_factory=list, metadata={"metavar": "FIELD=VALUE", "help": "evaluate a converted model with other settings without parameters "
                                                           "(hf_rfa.reconfigure: window, sinks, memory*, chunk_size, backend, ...), e.g. --rfa memory=1024"})
    progress: bool = field(default=True, metadata={"help": "progress bars"})

    def __post_init__(self) -> None:
        from .hf.runtime import parse_runtime_settings
        from .recipes.grid import GRIDS

        self.rfa_settings = parse_runtime_settings(self.rfa)
        from .recipes.long_range import PASSKEY_FILLERS

        if self.task not in EVALUATE_TASKS:
            raise ValueError(f"task (--task) must be one of {EVALUATE_TASKS}, got {self.task!r}")
        if self.grid is not None and self.grid not in GRIDS:
            raise ValueError(f"grid (--grid) must be one of {tuple(GRIDS)}, got {self.grid!r}")
        if self.grid is not None and self.text is not None:
            raise ValueError("--grid reads --texts (several), not --text")
        if self.grid is None and self.task in ("perplexity", "copy") and self.text is None:
            raise ValueError(f"--task {self.task} needs --text")
        bad = [f for f in self.fillers if f not in PASSKEY_FILLERS]
        if bad or not self.fillers:
            raise ValueError(f"fillers (--fillers) must be among {PASSKEY_FILLERS}, got {self.fillers}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens (--max-tokens) must be >= 1 (or omitted: all), got {self.max_tokens}")
        if self.context < 2:
            raise ValueError(f"context (--context) must be >= 2, got {self.context}")


def evaluate_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-evaluate`` / ``conversion/evaluate.py``: one JSON line per call.

    Tasks: ``perplexity`` (standard non-overlapping windows; ``tokens`` = predicted tokens), ``copy``
    (a passage of held-out text, ``--gap`` tokens of other text, the passage again: perplexity of
    the first and the second copy), ``passkey`` (a 5-digit key at depths 10/50/90% of filler text,
    greedy retrieval accuracy per length and depth; ``--fillers repeated natural``: the classic
    filler and/or held-out text). Every figure comes with ``..._ci95``, its 95% percentile-bootstrap
    interval over windows / draws / trials (:mod:`hf_rfa.recipes.intervals`). ``--grid NAME`` runs
    a named grid of all three (:data:`hf_rfa.recipes.grid.GRIDS`) instead; flags given explicitly
    override the grid's settings. Seeded and deterministic.
    """
    from .recipes import evaluation, flags, long_range
    from .recipes.conversion.pipeline import CAUSAL_LM, load_model

    argv = list(sys.argv[1:] if argv is None else argv)
    p = flags.parser([EvaluateArguments], formatter_class=_DefaultsFormatter, description=EVALUATE_DESCRIPTION)
    try:
        (a,) = p.parse_args_into_dataclasses(args=argv)
        grid = _grid_of(a, argv)
    except ValueError as e:  # EvaluateArguments' checks: a usage error, like argparse's own
        p.error(str(e))
    _map_large_blocks_on_cpu(True)  # (load_model's default device)
    model, tok, kind = load_model(a.model)
    if kind != CAUSAL_LM:
        p.error(f"--model {a.model} is a {kind}, not a causal LM: {'the grid' if grid else a.task} is undefined")
    if a.rfa_settings:
        from .hf.runtime import reconfigure

        try:
            reconfigure(model, **a.rfa_settings)
        except ValueError as e:
            p.error(f"--rfa: {e}")
    _check_positions(p, a, model, grid)
    settings = {"rfa": a.rfa_settings} if a.rfa_settings else {}
    if grid is not None:
        from .recipes.grid import grid_markdown, run_grid

        out = {"task": "grid", "name": a.grid, "model": a.model, **settings, **run_grid(model, tok, grid, seed=a.seed, progress=a.progress)}
        _write_output(a.output, out, grid_markdown(out, f"Evaluation grid '{a.grid}' of {a.model}"))
    elif a.task == "passkey":
        runs = {}
        for kind in a.fillers:
            filler = long_range.natural_filler(tok, evaluation.load_text(a.filler_text), a.filler_text) if kind == "natural" else None
            runs[kind] = long_range.passkey_task(model, tok, a.lengths, a.depths, a.trials, a.seed, progress=a.progress, filler=filler)
        out = {"task": a.task, **settings, **runs[a.fillers[0]]} if len(runs) == 1 else {"task": a.task, **settings, "by_filler": runs}
        _write_output(a.output, out)
    else:
        ids = evaluation.tokenize(tok, evaluation.load_text(a.text))
        if a.task == "copy":
            r = long_range.copy_task(model, ids, a.gap, a.passage, a.draws, seed=a.seed, progress=a.progress)
            out = {"task": a.task, **settings, **r}
        else:
            r = evaluation.perplexity(model, ids, a.context, a.max_tokens, progress=a.progress, seed=a.seed)
            out = {"task": a.task, **settings, **{k: r[k] for k in ("perplexity", "ci95", "tokens", "windows", "context", "window_nll", "window_tokens")}}
        _write_output(a.output, out)
    print(json.dumps(out))
    return out


#: ``EvaluateArguments`` fields that a grid sets unless given on the command line (field -> the grid's)
_GRID_FIELDS = {"texts": "texts", "contexts": "contexts", "max_tokens": "max_tokens", "gaps": "gaps", "passage": "passage", "draws": "draws",
                "lengths": "lengths", "depths": "depths", "trials": "trials", "fillers": "fillers", "filler_text": "filler_text"}


def _grid_of(a: EvaluateArguments, argv: list[str]):
    """The ``--grid`` named (None without one), with every flag given in ``argv`` in place of its setting."""
    if a.grid is None:
        return None
    from dataclasses import replace

    from .recipes.grid import GRIDS

    given = {x.split("=")[0][2:].replace("-", "_") for x in argv if x.startswith("--")}
    changes = {g: (tuple(getattr(a, f)) if isinstance(getattr(a, f), list) else getattr(a, f)) for f, g in _GRID_FIELDS.items() if f in given}
    return replace(GRIDS[a.grid], **changes)


def _write_output(path: str | None, out: dict, markdown: str | None = None) -> None:
    """``--output``: the result as indented JSON at ``path`` and (a grid) its tables next to it as ``.md``."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(out, indent=2) + "\n")
    if markdown is not None:
        with open(os.path.splitext(path)[0] + ".md", "w", encoding="utf-8") as f:
            f.write(markdown)


def _check_positions(p, a: EvaluateArguments, model, grid=None) -> None:
    """A model with learned positions cannot read past them: refuse before any window is evaluated."""
    from .recipes.conversion.checks import learned_positions, memory_beyond_positions

    limit = learned_positions(model)
    tasks = {"perplexity": ("--context", a.context), "copy": ("--gap", a.gap + 2 * a.passage), "passkey": ("--lengths", max(a.lengths, default=0))}
    longest = ("--grid", grid.longest) if grid is not None else tasks[a.task]
    if limit is not None and longest[1] > limit:
        p.error(f"{longest[0]}: {a.grid or a.task} needs {longest[1]} tokens but {a.model} has {limit} learned positions")
    if warning := memory_beyond_positions(model, longest[1]):
        logging.getLogger("hf_rfa.cli").warning("%s: %s", longest[0], warning)


# --------------------------------------------------------------------------- training
def _parse_training(dataclasses: tuple, argv: list[str] | None, files: tuple[str, ...]) -> tuple:
    """``HfArgumentParser`` over the recipe's dataclasses (``RFAArguments`` spread into flags), from
    ``argv`` or a single config file argument."""
    from .recipes import flags

    argv = sys.argv[1:] if argv is None else argv
    config_file = argv[0] if len(argv) == 1 and argv[0].endswith(files) else None
    return flags.parse(dataclasses, None if config_file else argv, config_file=config_file)


def _map_large_blocks_on_cpu(on_cpu: bool) -> None:
    """A command about to load and run a model on the CPU: C-heap blocks of 4 MiB or more get a
    memory map of their own, returned when freed (glibc; :mod:`.recipes.conversion.host_memory`),
    as the conversion does; the user's ``MALLOC_MMAP_THRESHOLD_`` stands. Nothing elsewhere."""
    from .recipes.conversion.host_memory import DEFAULT_MMAP_THRESHOLD_MIB, map_large_blocks

    if on_cpu and map_large_blocks(DEFAULT_MMAP_THRESHOLD_MIB):
        logging.getLogger("hf_rfa.cli").debug("C-heap blocks of %d MiB or more are mapped on their own", DEFAULT_MMAP_THRESHOLD_MIB)


def _no_cuda(forced_cpu: bool) -> bool:
    """Whether a training command runs on the CPU: told to, or no CUDA device."""
    import torch

    return forced_cpu or not torch.cuda.is_available()


def _end_process_group() -> None:
    """Tear down the distributed process group (if this command started one) before exit, so
    no rank's interpreter shutdown races gloo's threads."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finetune_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-finetune`` / ``training/finetune.py``: the ``transformers.Trainer`` recipe."""
    from transformers import TrainingArguments

    from .recipes.training import DataArguments, ModelArguments, RFAArguments, run_trainer

    model_args, data_args, rfa_args, training_args = _parse_training(
        (ModelArguments, DataArguments, RFAArguments, TrainingArguments), argv, (".json", ".yaml", ".yml"))
    level = logging.INFO if training_args.process_index == 0 else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    _log_info(level)
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        # TrainingArguments' do_train defaults to False: a command called to fine-tune trains unless told
        # to only evaluate (--do_eval without --do_train)
        logging.getLogger("hf_rfa.cli").info("training (no --do_train / --do_eval given; --do_eval alone only evaluates)")
        training_args.do_train = True
    _map_large_blocks_on_cpu(_no_cuda(training_args.use_cpu))
    try:
        return run_trainer(model_args, data_args, rfa_args, training_args)
    finally:
        _end_process_group()


def train_accelerate_main(argv: list[str] | None = None) -> dict:
    """``hf-rfa-train`` / ``training/train_accelerate.py``: the Accelerate loop."""
    from .recipes.training import DataArguments, LoopArguments, ModelArguments, RFAArguments, train

    args = _parse_training((ModelArguments, DataArguments, RFAArguments, LoopArguments), argv, (".json",))
    # (no PartialState() here: it would fix the distributed setup before Accelerator(cpu=...) reads it)
    main_process = os.environ.get("RANK", "0") == "0"
    level = logging.INFO if main_process else logging.WARNING
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=level)
    _log_info(level)
    _map_large_blocks_on_cpu(_no_cuda(os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")))
    try:
        return train(*args)
    finally:
        _end_process_group()


convert_command = _command(convert_main, "hf-rfa-convert")
evaluate_command = _command(evaluate_main, "hf-rfa-evaluate")
finetune_command = _command(finetune_main, "hf-rfa-finetune")
train_accelerate_command = _command(train_accelerate_main, "hf-rfa-train")
