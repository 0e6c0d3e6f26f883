"""Where and in which precision a conversion runs: device, weight dtype, device map, teacher attention.

``ConversionConfig`` fields (``hf-rfa-convert`` flags of the same names):

- ``device``: ``cuda`` / ``cuda:N`` / ``cpu`` / ``mps`` (None: CUDA when available, else the CPU);
- ``dtype``: ``float32`` (default), ``bfloat16`` or ``float16``: the dtype of the *frozen* weights.
  The trainable tensors — feature maps, decay rates, hybrid mixing weights (``convert`` builds them
  in float32) and the LoRA adapters (PEFT keeps adapters in float32) — stay float32: ordinary mixed
  precision. With low-precision weights the training stages run under ``torch.autocast`` of the
  device type in that dtype (:func:`training_autocast`) — except on a CPU without bf16 matrix
  hardware, where a bf16 matmul is emulated and many times slower: there the weights stay stored in
  low precision and every linear layer multiplies in float32 (:func:`float32_compute`). With float32
  weights ``train_autocast`` decides as before (:mod:`.precision`);
- ``device_map``: None (the whole model on ``device``) or ``auto`` (transformers / Accelerate place
  the layers over every visible GPU, then the CPU, for a teacher / student that does not fit one device);
- ``teacher_attn_implementation``: ``sdpa`` (default), ``eager`` or ``flash_attention_2`` (needs the
  ``flash_attn`` package and a CUDA device): how the original model attends when it is evaluated.
  The captures of attention transfer always use hf_rfa's exact attention.

Every check raises a one-line ``ValueError`` naming the value and the allowed ones.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

#: ``dtype`` names and their torch dtypes
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: allowed ``device_map`` values (None: one device)
DEVICE_MAPS = ("auto",)
#: allowed ``teacher_attn_implementation`` values
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
#: device types a conversion can run on
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def default_device() -> str:
    """``cuda`` when a CUDA device is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def machine(device: torch.device | str | None) -> dict[str, Any]:
    """Where a run's figures were measured (``report.json``'s ``machine``): the CPU's model name
    (``/proc/cpuinfo``, else ``platform.processor()``), torch's threads and, on CUDA, the GPU."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    out: dict[str, Any] = {"cpu": cpu, "threads": torch.get_num_threads()}
    device = torch.device(default_device() if device in (None, "auto") else device)
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def check_device(value: str | None, available: bool = True) -> torch.device:
    """The torch device for ``value`` (None or ``auto``: :func:`default_device`); ``available=False``
    accepts a device this machine lacks (a ``--dry-run`` plans for a GPU it does not have)."""
    if value is None or value == "auto":
        return torch.device(default_device())
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be one of {list(DEVICE_TYPES)} (optionally with ':N'), got {value!r}") from None
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"device must be one of {list(DEVICE_TYPES)} (optionally with ':N'), got {value!r}")
    if not available:
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r}, but no CUDA device is visible (allowed here: 'cpu')")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={value!r}, but only {torch.cuda.device_count()} CUDA device(s) are visible")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"device={value!r}, but MPS is not available (allowed here: 'cpu')")
    return dev


def check_dtype(value: str) -> torch.dtype:
    """The torch dtype named ``value`` (one of :data:`DTYPES`)."""
    if value not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {value!r}")
    return DTYPES[value]


def check_device_map(value: str | None) -> str | None:
    if value is not None and value not in DEVICE_MAPS:
        raise ValueError(f"device_map must be None or one of {list(DEVICE_MAPS)}, got {value!r}")
    return value


def flash_attention_available() -> bool:
    """Whether ``flash_attn`` is installed and a CUDA device is visible."""
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def check_attn_implementation(value: str, device: torch.device | None = None) -> str:
    """``value`` if it is one of :data:`ATTN_IMPLEMENTATIONS` and usable here."""
    if value not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"teacher_attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)}, got {value!r}")
    if value == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError("teacher_attn_implementation='flash_attention_2' needs the flash_attn package (pip install flash-attn); allowed without it: 'sdpa', 'eager'")
        if device is not None and device.type != "cuda":
            raise ValueError(f"teacher_attn_implementation='flash_attention_2' needs a CUDA device, got device={str(device)!r}; allowed there: 'sdpa', 'eager'")
    return value


def load_kwargs(dtype: torch.dtype, device: torch.device, device_map: str | None) -> dict[str, Any]:
    """``from_pretrained`` keywords: the weight dtype and, with a device map, where the layers go.

    Without a device map the model is loaded on the CPU and moved with :func:`place` (today's CPU
    path: no ``device_map`` keyword at all). ``use_kernels=False``: transformers (5.25) otherwise
    swaps modules for Hub kernels on a GPU wherever the ``kernels`` package is installed; the
    conversion reads and replaces the stock modules (and must not need the Hub: offline, the swap
    fails before the model loads)."""
    kwargs: dict[str, Any] = {"dtype": dtype, "use_kernels": False}
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device.type != "cpu":
        kwargs["device_map"] = {"": str(device)}  # straight onto the device, no full CPU copy first
    return kwargs


def input_device(model: nn.Module) -> torch.device:
    """Where a model's inputs go: its input embedding's device (the first stage of a device map)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.device
    return next(model.parameters()).device


