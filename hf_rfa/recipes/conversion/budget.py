"""What a training stage did (:class:`TransferResult`) and its budget rule: budgets are tokens, the
wall-clock limit only a safety net that fails loudly (:class:`BudgetNotReached`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TransferResult:
    """What a training stage did: tokens seen, optimiser steps, wall seconds, loss history."""

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    autocast: str | None = None  # "bf16" when the stage ran under autocast (precision.dtype_name)
    sharding: dict | None = None  # under FSDP: what this process stored while it trained (fsdp.storage)
    activation_checkpointing: bool = False  # LoRA recomputed its decoder layers' activations in the backward
    chunked_loss: bool = False  # LoRA's loss ran without the full logits (lm_loss)
    objective: str | None = None  # LoRA: "next_token" or "distill" (lora.OBJECTIVES)

    def as_dict(self) -> dict:
        first = self.losses[0] if self.losses else None
        last = self.losses[-1] if self.losses else None
        out = {"tokens": self.tokens, "steps": self.steps, "minutes": self.seconds / 60, "loss_first": first, "loss_last": last}
        if self.autocast is not None:
            out["autocast"] = self.autocast
        if self.sharding is not None:
            out["fsdp"] = self.sharding
        if self.activation_checkpointing:
            out["activation_checkpointing"] = True
        if self.chunked_loss:
            out["chunked_loss"] = True
        if self.objective is not None and self.objective != "next_token":
            out["objective"] = self.objective
        return out


class BudgetNotReached(RuntimeError):
    """A training stage hit its wall-clock safety limit before its token budget.

    Budgets are counted in tokens so that a run's figures do not depend on how fast (or busy) the
    machine was; the wall-clock limit only guards against a run that would never end, and fails
    loudly instead of silently training less.
    """


def check_limit(stage: str, res: TransferResult, tokens: int, start: float, max_seconds: float | None) -> None:
    """Raise :class:`BudgetNotReached` when ``max_seconds`` have passed since ``start`` before ``tokens``.

    With several processes the decision is collective (:func:`.distributed.any_process`): every
    process stops at the same step as soon as one of them is over its limit (their clocks differ),
    instead of the others waiting forever in the next step's gradient all-reduce. Every process
    therefore calls this once per step, whether or not it has a limit."""
    from . import distributed

    over = max_seconds is not None and res.tokens < tokens and time.perf_counter() - start >= max_seconds
    if distributed.any_process(over):
        if max_seconds is None:
            raise BudgetNotReached(f"{stage}: another process hit its safety limit after {res.tokens} of {tokens} tokens ({res.steps} steps); every process stops with it")
        raise BudgetNotReached(
            f"{stage} hit its safety limit of {max_seconds / 60:.1f} min after {res.tokens} of {tokens} tokens "
            f"({res.steps} steps); the budget is in tokens so that results do not depend on machine speed: "
            f"raise the limit (--{stage.split()[0].lower()}-minutes) or lower the token budget"
        )


__all__ = ["BudgetNotReached", "TransferResult", "check_limit"]
