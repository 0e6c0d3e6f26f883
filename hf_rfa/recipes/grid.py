"""Evaluation grids of a causal LM (``hf-rfa-evaluate --grid full``): every figure with its interval.

A grid runs, on one model:

- **perplexity** on every text of ``texts`` at every context of ``contexts``, ``max_tokens``
  predicted tokens per context (evenly spread non-overlapping windows, :func:`.evaluation.perplexity`);
- the **copy task** on every text at every gap of ``gaps`` (``draws`` seeded draws of a
  ``passage``-token passage, :func:`.long_range.copy_task`);
- **passkey retrieval** at every length of ``lengths`` × ``depths`` × ``trials``, once per filler of
  ``fillers``: ``repeated`` (the classic block of sentences) and ``natural`` (held-out
  ``filler_text``, :func:`.long_range.natural_filler`);

each figure with its 95% percentile-bootstrap interval over windows / draws / trials
(:mod:`.intervals`). :data:`GRIDS` holds the named grids; :func:`grid_markdown` renders a result.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from . import evaluation, long_range
from .intervals import fmt


@dataclass(frozen=True)
class Grid:
    """The settings of one evaluation grid (see the module docstring)."""

    texts: tuple[str, ...]
    contexts: tuple[int, ...]
    max_tokens: int | None
    gaps: tuple[int, ...]
    passage: int
    draws: int
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    fillers: tuple[str, ...]
    filler_text: str

    def __post_init__(self) -> None:
        for name in ("contexts", "gaps", "lengths"):
            if any(isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "gaps" else 2) for v in getattr(self, name)):
                raise ValueError(f"{name} must be ints >= {0 if name == 'gaps' else 2}, got {list(getattr(self, name))}")
        bad = [f for f in self.fillers if f not in long_range.PASSKEY_FILLERS]
        if bad:
            raise ValueError(f"fillers must be among {long_range.PASSKEY_FILLERS}, got {bad}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 (or None: all), got {self.max_tokens}")

    @property
    def longest(self) -> int:
        """The most tokens one forward of the grid reads."""
        return max([*self.contexts, *(g + 2 * self.passage for g in self.gaps), *self.lengths], default=0)


#: the named grids. ``full``: the evaluation of a published model — perplexity on 32,768 tokens per
#: context from 1k to 16k, copy at gaps 512 / 1,536 / 3,584 / 7,680 with 8 draws, passkey at 1k–8k ×
#: 3 depths × 10 trials with the repeated and a natural filler, on held-out Wikipedia and on BBC news
#: articles (a second domain no conversion here trains on)
GRIDS: dict[str, Grid] = {
    "full": Grid(
        texts=("wikipedia:eval", "bbc_news:test"), contexts=(1024, 2048, 4096, 8192, 16384), max_tokens=32768,
        gaps=(512, 1536, 3584, 7680), passage=256, draws=8, lengths=(1024, 2048, 4096, 8192), depths=(0.1, 0.5, 0.9), trials=10,
        fillers=("repeated", "natural"), filler_text="wikipedia:eval",
    ),
}


def run_grid(model: nn.Module, tokenizer, grid: Grid, seed: int = 0, progress: bool = True) -> dict:
    """Every figure of ``grid`` on ``model``: ``{"grid": settings, "texts": {text: {"tokens",
    "perplexity": {context: ...}, "copy": {gap: ...}}}, "passkey": {filler: ...}, "minutes"}``
    (perplexity entries as :func:`.evaluation.perplexity` returns them, copy entries as
    :func:`.long_range.copy_task` without ``per_draw``, passkey as :func:`.long_range.passkey_task`)."""
    start = time.perf_counter()
    out: dict = {"grid": asdict(grid), "seed": seed, "texts": {}, "passkey": {}}
    for spec in grid.texts:
        ids = evaluation.tokenize(tokenizer, evaluation.load_text(spec))
        entry: dict = {"tokens": int(ids.numel()), "perplexity": {}, "copy": {}}
        prefixes: dict = {}  # longest first: a shorter window at a longer one's start reads its forward
        figures = {ctx: evaluation.perplexity(model, ids, ctx, grid.max_tokens, progress=progress, desc=spec, seed=seed, prefixes=prefixes)
                   for ctx in sorted(set(grid.contexts), reverse=True)}
        entry["perplexity"] = {str(ctx): figures[ctx] for ctx in grid.contexts}
        for gap in grid.gaps:
            r = long_range.copy_task(model, ids, gap=gap, passage=grid.passage, draws=grid.draws, seed=seed, progress=progress)
            r.pop("per_draw")
            entry["copy"][str(gap)] = r
        out["texts"][spec] = entry
    for kind in grid.fillers:
        filler = long_range.natural_filler(tokenizer, evaluation.load_text(grid.filler_text), grid.filler_text) if kind == "natural" else None
        out["passkey"][kind] = long_range.passkey_task(
            model, tokenizer, grid.lengths, grid.depths, grid.trials, seed=seed, progress=progress, filler=filler)
    out["minutes"] = (time.perf_counter() - start) / 60
    out["threads"] = torch.get_num_threads()  # CPU timings depend on it
    return out


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def grid_markdown(result: dict, title: str = "") -> str:
    """Tables of a :func:`run_grid` result: perplexity per text and context, copy per text and gap,
    passkey per filler and length (then per depth), each figure as ``value [lo, hi]``."""
    g = result["grid"]
    lines = [f"# {title}", ""] if title else []
    ctxs, gaps = [str(c) for c in g["contexts"]], [str(x) for x in g["gaps"]]
    texts = result["texts"]
    if ctxs and texts:
        tokens = "max_tokens" in g and g["max_tokens"]
        lines += [f"Perplexity ({tokens or 'all'} predicted tokens per context at most; [lo, hi]: 95% bootstrap interval over windows):", ""]
        rows = [[t] + [fmt(e["perplexity"][c]["perplexity"], e["perplexity"][c]["ci95"]) + f" ({e['perplexity'][c]['windows']} × {c})" for c in ctxs]
                for t, e in texts.items()]
        lines += _table(["text"] + [f"@{c}" for c in ctxs], rows) + [""]
    if gaps and texts:
        lines += [f"Copy (perplexity of the second copy of a {g['passage']}-token passage, first copy in round brackets; "
                  f"{g['draws']} draws; [lo, hi]: over draws):", ""]
        rows = [[t] + [fmt(e["copy"][x]["second"], e["copy"][x]["second_ci95"]) + f" ({e['copy'][x]['first']:.1f})" for x in gaps] for t, e in texts.items()]
        lines += _table(["text"] + [f"gap {x}" for x in gaps], rows) + [""]
    pk = result.get("passkey") or {}
    if pk:
        lens = [str(n) for n in g["lengths"]]
        lines += [f"Passkey (greedy exact match, {g['trials']} trials per depth, mean over depths {', '.join(f'{d:g}' for d in g['depths'])}; "
                  "\"key\": the digits without the answer's leading space token; [lo, hi]: over trials, 0 % and 100 % cells have no spread):", ""]
        rows = []
        for kind, r in pk.items():
            rows.append([r.get("filler", kind)] + [fmt(r["mean"][n], r["mean_ci95"][n], percent=True)
                                                   + f" (key {fmt(r['key_mean'][n], r['key_mean_ci95'][n], percent=True)})" for n in lens])
        lines += _table(["filler"] + [f"@{n}" for n in lens], rows) + [""]
        rows = [[kind, d] + [fmt(r["accuracy"][n][d], r["accuracy_ci95"][n][d], percent=True) for n in lens]
                for kind, r in pk.items() for d in (f"{x:g}" for x in g["depths"])]
        lines += _table(["filler", "depth"] + [f"@{n}" for n in lens], rows) + [""]
    if "minutes" in result:
        lines += [f"{result['minutes']:.1f} min."]
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["GRIDS", "Grid", "grid_markdown", "run_grid"]
