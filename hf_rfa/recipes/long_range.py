"""Long-range evaluations of causal LMs: does anything from beyond the exact window reach the output?

- :func:`copy_task`: a passage of held-out text, ``gap`` tokens of other text, then the same passage
  again; the perplexity of the second copy (from token ``skip`` on) is low only for a model that
  can read the first copy. Seeded draws, deterministic.
- :func:`passkey_task`: a 5-digit key stated once at a given depth of filler text and asked for at
  the end (Mohtashami & Jaggi 2023). Greedy decoding is checked by teacher forcing: greedy
  decoding yields the key exactly when, given the correct key prefix, every key token is the
  argmax — one forward per trial instead of a generation loop, same answer. The filler is one
  block of sentences repeated (``filler="repeated"``, the classic task: every token but the key's
  is trivially predictable) or ordinary held-out text (``filler=NaturalFiller``, :func:`natural_filler`:
  a seeded span of text per trial that ends with a sentence, the key between two sentences).

Every figure carries a 95% percentile-bootstrap interval over draws / trials
(:mod:`hf_rfa.recipes.intervals`). Both take token ids from :func:`hf_rfa.evaluation.tokenize` and
never read the Hub.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from .evaluation import next_token_nll
from .intervals import bootstrap_ci, copy_ci

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
    the mean NLL over all draws), ``"first_ci95"`` / ``"second_ci95"`` (95% percentile-bootstrap
    intervals over the draws, seeded by ``seed``; None for one draw), ``"second_mean_of_draws"``
    (mean of the per-draw perplexities), ``"per_draw"`` second-copy perplexities, and the settings.
    The original SmolLM2-135M scores ~1.3 on the second copy at gap 512; a model that cannot see the
    first copy scores about what it scores on the first.
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
        nll = next_token_nll(model, x)  # [b, L-1]: nll[t] predicts token t+1 (on the head's device: the last of a device map)
        a = slice(skip - 1, passage - 1)  # predicting tokens skip..passage-1 of the first copy
        s0 = passage + gap
        b = slice(s0 + skip - 1, s0 + passage - 1)
        first_nll += nll[:, a].mean(-1).tolist()
        second_nll += nll[:, b].mean(-1).tolist()
    return {
        "first": math.exp(sum(first_nll) / draws),
        "second": math.exp(sum(second_nll) / draws),
        "first_ci95": copy_ci(first_nll, seed=seed), "second_ci95": copy_ci(second_nll, seed=seed),
        "second_mean_of_draws": sum(math.exp(v) for v in second_nll) / draws,
        "per_draw": [math.exp(v) for v in second_nll],
        "gap": gap, "passage": passage, "draws": draws, "skip": skip, "seed": seed, "length": 2 * passage + gap,
    }


#: the filler kinds of :func:`passkey_task` (``natural`` needs a :class:`NaturalFiller`)
PASSKEY_FILLERS = ("repeated", "natural")
#: a natural filler's pieces hold at most this many tokens (a longer sentence is cut into pieces), so
#: that the key lands within half of it of its depth
_PIECE_TOKENS = 64
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclass(frozen=True)
class NaturalFiller:
    """Ordinary text as passkey filler: token ids ``[N]`` of whole sentences, each tokenized with a
    leading space; ``starts``: the positions where a sentence (or a piece of a long one, at most 64
    tokens) begins, where the key may go; ``ends``: the positions just after a sentence's last
    token, where a prompt's filler may end. Built by :func:`natural_filler`."""

    ids: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    source: str = ""


def natural_filler(tokenizer, text: str, source: str = "") -> NaturalFiller:
    """Split ``text`` into sentences (after ``.``/``!``/``?`` and at line breaks), tokenize each
    with a leading space, and keep where each begins. ValueError for a text without words."""
    sentences = [t.strip() for t in _SENTENCE_END.split(text) if t and t.strip()]
    if not sentences:
        raise ValueError(f"passkey filler text {source!r} holds no text")
    ids, starts, ends = [], [], []
    for toks in tokenizer([" " + t for t in sentences], add_special_tokens=False)["input_ids"]:
        for i in range(0, len(toks), _PIECE_TOKENS):
            starts.append(len(ids) + i)
        ids += toks
        ends.append(len(ids))
    return NaturalFiller(*(torch.tensor(v, dtype=torch.long) for v in (ids, starts, ends)), source)


