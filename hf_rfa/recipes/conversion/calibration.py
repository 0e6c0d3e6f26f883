"""Capture each layer's q, k, v and softmax output; measure per-layer error of a converted model.

``capture(model, input_ids)`` runs one forward of ``model`` with *exact softmax* attention in
every layer (converted or not) and returns, per attention layer, the tensors the attention
function saw::

    caps = capture(model, ids)             # {layer_idx: Captured}
    caps[3].q  [B, H, N, D]   caps[3].k, caps[3].v  [B, Hkv, N, D]   caps[3].out  [B, H, N, Dv]

It works through transformers' attention interface: a second attention function
(``"hf_rfa_capture"``) is registered and the model is switched to it for the forward, then
switched back. Because every layer runs softmax during the capture, the captured tensors are
those of the teacher even when the model is already converted (only the feature maps differ
between teacher and student; attention transfer trains nothing else).

``layer_errors(model, batches)`` gives, per converted layer, the relative error of the RFA
output against softmax on the captured inputs; :func:`error_table` and :func:`plot_errors`
render it.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from ... import compat
from ...hf.attention import ATTN_NAME, _padding_mask, exact_attention, rfa_mask
from ...hf.convert import find_attention_modules
from ...hf.rope import ROPE_ATTR, unrotated_qk
from ...ops import random_feature_attention
from ...ops.backends import training_backend

logger = logging.getLogger(__name__)

CAPTURE_NAME = "hf_rfa_capture"


@dataclass
class Captured:
    """What one attention layer saw in one forward (all detached).

    q ``[B, H, N, D]``, k/v ``[B, Hkv, N, D]``, out ``[B, H, N, Dv]`` (softmax output, before
    the output projection), mask ``[B, N]`` bool or None, causal, scale; fq/fk: q and k with the
    rotary embedding undone, for layers converted with ``feature_input="unrotated"`` (else None).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float | None
    fq: torch.Tensor | None = None
    fk: torch.Tensor | None = None

    def last_queries(self, n: int) -> "Captured":
        """The same capture restricted to the last ``n`` queries (all keys kept)."""
        cut = lambda x: x[:, :, -n:] if x is not None else None  # noqa: E731
        return Captured(cut(self.q), self.k, self.v, cut(self.out), self.mask, self.causal, self.scale, cut(self.fq), self.fk)

    def queries_ending_at(self, end: int, n: int) -> "Captured":
        """Causal captures: the ``n`` queries before position ``end`` (``[end − n, end)``) with the
        keys they see (``[0, end)``): a shorter sequence's last queries, cut from this capture."""
        if not self.causal:
            raise ValueError("queries_ending_at needs a causal capture (encoders see every key)")
        if not (1 <= n <= end <= self.k.shape[2]):
            raise ValueError(f"need 1 <= n <= end <= {self.k.shape[2]} keys, got n={n}, end={end}")
        keys = lambda x: x[:, :, :end] if x is not None else None  # noqa: E731
        mask = self.mask[:, :end] if self.mask is not None else None
        return Captured(
            self.q[:, :, :end], keys(self.k), keys(self.v), self.out[:, :, :end], mask, True, self.scale, keys(self.fq), keys(self.fk)
        ).last_queries(n)


