"""How the exact memory switched on after training is split over the layers (``memory_split``).

``"uniform"``: every layer keeps ``memory_after_training`` keys per kv head. ``"induction"``: the
same total of keys (``memory_after_training`` × layers per kv head), split by where the
*original* model copies: a share ``memory_floor`` of ``memory_after_training`` in every layer, the rest in proportion to each
layer's induction share — on copy sequences of the calibration text (a passage, other text, the
same passage again; :func:`hf_rfa.recipes.long_range.copy_sequences`), the softmax probability that
the second copy's queries give the key after the earlier occurrence of their token (the source
an induction head reads), averaged over the query heads, queries, draws and gaps. Measured before
conversion (:func:`measure_split`, a stage), used by :func:`switch_on_memory` and by the
window-only baseline's memory (the same per-layer sizes: the same decode state).

On SmolLM2-135M a floor of 160 of the 7,680 keys per kv head took the copy task at gap 512 from
4.20 to 1.75 and perplexity at 4k to 0.990× the uniform memory's
(``research/long_range_recall/``, (j)).
"""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .. import long_range
from ...hf.runtime import set_memory
from .checks import _positions
from .devices import input_device
from .loading import CAUSAL_LM

logger = logging.getLogger(__name__)

#: how ``memory_after_training`` is split over the layers (module docstring)
MEMORY_SPLITS = ("uniform", "induction")
#: the copy sequences of the measurement: passage tokens, first scored token of the second copy, draws per gap
PASSAGE, SKIP, DRAWS = 256, 16, 4
#: their gaps when the run measures no copy task (``copy_gaps``)
DEFAULT_GAPS = (512, 3584)
_PROBE = "hf_rfa_induction_probe"


def check_memory_split(split: str, floor: float, memory_after_training: int) -> None:
    """ValueError naming the bad value and the allowed ones (a split of no memory,
    ``memory_after_training=0``, is allowed and does nothing)."""
    if split not in MEMORY_SPLITS:
        raise ValueError(f"memory_split must be one of {list(MEMORY_SPLITS)}, got {split!r}")
    if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0 <= floor <= 1:
        raise ValueError(f"memory_floor must be a share of memory_after_training in [0, 1] (0.625: 160 of 256 keys), got {floor!r}")


def floor_keys(share: float, memory: int) -> int:
    """The keys every layer keeps: ``share`` (``memory_floor``) of ``memory``, rounded."""
    return int(round(share * memory))


def split_budget(total: int, scores: list[float], floor: int = 0) -> list[int]:
    """``floor`` keys per layer and the rest of ``total`` in proportion to ``scores`` (largest
    remainder: the sizes sum to ``total`` exactly; all-zero scores: the rest evenly)."""
    if floor * len(scores) > total:
        raise ValueError(f"memory_floor={floor} x {len(scores)} layers exceeds the total of {total} keys")
    if any(x < 0 for x in scores):
        raise ValueError(f"scores must be >= 0, got {scores}")
    rest = total - floor * len(scores)
    s = sum(scores)
    raw = [rest * x / s for x in scores] if s > 0 else [rest / len(scores)] * len(scores)
    sizes = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - sizes[i], reverse=True)[: rest - sum(sizes)]:
        sizes[i] += 1
    return [floor + x for x in sizes]


def layer_sizes(shares: list[list[float]], memory: int, floor: float) -> list[int]:
    """Per-layer memory sizes from the induction ``shares [layers][kv heads]``: ``memory`` keys per
    kv head on average, ``floor`` (a share of ``memory``, :func:`floor_keys`) in every layer and the
    rest in proportion to each layer's mean share over its kv heads (:func:`split_budget`)."""
    scores = [sum(head) / len(head) for head in shares]
    return split_budget(memory * len(scores), scores, floor_keys(floor, memory))