def passkey_prompt(
    tokenizer, length: int, depth: float, key: str, filler: NaturalFiller | None = None, end: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids [L], answer_ids [5-ish])``: about ``length`` tokens with the key sentence at
    fraction ``depth`` of the filler. ``filler``: ordinary text instead of the repeated block — the
    ``room`` tokens of ``filler.ids`` that end at ``end`` (the end of a sentence, which
    :func:`passkey_task` draws: the question follows a whole sentence; the first one may be cut),
    the key sentence at the sentence start nearest to ``depth`` of them; every prompt of one length
    then has the same number of tokens."""
    def enc(t: str) -> list[int]:
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    intro, block, question = enc(PASSKEY_INTRO), enc(" " + PASSKEY_FILLER), enc(" " + PASSKEY_QUESTION)
    needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key.")
    answer = enc(f" {key}")
    room = length - len(intro) - len(question) - len(needle) - len(answer)
    if room < len(block):
        raise ValueError(f"passkey length {length} is too short for the prompt (needs > {length - room + len(block)} tokens)")
    if filler is not None:
        start = end - room
        if start < 0 or end > filler.ids.numel():
            raise ValueError(f"passkey filler text {filler.source!r} has {filler.ids.numel()} tokens: too few for {room} ending at {end}")
        inner = filler.starts[(filler.starts >= start) & (filler.starts <= start + room)] - start
        target = depth * room
        at = int(inner[(inner.double() - target).abs().argmin()]) if inner.numel() else int(round(target))
        span = filler.ids[start : start + room].tolist()
        return torch.tensor(intro + span[:at] + needle + span[at:] + question), torch.tensor(answer)
    reps = room // len(block)
    at = int(round(depth * reps))
    body = block * at + needle + block * (reps - at)
    return torch.tensor(intro + body + question), torch.tensor(answer)


def _filler_ends(filler: NaturalFiller, room: int, trials: int, g: torch.Generator) -> list[int]:
    """``trials`` seeded sentence ends that ``room`` tokens of ``filler`` fit before (``room``: the
    prompt length, more than its filler part)."""
    fit = filler.ends[filler.ends >= room]
    if fit.numel() == 0:
        raise ValueError(f"passkey filler text {filler.source!r} has {filler.ids.numel()} tokens: too few for a prompt of {room}")
    return [int(fit[int(torch.randint(0, fit.numel(), (1,), generator=g))]) for _ in range(trials)]


def passkey_draws(length: int, depth: float, trials: int, seed: int, filler: NaturalFiller | None = None) -> tuple[list[str], list[int]]:
    """The keys and, with a natural ``filler``, the sentence ends (:func:`passkey_prompt`'s ``end``;
    0 otherwise) of one cell of :func:`passkey_task`, from a generator seeded by ``(seed, length, depth)``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + length * 101 + int(round(depth * 100)))
    keys = [str(int(torch.randint(10000, 100000, (1,), generator=g))) for _ in range(trials)]
    ends = _filler_ends(filler, length, trials, g) if filler is not None else [0] * trials
    return keys, ends