def feature_inputs(rfa: nn.Module, cap: Captured) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(feature_q, feature_k)`` for the op on a capture: the un-rotated q/k for a layer with
    ``feature_input="unrotated"``, else ``(None, None)`` (the map reads q/k)."""
    if getattr(rfa, "feature_input", "rotated") != "unrotated":
        return None, None
    if cap.fq is None or cap.fk is None:
        raise ValueError("this layer was converted with feature_input='unrotated' but the capture holds no un-rotated q/k (capture it after hf_rfa.convert)")
    return cap.fq, cap.fk


def _unrotated(module, rfa, query, key):
    """Un-rotated ``(q, k)`` of an attention call for a layer that wants them, else ``(None, None)``."""
    if rfa is None or getattr(rfa, "feature_input", "rotated") != "unrotated":
        return None, None
    return unrotated_qk(getattr(module, ROPE_ATTR, None), query, key)


_STORE: list[dict] = []  # stack of {id(module): (layer_idx, captures dict)}


class _Captured(Exception):
    """Raised by the capturing attention once the last wanted layer is captured: the rest of the
    forward is not needed (``capture(..., layers=...)``)."""


def _capture_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    causal = kwargs.pop("is_causal", None)
    if causal is None:
        causal = bool(getattr(module, "is_causal", False))
    mask2d = _padding_mask(attention_mask, key.shape[2])
    out = exact_attention(query, key, value, mask2d, causal, scaling, 0.0)
    if _STORE:
        table, captures = _STORE[-1]["index"], _STORE[-1]["captures"]
        idx = table.get(id(module))
        if idx is not None:
            fq, fk = _unrotated(module, getattr(module, "rfa", None), query.detach(), key.detach())
            captures[idx] = Captured(query.detach(), key.detach(), value.detach(), out.detach(), mask2d, bool(causal), scaling, fq, fk)
            if _STORE[-1].get("stop") == idx:
                raise _Captured
    return out.transpose(1, 2).contiguous(), None


def register_capture() -> None:
    """Register the capturing attention function and its mask function (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE_NAME, _capture_forward)
    AttentionMaskInterface.register(CAPTURE_NAME, rfa_mask)


