"""95% confidence intervals of the evaluation figures: a seeded percentile bootstrap.

Every perplexity, copy and passkey figure is a mean over independent units — evaluation windows,
copy draws, passkey trials — and its interval comes from resampling those units with replacement
(:data:`RESAMPLES` times, a generator seeded by ``seed``: the same inputs give the same interval)
and taking the 2.5th and 97.5th percentiles of the resampled statistic:

- **perplexity** (:func:`perplexity_ci`): the units are windows; the statistic is the token-weighted
  mean of the per-window mean NLL (the total NLL over the total predicted tokens of the resampled
  windows), and the bounds are ``exp`` of its percentiles;
- **copy** (:func:`copy_ci`): the units are draws, each the mean NLL over the copy's tokens (equal
  counts); ``exp`` of the percentiles of the mean;
- **passkey** (:func:`bootstrap_ci` on 0/1 hits): the units are trials; the accuracy at one length
  over several depths resamples the trials of each depth separately (``strata``) and averages the
  depths, as the figure does;
- **a ratio of two perplexities on the same windows** (:func:`ratio_ci`, the conversion report's
  "× original"): the windows are resampled once for both models (a paired bootstrap), which is
  narrower than the two models' own intervals suggest, since a hard window is hard for both.

An interval needs at least :data:`MIN_UNITS` units: one window gives none (``None``). The interval
covers the sampling of windows / draws / trials from the held-out text, not the text's choice; with
few units it is rough, and at 0 % or 100 % accuracy every resample agrees, so the interval of a
passkey cell that never (or always) fails is the point itself — read it with its trial count.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

#: bootstrap resamples per interval (a few milliseconds for the grids evaluated here)
RESAMPLES = 10_000
#: the interval's coverage
LEVEL = 0.95
#: fewest units (windows, draws, trials) that give an interval
MIN_UNITS = 2


def _check(resamples: int, level: float) -> None:
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        raise ValueError(f"resamples must be an int >= 1, got {resamples!r}")
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")


def bootstrap_ci(
    values: Sequence[float] | Sequence[Sequence[float]],
    weights: Sequence[float] | Sequence[Sequence[float]] | None = None,
    *,
    strata: bool = False,
    resamples: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> list[float] | None:
    """Percentile-bootstrap interval ``[lo, hi]`` of the (``weights``-weighted) mean of ``values``.

    With ``strata=True`` ``values`` (and ``weights``) are lists of groups: each group is resampled
    within itself and the statistic is the plain mean of the groups' weighted means (the mean
    over passkey depths). ``None`` when fewer than :data:`MIN_UNITS` units (per group) are given.
    Deterministic: the resampled indices come from ``numpy.random.default_rng(seed)``, drawn
    group by group as a ``[resamples, n]`` integer matrix.
    """
    _check(resamples, level)
    groups = [list(g) for g in values] if strata else [list(values)]
    wgroups = [list(g) for g in weights] if (strata and weights is not None) else ([list(weights)] if weights is not None else [None] * len(groups))
    if not groups or len(wgroups) != len(groups):
        raise ValueError(f"weights must match values: {len(wgroups)} groups of weights for {len(groups)} of values")
    if any(len(g) < MIN_UNITS for g in groups):
        return None
    rng = np.random.default_rng(seed)
    stat = np.zeros(resamples)
    for g, w in zip(groups, wgroups):
        v = np.asarray(g, dtype=np.float64)
        wt = np.ones_like(v) if w is None else np.asarray(w, dtype=np.float64)
        if wt.shape != v.shape:
            raise ValueError(f"weights must match values: {wt.shape[0]} weights for {v.shape[0]} values")
        if (wt <= 0).any() or not np.isfinite(v).all():
            raise ValueError("weights must be > 0 and values finite")
        idx = rng.integers(0, v.shape[0], size=(resamples, v.shape[0]))
        stat += (v[idx] * wt[idx]).sum(1) / wt[idx].sum(1)
    stat /= len(groups)
    tail = (1.0 - float(level)) / 2 * 100
    lo, hi = np.percentile(stat, [tail, 100 - tail])
    return [float(lo), float(hi)]


def perplexity_ci(window_nll: Sequence[float], window_tokens: Sequence[int], seed: int = 0, resamples: int = RESAMPLES) -> list[float] | None:
    """Interval of a perplexity over windows: ``window_nll`` are the windows' NLL *sums*,
    ``window_tokens`` their predicted-token counts. Resamples windows, weights each window's mean
    NLL by its tokens (= total NLL / total tokens of the resample), returns ``exp`` of the bounds."""
    if len(window_nll) != len(window_tokens):
        raise ValueError(f"{len(window_nll)} window sums for {len(window_tokens)} token counts")
    means = [s / n for s, n in zip(window_nll, window_tokens)]
    ci = bootstrap_ci(means, window_tokens, seed=seed, resamples=resamples)
    return None if ci is None else [math.exp(ci[0]), math.exp(ci[1])]


def ratio_ci(window_nll: Sequence[float], reference_nll: Sequence[float], window_tokens: Sequence[int], seed: int = 0,
             resamples: int = RESAMPLES) -> list[float] | None:
    """Paired interval of the ratio of two perplexities on the *same* windows (``window_nll`` and
    ``reference_nll``: the two models' NLL sums per window, ``window_tokens`` the windows' predicted
    tokens): the windows are resampled once for both, so what the two share (a hard window is hard
    for both) cancels. ``exp`` of the bounds of the token-weighted mean of the per-window NLL
    difference; the ratio itself is ``exp`` of that mean."""
    if not len(window_nll) == len(reference_nll) == len(window_tokens):
        raise ValueError(f"{len(window_nll)} and {len(reference_nll)} window sums for {len(window_tokens)} token counts: not the same windows")
    diffs = [(a - b) / n for a, b, n in zip(window_nll, reference_nll, window_tokens)]
    ci = bootstrap_ci(diffs, window_tokens, seed=seed, resamples=resamples)
    return None if ci is None else [math.exp(ci[0]), math.exp(ci[1])]


def paired_ratio_ci(row: dict, reference: dict, seed: int = 0) -> list[float] | None:
    """95% interval of ``row``'s perplexity over ``reference``'s, paired over the windows both read
    (:func:`ratio_ci`), for two rows of a conversion report (their ``window_nll`` and
    ``window_tokens``); None where either lacks its windows' sums or they read different windows."""
    a, b = row.get("window_nll"), reference.get("window_nll")
    if not a or not b or len(a) != len(b) or row.get("window_tokens") != reference.get("window_tokens"):
        return None
    return ratio_ci(a, b, row["window_tokens"], seed=seed)


def copy_ci(draw_nll: Sequence[float], seed: int = 0, resamples: int = RESAMPLES) -> list[float] | None:
    """Interval of a copy-task perplexity over draws (``draw_nll``: each draw's mean NLL): ``exp`` of
    the bounds of the mean."""
    ci = bootstrap_ci(list(draw_nll), seed=seed, resamples=resamples)
    return None if ci is None else [math.exp(ci[0]), math.exp(ci[1])]


def fmt(value: float, ci: Sequence[float] | None, spec: str = ".2f", percent: bool = False) -> str:
    """``value [lo, hi]`` (``value`` alone without an interval); ``percent``: ``83% [67%, 100%]``."""
    if percent:
        cell = f"{value:.0%}"
        return cell if not ci else f"{cell} [{ci[0]:.0%}, {ci[1]:.0%}]"
    cell = format(value, spec)
    return cell if not ci else f"{cell} [{format(ci[0], spec)}, {format(ci[1], spec)}]"


__all__ = ["LEVEL", "MIN_UNITS", "RESAMPLES", "bootstrap_ci", "copy_ci", "fmt", "paired_ratio_ci", "perplexity_ci", "ratio_ci"]