@torch.no_grad()
def passkey_task(
    model: nn.Module, tokenizer, lengths=(1024, 2048, 4096, 8192), depths=(0.1, 0.5, 0.9),
    trials: int = 20, seed: int = 0, batch_size: int = 4, progress: bool = True,
    filler: NaturalFiller | None = None,
) -> dict:
    """Accuracy of retrieving a 5-digit pass key (greedy, exact match of every answer token).

    Returns ``{"accuracy": {str(length): {str(depth): acc}}, "mean": {str(length): acc},
    "key_accuracy", "key_mean", "trials", "seed", "depths", "filler"}``, for each of the four
    figures ``<figure>_ci95`` of the same shape: the 95% percentile-bootstrap interval over the
    trials (``mean``: the trials of each depth resampled separately, the depths averaged; seeded
    by ``seed``; None for one trial), and ``hits`` / ``key_hits``: ``{length: {depth: [0 or 1 per
    trial]}}``, from which the intervals are recomputed. Keys are drawn from a generator seeded by ``(seed, length,
    depth)``; with a natural ``filler`` the same generator then draws each trial's span of text.
    ``key_accuracy`` scores the same trials without the answer's leading whitespace token(s) — the
    tokens the answer ``" 71432"`` shares with ``" "`` (SmolLM2's tokenizer writes it as ``" "`` +
    five digits; with a tokenizer that merges the space into the first digit nothing is left out
    and both figures agree): a model that holds the digits but does not start a number after "The
    pass key is" fails ``accuracy`` only.
    """
    from tqdm.auto import tqdm

    _check_positive("trials", trials)
    for dp in depths:
        if not 0.0 <= float(dp) <= 1.0:
            raise ValueError(f"depths must lie in [0, 1], got {dp!r}")
    model.eval()
    dev = _device(model)
    hits: dict[str, dict[str, torch.Tensor]] = {}  # [trials, 2]: (every answer token, the key's tokens)
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    cells = [(n, dp) for n in lengths for dp in depths]
    bar = tqdm(total=len(cells) * trials, desc="passkey" + (" (natural filler)" if filler is not None else ""), disable=not progress, leave=False)
    for n, dp in cells:
        keys, ends = passkey_draws(n, dp, trials, seed, filler)
        rows = []
        for i in range(0, trials, batch_size):
            pairs = [passkey_prompt(tokenizer, n, dp, key, filler, e) for key, e in zip(keys[i : i + batch_size], ends[i : i + batch_size])]
            full = [torch.cat([p, a]) for p, a in pairs]
            leads = [_leading_space_tokens(space, a) for _, a in pairs]
            if len({(len(f), len(a), ld) for f, (_, a), ld in zip(full, pairs, leads)}) == 1:  # the usual case: one batch
                rows.append(_passkey_hits(model, torch.stack(full).to(dev), len(pairs[0][1]), leads[0]))
            else:
                for f, (_, a), ld in zip(full, pairs, leads):
                    rows.append(_passkey_hits(model, f.unsqueeze(0).to(dev), len(a), ld))
            bar.update(len(pairs))
        hits.setdefault(str(n), {})[f"{dp:g}"] = torch.cat(rows)
    bar.close()
    out: dict = {}
    for name, col in (("accuracy", 0), ("key_accuracy", 1)):
        mean_name = "mean" if col == 0 else "key_mean"
        per = {n: {d: h[:, col].double().tolist() for d, h in v.items()} for n, v in hits.items()}
        out[name] = {n: {d: sum(x) / trials for d, x in v.items()} for n, v in per.items()}
        out[mean_name] = {n: sum(v.values()) / len(v) for n, v in out[name].items()}
        out[f"{name}_ci95"] = {n: {d: bootstrap_ci(x, seed=seed) for d, x in v.items()} for n, v in per.items()}
        out[f"{mean_name}_ci95"] = {n: bootstrap_ci(list(v.values()), strata=True, seed=seed) for n, v in per.items()}
        out["hits" if col == 0 else "key_hits"] = {n: {d: [int(x) for x in v] for d, v in c.items()} for n, c in per.items()}
    filler_name = "repeated" if filler is None else "natural" + (f" ({filler.source})" if filler.source else "")
    return {**out, "trials": trials, "seed": seed, "depths": [float(d) for d in depths], "filler": filler_name}


def _leading_space_tokens(space: list[int], answer: torch.Tensor) -> int:
    """How many leading tokens of ``answer`` it shares with ``space`` (the tokens of ``" "``; 0
    when the tokenizer merges the space into the first digit); at most all but one."""
    return min(len(os.path.commonprefix([answer.tolist(), space])), len(answer) - 1)


def _last_logits(model: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    """The logits of the last ``k`` positions of ``x``: only those are computed where the model
    takes ``logits_to_keep`` (transformers' causal LMs; [b, k, vocab] instead of [b, L, vocab]),
    else all of them."""
    import inspect

    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(input_ids=x, use_cache=False, logits_to_keep=k).logits
    return model(input_ids=x, use_cache=False).logits


def _passkey_hits(model: nn.Module, x: torch.Tensor, la: int, lead: int = 0) -> torch.Tensor:
    """``[b, 2]`` (bool): per row of ``x [b, L]``, whether its last ``la`` tokens (the answer) are
    each the argmax given the rest, and whether its answer tokens after the first ``lead`` are."""
    w = x.shape[1]
    logits = _last_logits(model, x, la + 1)[:, -la - 1 : -1]
    ok = logits.argmax(-1).cpu() == x[:, w - la :].cpu()
    return torch.stack([ok.all(-1), ok[:, lead:].all(-1)], dim=1)


__all__ = ["PASSKEY_FILLERS", "NaturalFiller", "copy_sequences", "copy_task", "natural_filler", "passkey_draws", "passkey_prompt", "passkey_task"]
