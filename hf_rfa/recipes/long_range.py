"""Long-range evaluations of causal LMs: does anything from beyond the exact window reach the output?

- :func:`copy_task`: a passage of held-out text, ``gap`` tokens of other text, then the same passage
  again; the perplexity of the second copy (from token ``skip`` on) is low only for a model that
  can read the first copy. Seeded draws, deterministic.
- :func:`passkey_task`: a 5-digit key stated once at a given depth of filler text and asked for at
  the end (Mohtashami & Jaggi 2023). Greedy decoding is checked by teacher forcing: greedy
  decoding yields the key exactly when, given the correct key prefix, every key token is the
  argmax — one forward per trial instead of a generation loop, same answer.

Both take token ids from :func:`hf_rfa.evaluation.tokenize` and never read the Hub.
"""

from __future__ import annotations

import logging
import math
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_QUESTION = "What is the pass key? The pass key is"


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_positive(name: str, value: int, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def copy_sequences(ids: torch.Tensor, passage: int, gap: int, draws: int, seed: int) -> torch.Tensor:
    """``[draws, 2*passage + gap]`` sequences: passage, gap text, the same passage.

    Passage and gap are drawn from disjoint, non-overlapping spans of ``ids [N]`` with a generator
    seeded by ``seed`` (deterministic). ValueError when the text is too short.
    """
    for name, value in (("passage", passage), ("gap", gap), ("draws", draws)):
        _check_positive(name, value, 0 if name == "gap" else 1)
    need = passage + gap
    if ids.numel() < 2 * need:
        raise ValueError(f"copy task needs a text of >= {2 * need} tokens (passage={passage}, gap={gap}), got {ids.numel()}")
    g = torch.Generator().manual_seed(seed)
    half = ids.numel() // 2  # passages from the first half, gap text from the second: never overlapping
    rows = []
    for _ in range(draws):
        p = int(torch.randint(0, half - passage + 1, (1,), generator=g))
        q = int(torch.randint(half, ids.numel() - gap + 1, (1,), generator=g))
        text = ids[p : p + passage]
        rows.append(torch.cat([text, ids[q : q + gap], text]))
    return torch.stack(rows)


@torch.no_grad()
def copy_task(
    model: nn.Module, ids: torch.Tensor, gap: int = 512, passage: int = 256, draws: int = 8,
    skip: int = 16, seed: int = 0, batch_size: int = 1, progress: bool = True,
) -> dict:
    """Perplexity of the first and the second copy of a passage separated by ``gap`` tokens.

    Returns ``{"first", "second"}`` (perplexity of tokens ``skip..passage-1`` of each copy: exp of
    the mean NLL over all draws), ``"second_mean_of_draws"`` (mean of the per-draw perplexities),
    ``"per_draw"`` second-copy perplexities, and the settings. The original SmolLM2-135M scores
    ~1.3 on the second copy at gap 512; a model that cannot see the first copy scores about what
    it scores on the first.
    """
    from tqdm.auto import tqdm

    _check_positive("skip", skip, 0)
    if skip >= passage - 1:
        raise ValueError(f"skip must be < passage - 1 = {passage - 1}, got {skip}")
    seqs = copy_sequences(ids, passage, gap, draws, seed)
    model.eval()
    first_nll, second_nll = [], []
    for i in tqdm(range(0, draws, batch_size), desc=f"copy gap {gap}", disable=not progress, leave=False):
        x = seqs[i : i + batch_size].to(_device(model))
        logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[:, :-1].float(), -1)
        nll = -logp.gather(-1, x[:, 1:, None].to(logp.device))[..., 0]  # [b, L-1]: nll[t] predicts token t+1 (logits: the last device of a device map)
        a = slice(skip - 1, passage - 1)  # predicting tokens skip..passage-1 of the first copy
        s0 = passage + gap
        b = slice(s0 + skip - 1, s0 + passage - 1)
        first_nll += nll[:, a].mean(-1).tolist()
        second_nll += nll[:, b].mean(-1).tolist()
    return {
        "first": math.exp(sum(first_nll) / draws),
        "second": math.exp(sum(second_nll) / draws),
        "second_mean_of_draws": sum(math.exp(v) for v in second_nll) / draws,
        "per_draw": [math.exp(v) for v in second_nll],
        "gap": gap, "passage": passage, "draws": draws, "skip": skip, "seed": seed, "length": 2 * passage + gap,
    }