@contextmanager
def attn_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Temporarily switch ``model`` to the attention implementation ``name``."""
    old = compat.attn_implementation_of(model.config) or "eager"
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


@torch.no_grad()
def capture(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
    layers: set[int] | None = None,
) -> dict[int, Captured]:
    """One softmax forward of ``model``; returns ``{layer_idx: Captured}`` for every attention layer.

    ``input_ids [B, N]``; ``attention_mask [B, N]`` (1 = real token) or None; ``position_ids
    [B, N]`` or None (the model's default positions); ``layers``: capture only these layer indices
    (the forward stops after the last of them: layer-by-layer transfer holds one layer's tensors).

    An FSDP-sharded ``model`` (:mod:`.fsdp`): the forward goes through the root unit (which
    gathers the embeddings; the logits of the last position only) and runs to its end, so that
    every unit's all-gather and release pair up in every process.
    """
    from .fsdp import is_sharded

    register_capture()
    index = {id(m): idx for _, m, idx in find_attention_modules(model) if layers is None or idx in layers}
    if not index:
        raise ValueError(f"{type(model).__name__} has no attention module on transformers' attention interface" + (f" among layers {sorted(layers)}" if layers is not None else ""))
    from .devices import input_device

    dev = input_device(model)
    input_ids = input_ids.to(dev)
    attention_mask = None if attention_mask is None else attention_mask.to(dev)
    position_ids = None if position_ids is None else position_ids.to(dev)
    captures: dict[int, Captured] = {}
    sharded = is_sharded(model)
    _STORE.append({"index": index, "captures": captures, "stop": max(index.values()) if layers is not None and not sharded else None})
    try:
        with attn_implementation(model, CAPTURE_NAME):
            base = model if sharded else getattr(model, "base_model", model)  # no LM head: logits are not needed
            params = inspect.signature(base.forward).parameters
            kwargs = {"use_cache": False} if "use_cache" in params else {}
            if sharded and "logits_to_keep" in params:
                kwargs["logits_to_keep"] = 1
            if position_ids is not None:
                kwargs["position_ids"] = position_ids
            try:
                base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            except _Captured:
                pass
    finally:
        _STORE.pop()
    return captures


def rfa_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer_idx: RFAAttention}`` of the converted layers of ``model``."""
    out = {}
    for _, m, idx in find_attention_modules(model):
        rfa = getattr(m, "rfa", None)
        if rfa is not None:
            out[idx] = rfa
    if not out:
        raise ValueError(f"{type(model).__name__} has no converted layer (call hf_rfa.convert first)")
    return out


def rfa_output(rfa: nn.Module, cap: Captured, checkpoint_blocks: bool | None = None) -> torch.Tensor:
    """The RFA output of one layer on captured inputs, ``[B, H, N, Dv]``, by the layer's op
    (:func:`hf_rfa.random_feature_attention` with the layer's window, sinks, memory, chunk size, backend).

    One rule for every recipe: the op, never its quadratic twin (``quadratic_kernel_attention``
    is the tests' oracle). With autograd the op runs its autograd form — with the layer's
    ``checkpoint_blocks`` (recompute in backward: O(N·D) activation memory) unless
    ``checkpoint_blocks`` is given — and a layer whose backend runs without autograd only
    (``inference``, ``compiled``, ``native``) trains with ``"auto"`` (the ``torch`` form).
    ``benchmarks/transfer_forms.py`` measures the op against the twin.
    """
    backend = training_backend(rfa.backend)
    fq, fk = feature_inputs(rfa, cap)
    return random_feature_attention(
        cap.q, cap.k, cap.v, rfa.feature_map, causal=cap.causal, attention_mask=cap.mask, window=rfa.window,
        sinks=rfa.sinks, scale=cap.scale, chunk_size=rfa.chunk_size, backend=backend,
        checkpoint_blocks=rfa.checkpoint_blocks if checkpoint_blocks is None else checkpoint_blocks,
        memory=getattr(rfa, "memory", 0), memory_every=getattr(rfa, "memory_every", 64),
        memory_score=getattr(rfa, "memory_score", "value_norm"), feature_q=fq, feature_k=fk,
    )


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded query rows (``x [B, H, N, D]``)."""
    return x if mask is None else x * mask[:, None, :, None].to(x.dtype)


@dataclass
class LayerError:
    layer: int
    relative_error: float  # ‖rfa − softmax‖ / ‖softmax‖ over all tokens
    mse: float


@torch.no_grad()
def layer_errors(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor | None]], progress: bool = True) -> list[LayerError]:
    """Per converted layer: relative error and MSE of the RFA output vs softmax, summed over batches.

    ``batches`` yields ``(input_ids [B, N], attention_mask [B, N] | None)``; the RFA output is
    the layer's op (:func:`rfa_output`, without autograd: its inference form).
    """
    from tqdm.auto import tqdm

    layers = rfa_layers(model)
    num = {i: 0.0 for i in layers}
    den = {i: 0.0 for i in layers}
    count = {i: 0 for i in layers}
    for ids, mask in tqdm(list(batches), desc="per-layer error", disable=not progress):
        caps = capture(model, ids, mask)
        for idx, rfa in layers.items():
            cap = caps[idx]
            diff = _masked(rfa_output(rfa, cap).float() - cap.out.float(), cap.mask)
            ref = _masked(cap.out.float(), cap.mask)
            num[idx] += float(diff.pow(2).sum())
            den[idx] += float(ref.pow(2).sum())
            count[idx] += diff.numel() if cap.mask is None else int(cap.mask.sum()) * diff.shape[1] * diff.shape[-1]
    return [LayerError(i, (num[i] / max(den[i], 1e-30)) ** 0.5, num[i] / max(count[i], 1)) for i in sorted(layers)]


def error_table(columns: dict[str, list[LayerError]]) -> str:
    """Markdown table: one row per layer, one column (relative error) per named measurement."""
    names = list(columns)
    layers = sorted({e.layer for errs in columns.values() for e in errs})
    look = {(n, e.layer): e.relative_error for n, errs in columns.items() for e in errs}
    lines = ["| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for layer in layers:
        lines.append(f"| {layer} | " + " | ".join(f"{look[(n, layer)]:.3f}" if (n, layer) in look else "" for n in names) + " |")
    means = [sum(e.relative_error for e in columns[n]) / max(len(columns[n]), 1) for n in names]
    lines.append("| mean | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def plot_errors(columns: dict[str, list[LayerError]], path: str, title: str = "attention-output error per layer") -> str:
    """Save a PNG of relative error per layer (one line per named measurement); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, errs in columns.items():
        ax.plot([e.layer for e in errs], [e.relative_error for e in errs], marker="o", ms=3, label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("‖rfa − softmax‖ / ‖softmax‖")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "ATTN_NAME",
    "CAPTURE_NAME",
    "Captured",
    "LayerError",
    "attn_implementation",
    "capture",
    "error_table",
    "layer_errors",
    "plot_errors",
    "register_capture",
    "rfa_layers",
    "rfa_output",
]
