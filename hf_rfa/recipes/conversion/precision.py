"""Mixed precision of the conversion's training stages (attention transfer, LoRA).

``ConversionConfig.train_autocast`` is one of :data:`AUTOCAST_CHOICES`:

- ``"auto"`` (default): bf16 autocast where it is faster than float32 — a CUDA device with bf16
  support, or a CPU with bf16 matrix hardware (AMX or AVX-512 BF16, from ``/proc/cpuinfo``) — and
  float32 elsewhere (on an AVX2-only CPU a bf16 matmul is emulated and runs ~57× slower than fp32,
  ``docs/training.md``);
- ``"off"``: float32;
- ``"bf16"``: bf16 autocast wherever the stage runs.

Under autocast the model's linear layers run in bf16; the hf_rfa ops keep features, states and sums
in float32 as always (they switch autocast off inside), the transfer loss and the LoRA loss are
computed in float32, and the trained parameters stay float32 (no loss scaling is needed for bf16).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

#: allowed values of ``train_autocast``
AUTOCAST_CHOICES = ("auto", "off", "bf16")

#: /proc/cpuinfo flags of CPUs with bf16 matrix hardware
_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def check_autocast(value: str, name: str = "train_autocast") -> str:
    """``value`` if it is one of :data:`AUTOCAST_CHOICES`, else a ValueError naming ``name``."""
    if value not in AUTOCAST_CHOICES:
        raise ValueError(f"{name} must be one of {list(AUTOCAST_CHOICES)}, got {value!r}")
    return value


def cpu_has_fast_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bf16 matrix hardware (AMX-BF16 or AVX-512 BF16); False when unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return any(f in flags for f in _BF16_CPU_FLAGS)


def resolve_autocast(value: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype for training on ``device`` (None: float32). See the module docstring."""
    check_autocast(value)
    device = torch.device(device)
    if value == "off":
        return None
    if value == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_fast_bf16() else None
    return None


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """``torch.autocast(device.type, dtype)``, or a no-op context for ``dtype=None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """How a stage records its autocast dtype in ``report.json``: ``"bf16"``; None without autocast."""
    return None if dtype is None else {torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


__all__ = ["AUTOCAST_CHOICES", "autocast", "check_autocast", "cpu_has_fast_bf16", "dtype_name", "resolve_autocast"]
