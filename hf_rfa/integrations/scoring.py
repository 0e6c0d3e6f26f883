"""hf_rfa's own multiple-choice scoring, the reference that lm-eval's scores are tested against.

A document is ``{"context": str, "choices": [str, ...], "gold": int}``. Each choice is scored as
the sum of the log-probabilities of its tokens after the context (the continuation is the
delimiter plus the choice, and the context's trailing spaces move into it, as lm-evaluation-
harness does); the prediction is the argmax (``acc``), or the argmax of the score divided by the
choice's length in characters (``acc_norm``). One sequence per forward pass, no padding.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _check_doc(i: int, doc: dict) -> None:
    choices = doc.get("choices")
    if not isinstance(doc.get("context"), str) or not isinstance(choices, list) or not choices:
        raise ValueError(f"document {i} must hold 'context' (str) and a non-empty 'choices' list, got keys {sorted(doc)}")
    gold = doc.get("gold")
    if not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise ValueError(f"document {i}: gold must be an index into its {len(choices)} choices, got {gold!r}")


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of ``context`` and of ``continuation`` after it (whole string encoded, then split)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def continuation_loglikelihood(model: nn.Module, tokenizer: Any, context: str, continuation: str, max_length: int | None = None) -> float:
    """Sum of ``log p(continuation tokens | context)`` under a causal LM (float64 sum).

    With ``max_length`` the input is left-truncated to its last ``max_length`` tokens.
    """
    ctx, cont = encode_pair(tokenizer, context, continuation)
    if not cont:
        raise ValueError(f"continuation {continuation!r} encodes to no tokens")
    ids = (ctx + cont)[:-1]
    if max_length is not None:
        ids = ids[-max_length:]
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -len(cont):]
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, torch.tensor(cont, device=device)[:, None])[:, 0]
    return float(picked.double().sum())


def score_multiple_choice(model: nn.Module, tokenizer: Any, docs: Sequence[dict], delimiter: str = " ", max_length: int | None = None) -> dict[str, Any]:
    """Accuracy of ``model`` on multiple-choice ``docs`` (see the module docstring).

    Returns ``{"acc", "acc_norm", "n", "loglikelihoods": [[float per choice] per doc],
    "correct": [0/1 per doc], "correct_norm": [0/1 per doc]}``.
    """
    if not docs:
        raise ValueError("docs is empty: nothing to score")
    was_training = model.training
    model.eval()
    lls, correct, correct_norm = [], [], []
    try:
        for i, doc in enumerate(docs):
            _check_doc(i, doc)
            row = [continuation_loglikelihood(model, tokenizer, doc["context"], delimiter + c, max_length) for c in doc["choices"]]
            norm = [ll / len(c) for ll, c in zip(row, doc["choices"])]
            lls.append(row)
            correct.append(int(max(range(len(row)), key=row.__getitem__) == doc["gold"]))
            correct_norm.append(int(max(range(len(norm)), key=norm.__getitem__) == doc["gold"]))
    finally:
        model.train(was_training)
    n = len(docs)
    return {"acc": sum(correct) / n, "acc_norm": sum(correct_norm) / n, "n": n, "loglikelihoods": lls,
            "correct": correct, "correct_norm": correct_norm}


def bootstrap_interval(values: Sequence[float], n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampling documents)."""
    if not values:
        raise ValueError("values is empty: no interval")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(n_boot))
    lo = means[int((1 - level) / 2 * (n_boot - 1))]
    hi = means[int((1 + level) / 2 * (n_boot - 1))]
    return lo, hi


def paired_bootstrap_difference(a: Sequence[float], b: Sequence[float], n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``a − b`` over paired documents and its percentile bootstrap interval."""
    if len(a) != len(b):
        raise ValueError(f"a has {len(a)} values but b has {len(b)}: the differences need paired documents")
    diff = [x - y for x, y in zip(a, b)]
    lo, hi = bootstrap_interval(diff, n_boot, level, seed)
    return sum(diff) / len(diff), lo, hi