def passkey_prompt(tokenizer, length: int, depth: float, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids [L], answer_ids [5-ish])``: about ``length`` tokens with the key sentence at
    fraction ``depth`` of the filler."""
    def enc(t: str) -> list[int]:
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    intro, filler, question = enc(PASSKEY_INTRO), enc(" " + PASSKEY_FILLER), enc(" " + PASSKEY_QUESTION)
    needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key.")
    answer = enc(f" {key}")
    room = length - len(intro) - len(question) - len(needle) - len(answer)
    if room < len(filler):
        raise ValueError(f"passkey length {length} is too short for the prompt (needs > {length - room + len(filler)} tokens)")
    reps = room // len(filler)
    at = int(round(depth * reps))
    body = filler * at + needle + filler * (reps - at)
    return torch.tensor(intro + body + question), torch.tensor(answer)


@torch.no_grad()
def passkey_task(
    model: nn.Module, tokenizer, lengths=(1024, 2048, 4096, 8192), depths=(0.1, 0.5, 0.9),
    trials: int = 20, seed: int = 0, batch_size: int = 4, progress: bool = True,
) -> dict:
    """Accuracy of retrieving a 5-digit pass key (greedy, exact match of every answer token).

    Returns ``{"accuracy": {str(length): {str(depth): acc}}, "mean": {str(length): acc},
    "key_accuracy", "key_mean", "trials", "seed"}``. Keys are drawn from a generator seeded by
    ``(seed, length, depth)``. ``key_accuracy`` scores the same trials without the answer's
    leading whitespace token(s) — the tokens the answer ``" 71432"`` shares with ``" "``
    (SmolLM2's tokenizer writes it as ``" "`` + five digits; with a tokenizer that merges the space
    into the first digit nothing is left out and both figures agree): a model that holds the digits
    but does not start a number after "The pass key is" fails ``accuracy`` only.
    """
    from tqdm.auto import tqdm

    _check_positive("trials", trials)
    for dp in depths:
        if not 0.0 <= float(dp) <= 1.0:
            raise ValueError(f"depths must lie in [0, 1], got {dp!r}")
    model.eval()
    dev = _device(model)
    acc: dict[str, dict[str, float]] = {}
    key_acc: dict[str, dict[str, float]] = {}
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    cells = [(n, dp) for n in lengths for dp in depths]
    bar = tqdm(total=len(cells) * trials, desc="passkey", disable=not progress, leave=False)
    for n, dp in cells:
        g = torch.Generator().manual_seed(seed * 1_000_003 + n * 101 + int(round(dp * 100)))
        keys = [str(int(torch.randint(10000, 100000, (1,), generator=g))) for _ in range(trials)]
        hits = torch.zeros(2, dtype=torch.long)  # (every answer token, the key's tokens)
        for i in range(0, trials, batch_size):
            pairs = [passkey_prompt(tokenizer, n, dp, key) for key in keys[i : i + batch_size]]
            full = [torch.cat([p, a]) for p, a in pairs]
            leads = [_leading_space_tokens(space, a) for _, a in pairs]
            if len({(len(f), len(a), ld) for f, (_, a), ld in zip(full, pairs, leads)}) == 1:  # the usual case: one batch
                hits += _passkey_hits(model, torch.stack(full).to(dev), len(pairs[0][1]), leads[0])
            else:
                for f, (_, a), ld in zip(full, pairs, leads):
                    hits += _passkey_hits(model, f.unsqueeze(0).to(dev), len(a), ld)
            bar.update(len(pairs))
        acc.setdefault(str(n), {})[f"{dp:g}"] = int(hits[0]) / trials
        key_acc.setdefault(str(n), {})[f"{dp:g}"] = int(hits[1]) / trials
    bar.close()
    mean = {n: sum(v.values()) / len(v) for n, v in acc.items()}
    key_mean = {n: sum(v.values()) / len(v) for n, v in key_acc.items()}
    return {"accuracy": acc, "mean": mean, "key_accuracy": key_acc, "key_mean": key_mean, "trials": trials, "seed": seed, "depths": [float(d) for d in depths]}


def _leading_space_tokens(space: list[int], answer: torch.Tensor) -> int:
    """How many leading tokens of ``answer`` it shares with ``space`` (the tokens of ``" "``; 0
    when the tokenizer merges the space into the first digit); at most all but one."""
    return min(len(os.path.commonprefix([answer.tolist(), space])), len(answer) - 1)


def _passkey_hits(model: nn.Module, x: torch.Tensor, la: int, lead: int = 0) -> torch.Tensor:
    """``[every, key]``: rows of ``x [b, L]`` whose last ``la`` tokens (the answer) are each the
    argmax given the rest, and rows whose answer tokens after the first ``lead`` are."""
    w = x.shape[1]
    logits = model(input_ids=x, use_cache=False).logits[:, w - la - 1 : w - 1]
    ok = logits.argmax(-1).cpu() == x[:, w - la :].cpu()
    return torch.stack([ok.all(-1).sum(), ok[:, lead:].all(-1).sum()])


__all__ = ["copy_sequences", "copy_task", "evaluate_suite", "passkey_prompt", "passkey_task"]
