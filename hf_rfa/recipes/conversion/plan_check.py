"""Does a conversion's memory plan (:mod:`.memory_plan`) fit its device: what the device has free
(``torch.cuda.mem_get_info``; on the CPU ``MemAvailable`` of ``/proc/meminfo``, or psutil), and a
one-line refusal with the numbers and what to change when the plan's peak exceeds it."""

from __future__ import annotations

import logging

import torch

from .config import ConversionConfig
from .memory_plan import MemoryPlan, PlanDoesNotFit, fmt_bytes, plan

logger = logging.getLogger(__name__)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` or psutil)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def check_before_loading(cfg: ConversionConfig) -> MemoryPlan | None:
    """The plan of ``cfg`` checked against its device (:func:`check_fits`); None (with a warning)
    when the model cannot be planned (the run goes on: the check is a guard, not a gate)."""
    from . import devices

    try:
        p = plan(cfg)
    except PlanDoesNotFit:
        raise
    except Exception as e:  # noqa: BLE001 - an architecture the meta skeleton cannot build must not block a run
        logger.warning("no memory plan for %s (%s): the fit check is skipped", cfg.model, e)
        return None
    logger.info("memory plan: peak %s (%s)\n%s", fmt_bytes(p.peak), p.peak_stage, p.markdown())
    if cfg.device_map is None:  # a device map spreads the model over several devices: no single-device check
        check_fits(p, devices.check_device(cfg.device))
    return p


def check_fits(p: MemoryPlan, device: torch.device | str, available: int | None = None) -> None:
    """Raise :class:`PlanDoesNotFit` (one line: the numbers and what to change) when the plan's
    peak exceeds ``available`` (default: :func:`available_bytes`; the CPU plan's runtime part is
    already resident, so it is not counted twice)."""
    device = torch.device(device)
    avail = available_bytes(device) if available is None else available
    if avail is None:
        return
    need = p.peak - (p.parts[p.peak_stage].get("runtime", 0) if device.type == "cpu" and available is None else 0)
    if need <= avail:
        return
    hints = []
    if p.dtype == "float32":
        hints.append("--dtype bfloat16")
    if "transfer" in p.parts and p.peak_stage == "transfer":
        hints.append("--transfer-layerwise")
    if p.batch_size > 1:
        hints.append("a smaller --batch-size")
    hints += ["a shorter --context / --lora-context", "--device-map auto or an FSDP config over more devices"]
    raise PlanDoesNotFit(
        f"the memory plan needs {fmt_bytes(need)} per process at its peak ({p.peak_stage}) but {device} has {fmt_bytes(avail)} free: "
        f"try {', '.join(hints)} (--dry-run prints the plan; --no-memory-check skips this check)"
    )


__all__ = ["available_bytes", "check_before_loading", "check_fits"]
