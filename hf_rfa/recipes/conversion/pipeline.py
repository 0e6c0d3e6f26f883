"""The conversion pipeline behind ``hf-rfa-convert`` (``conversion/convert.py``) and the main job.

``run(ConversionConfig(...))``:

1. checks the inputs (:mod:`.checks`: paths before anything is loaded, lengths and settings
   against the loaded model before any stage) and loads the checkpoint (:mod:`.loading`: Hub id,
   local folder, GGUF file, or a converted folder);
2. runs the stages of its kind in order (:data:`.stages.STAGES`: original, baselines, convert,
   init mixing, per-layer errors, attention transfer, LoRA, window-only baseline, evaluation with
   the long-range tasks, metrics) over one shared :class:`.state.State`;
3. exports Hub-ready (:func:`hf_rfa.hub.export.export`, model card filled with the measured numbers)
   into a temporary folder next to ``output``, adds ``report.json``, ``layer_errors.md/png`` and
   ``RESULTS.md``, and renames it to ``output`` only at the end — a failed or interrupted run
   never leaves a folder that looks complete. ``push_to_hub`` then uploads it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ... import output_dir
from . import calibration, checks, devices, distributed, transfer  # noqa: F401 - transfer: tests patch pipeline.transfer.attention_transfer
from .config import ConversionConfig
from .devices import default_device
from .loading import CAUSAL_LM, CLASSIFIER, ENCODER, kind_of, load_model, resolve_checkpoint
from .stages import run_stages
from .state import State, rows_markdown

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------- helpers
class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60


def _tmp_dir(output: Path, overwrite: bool, inputs: tuple = ()) -> Path:
    """A staging folder next to ``output`` once ``output`` may be written: empty, or written by
    hf_rfa with --overwrite, and not containing any input (:func:`output_dir.check_target`)."""
    output_dir.check_target(output, overwrite, inputs, flag="--overwrite")
    return output_dir.staging_dir(output)


def _publish(tmp: Path, output: Path) -> None:
    output_dir.publish(tmp, output)  # old result aside, new one in, old one deleted


# --------------------------------------------------------------------------- the run
def run(cfg: ConversionConfig) -> dict:
    """Run one conversion; returns the report (also written to ``output/report.json``)."""
    torch.manual_seed(cfg.seed)
    procs = distributed.processes()  # several under `accelerate launch`: only the main one writes
    distributed.check_batch(cfg.batch_size)
    distributed.use_fsdp(True if cfg.fsdp else None)  # None: the launcher's FSDP setting
    if distributed.fsdp_active() and cfg.device_map is not None:
        raise ValueError("an FSDP launch cannot use --device-map: FSDP shards the model over the processes (drop --device-map)")
    if cfg.fsdp and procs.world == 1:
        logger.warning("--fsdp in one process: nothing to shard over (launch several with accelerate launch or torchrun)")
    output = Path(cfg.output).resolve()
    if not procs.is_main:
        checks.check_inputs(cfg)
        report = _run(cfg, None, plot=False)
        distributed.barrier()  # the main process has published the output
        report["output"] = str(output)
        return report
    report_plot = plotting_available()  # checked before any expensive stage
    tmp = _tmp_dir(output, cfg.overwrite, (cfg.model, cfg.calibration_text, cfg.train_text, cfg.eval_text))
    try:
        checks.check_inputs(cfg)
        report = _run(cfg, tmp, plot=report_plot)
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    distributed.barrier()
    report["output"] = str(output)
    if cfg.push_to_hub:
        _push(cfg.push_to_hub, output, report)
    return report


def _push(repo_id: str, output: Path, report: dict) -> None:
    """Upload the (already Hub-ready) output folder; a failure is reported, never raised: the
    folder stays and ``report["push_error"]`` says how to upload it later."""
    from huggingface_hub import HfApi

    from ...hub.export import PushError

    try:
        api = HfApi()
        api.create_repo(repo_id, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(output), repo_type="model")
    except Exception as e:  # noqa: BLE001 - network / auth problems must not lose the printed results
        report["push_error"] = str(PushError(repo_id, output, e))
        logger.error("%s", report["push_error"])
        return
    logger.info("pushed %s to %s", output, repo_id)


def plotting_available() -> bool:
    """Whether matplotlib can draw ``layer_errors.png``; one warning when it cannot (the run goes on)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: layer_errors.png will be skipped (pip install matplotlib); the table is still written")
        return False
    return True


