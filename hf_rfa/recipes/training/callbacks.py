"""Trainer callback: redraw random projections every ``redraw_interval`` optimizer steps."""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from ...hf.convert import redraw, rfa_config_of

logger = logging.getLogger(__name__)


def _unwrap_config_owner(model):
    """Find the object carrying ``config.rfa_config`` through PEFT / DDP wrappers."""
    seen = model
    for attr in ("module", "base_model", "model"):
        if rfa_config_of(seen) is not None:
            return seen
        seen = getattr(seen, attr, seen)
    return seen


class RedrawCallback(TrainerCallback):
    """Redraw every feature map's projections after each ``interval``-th optimizer step.

    The k-th redraw uses step k, so projections are a deterministic function of
    ``(seed, layer, k)``: identical on every process of a multi-process run with no
    communication. Redrawing happens between optimizer steps, never inside forward (gradient
    checkpointing re-runs forward). ``interval=None`` takes ``redraw_interval`` from the model's
    RFAConfig; 0 disables.
    """

    def __init__(self, interval: int | None = None) -> None:
        if interval is not None and (not isinstance(interval, int) or interval < 0):
            raise ValueError(f"interval must be None or an int >= 0, got {interval!r}")
        self.interval = interval
        self.redraws = 0

    def _interval(self, model) -> int:
        if self.interval is not None:
            return self.interval
        cfg = rfa_config_of(_unwrap_config_owner(model)) if model is not None else None
        return cfg.redraw_interval if cfg else 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        interval = self._interval(model)
        if model is None or interval <= 0 or state.global_step % interval:
            return control
        step = state.global_step // interval
        n = redraw(model, step)
        self.redraws += 1
        logger.info("redrew %d feature maps at optimizer step %d (redraw step %d)", n, state.global_step, step)
        return control
