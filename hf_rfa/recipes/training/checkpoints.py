"""Resumable checkpoints of the Accelerate training loop (:mod:`.loop`).

``accelerator.save_state`` stores model, optimizer, scheduler and RNG states; :class:`TrainState`
— the optimizer step, the epoch, the position inside the epoch and the redraw step — is saved as
JSON (``train_state.json``, never a pickle: a crafted checkpoint cannot run code on resume), and a
checkpoint counts as complete only once its ``COMPLETE`` file is written last (``latest`` skips one
a killed run left half-written). A resumed run drops the records after the checkpoint's step from
``log.jsonl`` before appending its own (:func:`trim_log`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field

import torch

from ...hf.convert import redraw

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step_"
#: the loop position of a checkpoint (JSON) and the file written last when it is complete
TRAIN_STATE_FILE, COMPLETE_FILE = "train_state.json", "COMPLETE"


@dataclass
class TrainState:
    """Loop position saved with every checkpoint (``accelerator.register_for_checkpointing``)."""

    completed_steps: int = 0
    epoch: int = 0
    steps_in_epoch: int = 0
    redraw_step: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set the fields from ``state``; ValueError for unknown fields or values of the wrong type."""
        if not isinstance(state, dict) or set(state) - set(asdict(self)):
            raise ValueError(f"train state must be a dict of the fields {sorted(asdict(self))}, got {state!r:.200}")
        for key, value in state.items():
            ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value) if key == "losses" else isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise ValueError(f"train state field {key} has a bad value {value!r:.200}")
            setattr(self, key, list(value) if key == "losses" else value)

    def save_json(self, folder: str) -> None:
        """Write ``folder/train_state.json`` (atomically)."""
        path = os.path.join(folder, TRAIN_STATE_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f)
        os.replace(path + ".tmp", path)

    def load_json(self, folder: str) -> None:
        """Read ``folder/train_state.json`` (JSON only: nothing is unpickled)."""
        path = os.path.join(folder, TRAIN_STATE_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint {folder!r} has no {TRAIN_STATE_FILE} (incomplete, or written by an older hf_rfa)")
        with open(path, encoding="utf-8") as f:
            self.load_state_dict(json.load(f))


def latest_checkpoint(output_dir: str) -> str | None:
    """Newest *complete* ``output_dir/step_N`` folder (one holding ``COMPLETE``), or None."""
    if not os.path.isdir(output_dir):
        return None
    steps = [(int(m.group(1)), d) for d in os.listdir(output_dir) if (m := re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", d))]
    complete = [(n, d) for n, d in steps if os.path.isfile(os.path.join(output_dir, d, COMPLETE_FILE))]
    if len(complete) < len(steps):
        logger.warning("skipping incomplete checkpoints %s", sorted(d for n, d in set(steps) - set(complete)))
    return os.path.join(output_dir, max(complete)[1]) if complete else None


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint folder to resume from: ``latest`` is the newest complete one in
    ``output_dir``; ValueError when there is none (a resume never starts from scratch in silence)."""
    if resume != "latest":
        return resume
    found = latest_checkpoint(output_dir)
    if found is None:
        raise ValueError(f"resume_from_checkpoint='latest': {output_dir!r} holds no complete checkpoint ({CHECKPOINT_PREFIX}N with {COMPLETE_FILE}); omit the flag to train from scratch")
    return found


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_state_exactly(accelerator, folder: str) -> None:
    """``accelerator.load_state(folder)``, refusing (ValueError) a checkpoint whose RNG state is
    missing or unreadable: accelerate would skip it with an INFO line and the resume would not be exact."""
    rng = os.path.join(folder, f"random_states_{accelerator.process_index}.pkl")
    if not os.path.isfile(rng):
        raise ValueError(f"checkpoint {folder!r} lacks {os.path.basename(rng)}: an exact resume needs the RNG state it saved")
    said, log = _Said(), logging.getLogger("accelerate.checkpointing")
    level = log.level
    log.addHandler(said)
    log.setLevel(logging.INFO)
    try:
        accelerator.load_state(folder)
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    if any("Could not load random states" in m for m in said.messages):
        raise ValueError(f"checkpoint {folder!r}: {os.path.basename(rng)} is unreadable (corrupt or truncated): an exact resume needs the RNG state it saved")


def save_checkpoint(accelerator, state: TrainState, folder: str) -> None:
    """``accelerator.save_state`` + the JSON train state, then ``COMPLETE`` once every process is done."""
    accelerator.save_state(folder)
    if accelerator.is_main_process:
        state.save_json(folder)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(os.path.join(folder, COMPLETE_FILE), "w", encoding="utf-8") as f:
            f.write(f"{state.completed_steps}\n")


def trim_log(log_path: str, completed_steps: int) -> None:
    """Drop the records of ``log.jsonl`` after ``completed_steps`` (a resumed run replays them)."""
    if not os.path.isfile(log_path):
        return
    with open(log_path, encoding="utf-8") as f:
        lines = [ln for ln in f if ln.strip()]
    keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= completed_steps]
    if len(keep) < len(lines):
        with open(log_path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(log_path + ".tmp", log_path)


def resume_from(accelerator, model, state: TrainState, resume: str, interval: int) -> None:
    """Load checkpoint folder ``resume`` into the prepared objects and ``state`` (ValueError for a
    folder that is missing, holds pickled custom state, or lacks its RNG state); redraws the
    projections of the checkpoint's redraw step (``interval`` > 0)."""
    if not os.path.isdir(resume):
        raise ValueError(f"resume_from_checkpoint {resume!r} is not a checkpoint folder")
    pickles = sorted(f for f in os.listdir(resume) if f.startswith("custom_checkpoint_"))
    if pickles:  # accelerate would unpickle them (arbitrary code); hf_rfa never writes them
        raise ValueError(f"checkpoint {resume!r} holds {pickles}: hf_rfa saves its training state as JSON and never unpickles one; remove these files to resume")
    load_state_exactly(accelerator, resume)
    state.load_json(resume)
    if interval and state.redraw_step:
        redraw(model, state.redraw_step)  # projections are a function of the step: restore exactly
    logger.info("resumed from %s at optimizer step %d (epoch %d, step %d in epoch)", resume, state.completed_steps, state.epoch, state.steps_in_epoch)


__all__ = ["CHECKPOINT_PREFIX", "COMPLETE_FILE", "TRAIN_STATE_FILE", "TrainState", "latest_checkpoint", "load_state_exactly", "resolve_resume", "resume_from", "save_checkpoint", "trim_log"]