def _run(cfg: ConversionConfig, tmp: Path | None, plot: bool = True) -> dict:
    """Load, run the stages, export into ``tmp`` with the reports (``tmp=None``: a process other
    than the main one, which writes nothing); returns the report."""
    from .host_memory import measure_peak_rss

    total = _Timer()
    planned = None
    if cfg.memory_check:
        from .plan_check import check_before_loading

        planned = check_before_loading(cfg)  # refuses at once a run that would not fit the device
    procs = distributed.processes()
    device = cfg.device if cfg.device is not None or procs.device is None else str(procs.device)  # one device per process
    mapped = _map_large_blocks(cfg, device)
    with measure_peak_rss() as load_peak:
        model, tok, kind = load_model(
            cfg.model, cfg.torch_dtype, device, device_map=cfg.device_map, attn_implementation=cfg.teacher_attn_implementation,
        )
    report: dict[str, Any] = {"model": cfg.model, "kind": kind, "config": cfg.to_dict(), "rows": [], "stages": {}, "machine": devices.machine(device)}
    memory = report["memory"] = {"peak_rss_bytes": {"load": load_peak[0]} if load_peak[0] is not None else {}}
    memory["malloc_mmap_threshold_mib"] = cfg.malloc_mmap_threshold if mapped else None
    if planned is not None:  # the plan next to what each stage measured
        memory["plan_bytes"] = {stage: planned.stage_total(stage) for stage in planned.parts}
    warnings = checks.check_model(cfg, model, kind)
    if warnings:
        report["warnings"] = warnings
    if procs.world > 1:
        report["processes"] = procs.world
        if distributed.fsdp_active():
            report["fsdp"] = True  # the training stages sharded (.fsdp)
    state = run_stages(State(cfg=cfg, model=model, tok=tok, kind=kind, report=report))
    if tmp is None:
        return report
    _export(state, tmp, plot)
    report["minutes_total"] = total.minutes()
    (tmp / "RESULTS.md").write_text(rows_markdown(report["rows"]) + "\n", encoding="utf-8")
    (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return report


def _map_large_blocks(cfg: ConversionConfig, device: str | None) -> bool:
    """On the CPU, fix glibc's threshold for mapping large blocks (``cfg.malloc_mmap_threshold``,
    :func:`.host_memory.map_large_blocks`) before anything is loaded; whether it was set."""
    from .host_memory import MMAP_THRESHOLD_ENV, map_large_blocks

    if (default_device() if device in (None, "auto") else device).split(":")[0] != "cpu":
        return False
    if map_large_blocks(cfg.malloc_mmap_threshold):
        logger.info("C-heap blocks of %d MiB or more are mapped on their own and returned when freed (--malloc-mmap-threshold)", cfg.malloc_mmap_threshold)
        return True
    if cfg.malloc_mmap_threshold and MMAP_THRESHOLD_ENV in os.environ:
        logger.info("%s is set: glibc's mmap threshold is left as the environment sets it", MMAP_THRESHOLD_ENV)
    elif not cfg.malloc_mmap_threshold:
        logger.warning("--malloc-mmap-threshold 0: glibc keeps freed blocks of up to 32 MiB resident, so the peak can exceed "
                       "the memory plan, which counts the tensors held (report.json's memory section gives both)")
    return False


def _export(s: State, tmp: Path, plot: bool) -> None:
    # ``tmp`` is renamed to ``cfg.output`` at the end: the card and messages name the final folder
    """Hub-ready export of the final model (card with the metrics) and the per-layer error table/plot."""
    from ...hub.export import export

    cfg = s.cfg
    local = os.path.exists(cfg.model)
    export(
        s.model, tmp, base_model=cfg.base_model or (None if local else cfg.model), metrics=s.metrics, repo_id=cfg.push_to_hub,
        overwrite=True, tokenizer=s.tok, source_dir=cfg.model if os.path.isdir(cfg.model) else None,
        published_as=Path(cfg.output).resolve(),
    )
    if s.errors:
        (tmp / "layer_errors.md").write_text(calibration.error_table(s.errors) + "\n", encoding="utf-8")
        if plot:
            calibration.plot_errors(s.errors, str(tmp / "layer_errors.png"), title=f"{cfg.model}: attention-output error vs softmax")
        s.report["layer_errors"] = {k: [asdict(e) for e in v] for k, v in s.errors.items()}


__all__ = ["CAUSAL_LM", "CLASSIFIER", "ENCODER", "ConversionConfig", "kind_of", "load_model", "resolve_checkpoint", "rows_markdown", "run"]