def to_device(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``x`` on ``device`` (None stays None; no copy when it is already there)."""
    return None if x is None else x.to(device, non_blocking=True)


def keep_trainable_float32(model: nn.Module) -> int:
    """Cast every converted layer's tensors (feature maps, decay, mix) to float32; returns how many
    were cast (0 when they already were: ``convert`` builds them in float32)."""
    from .calibration import rfa_layers

    n = 0
    for rfa in rfa_layers(model).values():
        for t in list(rfa.parameters()) + list(rfa.buffers()):
            if t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
                n += 1
    return n


def training_autocast(train_autocast: str, device: torch.device, weight_dtype: torch.dtype) -> torch.dtype | None:
    """The autocast dtype of the training stages: the weights' dtype when it is bfloat16 / float16
    (mixed precision: float32 trainables, low-precision compute), else ``train_autocast``'s choice."""
    from .precision import resolve_autocast

    if weight_dtype in (torch.bfloat16, torch.float16):
        return None if needs_float32_compute(device, weight_dtype) else weight_dtype
    return resolve_autocast(train_autocast, device)


def weight_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's frozen weights (its input embedding's)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.dtype
    return next(model.parameters()).dtype


__all__ = [
    "ATTN_IMPLEMENTATIONS", "DEVICE_MAPS", "DEVICE_TYPES", "DTYPES", "check_attn_implementation", "check_device", "check_device_map",
    "Float32ComputeLinear", "check_dtype", "default_device", "float32_compute", "needs_float32_compute", "flash_attention_available", "input_device", "keep_trainable_float32", "load_kwargs", "to_device",
    "training_autocast", "weight_dtype",
]


# --------------------------------------------------------------------------- low-precision storage, float32 compute
class _StoredLinear(torch.autograd.Function):
    """``x @ w.float()ᵀ + b`` that saves the low-precision ``w`` (not its float32 copy) for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        ctx.input_dtype = x.dtype
        out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return (grad @ weight.float()).to(ctx.input_dtype), None, None  # frozen weight and bias: no gradient


class Float32ComputeLinear(nn.Linear):
    """An ``nn.Linear`` whose low-precision weight is multiplied in float32: what a CPU without bf16
    matrix hardware runs, where a bf16 matmul is emulated and many times slower than float32. A
    frozen weight (or no autograd) keeps no float32 copy for the backward (one layer's copy at a
    time); a weight that requires grad gets its gradient through the upcast as usual."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return super().forward(x)
        if torch.is_grad_enabled() and (self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)):
            # a weight that trains: plain autograd through the upcast (its float32 copy is kept for the backward)
            return torch.nn.functional.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return _StoredLinear.apply(x, self.weight, self.bias)


def float32_compute(model: nn.Module) -> int:
    """Make every frozen low-precision ``nn.Linear`` of ``model`` compute in float32
    (:class:`Float32ComputeLinear`, same weights and state dict); returns how many were switched."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype in (torch.bfloat16, torch.float16):
            m.__class__ = Float32ComputeLinear
            n += 1
    return n


def needs_float32_compute(device: torch.device, dtype: torch.dtype) -> bool:
    """Low-precision weights on a CPU without bf16 matrix hardware: compute in float32."""
    from .precision import cpu_has_fast_bf16

    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not cpu_has_fast_bf16()