@torch.no_grad()
def induction_shares(model, ids: torch.Tensor, gaps: list[int], passage: int = PASSAGE, draws: int = DRAWS, skip: int = SKIP, seed: int = 1, progress: bool = False) -> list[list[float]]:
    """Per layer and kv head of an unconverted causal LM, the attention probability of the second
    copy's queries (tokens ``skip``.. of it) on their induction source, averaged over the query
    heads, queries, ``draws`` copy sequences of ``ids [T]`` per gap and the ``gaps`` → ``[layers][kv
    heads]``. The model's outputs are sdpa's; its attention implementation is put back after."""
    sums: dict[int, torch.Tensor] = {}
    period = [0]

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, h, n, d = query.shape
        hkv = key.shape[1]
        t = torch.arange(period[0] + skip - 1, period[0] + passage - 1, device=query.device)  # queries predicting tokens skip.. of the second copy
        logits = query[:, :, t].float() @ key.repeat_interleave(h // hkv, dim=1).float().transpose(-1, -2) * (scaling if scaling is not None else d**-0.5)
        logits = logits.masked_fill(torch.arange(n, device=query.device).view(1, -1) > t.view(-1, 1), float("-inf"))
        source = logits.softmax(-1).gather(-1, (t - period[0] + 1).view(1, 1, -1, 1).expand(b, h, -1, 1)).squeeze(-1)  # [B, H, Q]
        share = source.mean((0, 2)).view(hkv, h // hkv).mean(-1).double().cpu()
        sums[module.layer_idx] = sums.get(module.layer_idx, 0) + share
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    AttentionInterface.register(_PROBE, probe)
    before = model.config._attn_implementation
    model.set_attn_implementation(_PROBE)
    device = input_device(model)
    try:
        bar = tqdm(total=len(gaps) * draws, desc="memory split (induction)", disable=not progress)
        for gap in gaps:
            period[0] = passage + gap
            for row in long_range.copy_sequences(ids, passage, gap, draws, seed=seed):
                model(input_ids=row.unsqueeze(0).to(device), use_cache=False)
                bar.update()
        bar.close()
    finally:
        model.set_attn_implementation(before)
    n = len(gaps) * draws
    return [[float(x) / n for x in sums[i]] for i in sorted(sums)]


def measure_split(s) -> None:
    """Stage (causal LMs with ``memory_split="induction"``, on the original model): the per-layer
    memory sizes, into ``s.report["memory_split"]``."""
    cfg = s.cfg
    if cfg.memory_split == "uniform" or not cfg.memory_after_training or s.kind != CAUSAL_LM:
        return
    limit = _positions(s.model) or 1 << 30
    ids = s.ids["calibration"]
    room = min(limit, ids.numel() // 2)  # copy_sequences draws passages and gaps from disjoint halves
    passage = max(2, min(PASSAGE, room // 4))
    gaps = [g for g in (cfg.copy_gaps or DEFAULT_GAPS) if 2 * passage + g <= room] or [max(0, room - 2 * passage)]
    shares = induction_shares(s.model, ids, gaps, passage=passage, skip=min(SKIP, passage // 4), seed=cfg.seed + 1, progress=cfg.progress)
    floor = floor_keys(cfg.memory_floor, cfg.memory_after_training)
    sizes = layer_sizes(shares, cfg.memory_after_training, cfg.memory_floor)
    s.report["memory_split"] = {"split": cfg.memory_split, "floor": floor, "sizes": sizes, "induction": [[round(x, 4) for x in head] for head in shares],
                                "text": "calibration", "passage": passage, "gaps": gaps, "draws": DRAWS}
    logger.info("exact memory split by the original's induction share (floor %d): %s keys per kv head", floor, sizes)


def memory_sizes(s) -> list[int] | None:
    """The per-layer memory sizes :func:`measure_split` chose (None: uniform)."""
    return (s.report.get("memory_split") or {}).get("sizes")


def memory_label(s, memory_score: str) -> str:
    """The rows' name of the memory: ``memory 256 (feature_error)``, ``memory 256 by layer (…)`` when split."""
    return f"memory {s.cfg.memory_after_training}{' by layer' if memory_sizes(s) else ''} ({memory_score})"


def switch_on_memory(s, memory_score: str) -> None:
    """``set_memory`` with the run's ``memory_after_training`` and split (:func:`memory_sizes`)."""
    set_memory(s.model, s.cfg.memory_after_training, s.cfg.rfa.memory_every, memory_score, per_layer=memory_sizes(s))


__all__ = ["DEFAULT_GAPS", "MEMORY_SPLITS", "check_memory_split", "floor_keys", "induction_shares", "layer_sizes", "measure_split", "memory_label", "memory_sizes", "split_budget", "switch_on_memory"]
