"""Quality measurements of original and converted checkpoints, and the text they read.

- :func:`perplexity`: causal LMs, standard non-overlapping windows of ``context`` tokens; each
  window predicts its tokens 1..context−1 from the tokens before them *in that window* (no
  sliding stride, no carried state). With ``max_tokens`` a fixed number of windows, evenly spread
  over the text, bounds the time; the returned ``tokens`` is the number of predicted tokens.
- :func:`sentence_embeddings` / :func:`embedding_cosine`: encoders, mean pooling over real
  tokens then L2 normalisation (as sentence-transformers does for all-MiniLM-L6-v2).
- :func:`accuracy`: sequence classifiers on labelled texts.
- Text sources (:func:`load_text`, :func:`load_labelled`): a file path, ``wikipedia:<split>`` /
  ``rotten_tomatoes:<split>`` / ``bbc_news:<split>`` (offline assets, :mod:`hf_rfa.assets`; the
  BBC articles are news, a second held-out domain for causal LMs converted on Wikipedia), or a Hub dataset
  ``<name>[:<config>]:<split>`` (``wikitext:wikitext-2-raw-v1:test``, ``sst2:validation``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import torch
from torch import nn

from .data_files import builder_of, load_local

logger = logging.getLogger(__name__)

_TEXT_COLUMNS = ("text", "sentence", "content")


# --------------------------------------------------------------------------- text sources
_FILE_SUFFIXES = (".txt", ".csv", ".json", ".jsonl", ".tsv", ".md")


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` names a local path rather than a Hub id / dataset (``name[:config]:split``):
    absolute or ``./``/``../``/``~`` relative, a file suffix, or its first component exists here."""
    first = spec.replace("\\", "/").split("/")[0]
    return (
        spec.startswith(("/", "./", "../", "~"))
        or spec.lower().endswith(_FILE_SUFFIXES)
        or ("/" in spec and first not in ("", ".") and os.path.isdir(first))
    )


def check_asset_split(spec: str) -> None:
    """ValueError naming ``spec`` when it is an offline asset (``wikipedia:``, ``rotten_tomatoes:``,
    ``bbc_news:``) with a split the asset does not have; anything else passes."""
    from ..assets.store import BBC_SPLITS, RT_SPLITS, WIKIPEDIA_SPLITS

    name, _, split = spec.partition(":")
    allowed = {"wikipedia": WIKIPEDIA_SPLITS, "rotten_tomatoes": RT_SPLITS, "bbc_news": BBC_SPLITS}.get(name)
    if allowed is not None and not os.path.isfile(spec) and split not in allowed:
        raise ValueError(f"text source {spec!r}: unknown split {split!r}; expected one of {', '.join(f'{name}:{a}' for a in allowed)}")


def _read_file(path: str, newline: str | None = None) -> str:
    """The UTF-8 text of ``path``; ValueError naming the file when it is not UTF-8."""
    try:
        with open(path, encoding="utf-8", newline=newline) as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"text file {path} is not UTF-8 ({e.reason} at byte {e.start})") from None


def _nonempty(spec: str, items):
    if not items:
        raise ValueError(f"text source {spec!r} holds no text")
    return items


def _hub_dataset(spec: str):
    """``name:split`` or ``name:config:split`` → a ``datasets.Dataset`` (needs the Hub or a cache)."""
    from datasets import load_dataset

    if looks_like_path(spec):
        raise ValueError(f"text file {spec!r} not found")
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"text source {spec!r} is not a file, 'wikipedia:<split>', 'rotten_tomatoes:<split>', 'name:split' or 'name:config:split'")
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    return load_dataset(name, config, split=split)


def load_text(spec: str) -> str:
    """One string of running text from a file, an offline asset split or a Hub dataset.

    Raises ValueError for an unknown ``wikipedia:`` split or a dataset without a text column.
    """
    if os.path.isfile(spec):
        if builder_of(spec) == "text":
            if not _read_file(spec).strip():  # also a clear error naming a non-UTF-8 file
                _nonempty(spec, "")
            return "".join(load_local(spec, sample_by="document", what="text file")["text"])
        return "\n".join(_nonempty(spec, load_labelled(spec)[0]))
    check_asset_split(spec)
    if spec.startswith("wikipedia:"):
        from .. import assets

        return "\n\n".join(assets.wikipedia_split(spec.split(":", 1)[1]))
    if spec.startswith("rotten_tomatoes:"):
        return "\n".join(load_labelled(spec)[0])
    if spec.startswith("bbc_news:"):
        from .. import assets

        return "\n\n".join(f"{a['title']}\n{a['text']}" for a in assets.bbc_news(spec.split(":", 1)[1]))
    ds = _hub_dataset(spec)
    col = next((c for c in _TEXT_COLUMNS if c in ds.column_names), None)
    if col is None:
        raise ValueError(f"dataset {spec!r} has no text column (looked for {_TEXT_COLUMNS}; has {ds.column_names})")
    return "\n".join(t for t in ds[col] if t)


def load_labelled(spec: str) -> tuple[list[str], list[int] | None]:
    """Texts and labels (None if the source has none): CSV file (``text[,label]``),
    ``rotten_tomatoes:<train|test>``, ``bbc_news:<train|test>`` (topic labels) or a Hub dataset
    ``name[:config]:split``."""
    if os.path.isfile(spec):
        if builder_of(spec) == "text" and not _read_file(spec).strip():  # also names a non-UTF-8 file
            _nonempty(spec, [])
        try:
            ds = load_local(spec, sample_by="line", what="text file")
        except ValueError as e:
            if "no data" in str(e):  # datasets' words for an empty file
                _nonempty(spec, [])
            raise
        texts, labels = _labelled(ds, spec)
        return _nonempty(spec, texts), labels
    check_asset_split(spec)
    if spec.startswith("rotten_tomatoes:"):
        from .. import assets

        rows = assets.rotten_tomatoes()[spec.split(":", 1)[1]]
        return [r["text"] for r in rows], [int(r["label"]) for r in rows]
    if spec.startswith("wikipedia:"):
        return [p for p in load_text(spec).split("\n") if p.strip()], None
    if spec.startswith("bbc_news:"):
        from .. import assets

        rows = assets.bbc_news(spec.split(":", 1)[1])
        return [r["text"] for r in rows], [int(r["label"]) for r in rows]
    return _labelled(_hub_dataset(spec), spec)


def _labelled(ds, spec: str) -> tuple[list[str], list[int] | None]:
    """Texts (empty ones dropped) and integer labels (None without a ``label`` column) of a dataset."""
    col = next((c for c in _TEXT_COLUMNS if c in ds.column_names), None)
    if col is None:
        raise ValueError(f"dataset {spec!r} has no text column (looked for {_TEXT_COLUMNS}; has {ds.column_names})")
    values = ds[col]
    keep = [i for i, t in enumerate(values) if t is not None and str(t).strip()]
    texts = [values[i] for i in keep]
    if "label" not in ds.column_names:
        return texts, None
    labels = ds["label"]
    return texts, [int(labels[i]) for i in keep]


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids ``[N]`` (long) of a long text, no special tokens added (tokenised in checked
    pieces, the ids of the whole text: :func:`hf_rfa.recipes.tokenizing.token_ids`)."""
    from .tokenizing import token_ids

    return token_ids(tokenizer, text)


def window_starts(n_tokens: int, length: int, count: int | None = None) -> list[int]:
    """Token offsets of :func:`token_windows`' windows of ``length`` in a text of ``n_tokens``."""
    if length < 2:
        raise ValueError(f"context must be >= 2 tokens, got {length}")
    total = n_tokens // length
    if total == 0:
        raise ValueError(f"text has {n_tokens} tokens, fewer than one window of context={length}")
    picks = range(total) if count is None or count >= total else (int(i * total / count) for i in range(count))
    return [s * length for s in picks]


def token_windows(ids: torch.Tensor, length: int, count: int | None = None) -> list[torch.Tensor]:
    """Non-overlapping windows ``[length]`` of ``ids``; with ``count``, that many evenly spread
    over the text (deterministic). ValueError when the text is shorter than one window."""
    return [ids[s : s + length] for s in window_starts(ids.numel(), length, count)]


def shuffled_batches(ids: torch.Tensor, length: int, batch_size: int, seed: int):
    """Endless stream of ``(input_ids [B, length], None)`` from non-overlapping windows, reshuffled
    with a seeded generator at each pass (deterministic)."""
    windows = token_windows(ids, length)
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=g).tolist()
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield torch.stack([windows[j] for j in order[i : i + batch_size]]), None
        if len(order) < batch_size:
            raise ValueError(f"need at least batch_size={batch_size} windows of {length} tokens, have {len(order)}")


# --------------------------------------------------------------------------- causal LMs
#: positions whose log-softmax is taken at once by :func:`token_nll` (float32 [chunk, vocab])
NLL_CHUNK = 256


def token_nll(logits: torch.Tensor, targets: torch.Tensor, chunk: int = NLL_CHUNK) -> torch.Tensor:
    """``-log p(target)`` (float32, shape of ``targets [B, N]``) from ``logits [B, N, V]`` in any
    dtype, ``chunk`` positions at a time: only one chunk's float32 log-softmax exists at once, not
    a float32 copy of all the logits and another of their log-softmax (at 8k tokens and a 49k
    vocabulary, 1.5 GiB each). The same values as ``cross_entropy(logits.float(), reduction="none")``."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, N, V] and targets [B, N], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    targets = targets.to(logits.device)
    out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
    for b in range(logits.shape[0]):
        for i in range(0, logits.shape[1], chunk):
            out[b, i : i + chunk] = torch.nn.functional.cross_entropy(logits[b, i : i + chunk].float(), targets[b, i : i + chunk], reduction="none")
    return out


def next_token_nll(model: nn.Module, x: torch.Tensor, chunk: int = NLL_CHUNK) -> torch.Tensor:
    """``-log p(x[:, t+1] | x[:, :t+1])`` (float32 ``[B, N-1]``) of a causal LM on token ids ``x
    [B, N]``: :func:`token_nll` of the model's logits. For a model whose forward is ``decoder →
    output head`` (:func:`~hf_rfa.recipes.conversion.lm_loss.supports_chunked_loss`) the head runs on
    the decoder's hidden states ``chunk`` positions at a time, so the full ``[B, N, vocab]`` logits
    never exist (at 8k tokens and Llama 3's 128k vocabulary: 2 GiB in bf16); the same values."""
    from .conversion.lm_loss import supports_chunked_loss

    if not supports_chunked_loss(model):
        return token_nll(model(input_ids=x, use_cache=False).logits[:, :-1], x[:, 1:])
    hidden = model.base_model(input_ids=x, use_cache=False).last_hidden_state[:, :-1]
    head = model.get_output_embeddings()
    targets = x[:, 1:].to(hidden.device)
    out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    for i in range(0, hidden.shape[1], chunk):
        logits = head(hidden[:, i : i + chunk])
        out[:, i : i + chunk] = token_nll(logits, targets[:, i : i + chunk], chunk).to(out.device)
    return out


def _prefix_nll(prefixes: dict[int, torch.Tensor] | None, start: int, context: int) -> torch.Tensor | None:
    """The first ``context - 1`` NLLs of a kept forward from ``start`` at least that long, or None."""
    nll = None if prefixes is None else prefixes.get(start)
    return nll[: context - 1] if nll is not None and nll.numel() >= context - 1 else None


def prefix_consistent(model: nn.Module) -> bool:
    """False where a rotary embedding of ``model`` changes with the length (``dynamic`` / ``longrope``):
    a long window's first positions are then not the short window's (no shared ``prefixes``)."""
    from ..hf.rotations import length_dependent

    return not any(length_dependent(m) for m in model.modules() if hasattr(m, "rope_type"))


@torch.no_grad()
def perplexity(
    model: nn.Module,
    ids: torch.Tensor,
    context: int,
    max_tokens: int | None = None,
    progress: bool = True,
    desc: str = "perplexity",
    seed: int = 0,
    prefixes: dict[int, torch.Tensor] | None = None,
) -> dict:
    """Perplexity of ``model`` on token ids ``[N]`` with non-overlapping windows of ``context``.

    Returns ``{"perplexity", "tokens" (predicted), "windows", "context", "ci95", "window_nll",
    "window_tokens"}``: ``ci95`` is the 95% percentile-bootstrap interval over windows
    (:func:`hf_rfa.recipes.intervals.perplexity_ci`, seeded by ``seed``; None for one window),
    ``window_nll`` / ``window_tokens`` each window's NLL sum and predicted tokens, in window order.
    ``max_tokens`` caps the number of windows at ``max(1, max_tokens // context)``, spread evenly
    over the text.

    ``prefixes`` (``{window start: per-token NLL}``, shared by calls on one model and text): a window
    that begins where an earlier call's longer one did reads that forward's first NLLs (a causal
    LM's first positions do not see what follows); ignored where not :func:`prefix_consistent`.
    """
    from tqdm.auto import tqdm

    count = None if max_tokens is None else max(1, max_tokens // context)
    starts = window_starts(ids.numel(), context, count)
    from .conversion import distributed

    model.eval()
    if prefixes is not None and not prefix_consistent(model):
        prefixes = None
    local: dict[int, tuple[float, int]] = {}  # under several processes: this one's windows, gathered below
    for i in tqdm(distributed.window_indices(len(starts)), desc=f"{desc} @{context}", disable=not progress, leave=False):
        nll = _prefix_nll(prefixes, starts[i], context)
        if nll is None:
            nll = next_token_nll(model, ids[starts[i] : starts[i] + context].unsqueeze(0).to(next(model.parameters()).device))[0]
            if prefixes is not None:
                prefixes[starts[i]] = nll
        local[i] = (float(nll.double().sum()), context - 1)
    from .intervals import perplexity_ci

    nll, n = 0.0, 0
    sums = distributed.gather_window_sums(local, len(starts))
    for s, k in sums:  # added in window order: the same sum on 1 or N processes
        nll += s
        n += k
    window_nll, window_tokens = [float(s) for s, _ in sums], [int(k) for _, k in sums]
    return {
        "perplexity": math.exp(nll / n), "tokens": n, "windows": len(starts), "context": context,
        "ci95": perplexity_ci(window_nll, window_tokens, seed=seed), "window_nll": window_nll, "window_tokens": window_tokens,
    }


# --------------------------------------------------------------------------- encoders
def pack_texts(tokenizer, texts: list[str], min_tokens: int) -> list[str]:
    """Consecutive ``texts`` joined by spaces into passages of at least ``min_tokens`` tokens
    (``tokenizer``'s count without special tokens), in order; a shorter remainder at the end is
    dropped. Encoders' long-text evaluation: short lines (Wikipedia's paragraphs and headings)
    become passages much longer than an exact window."""
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"min_tokens must be an int >= 1, got {min_tokens!r}")
    out, cur, n = [], [], 0
    for t in texts:
        cur.append(t.strip())
        n += len(tokenizer(t, add_special_tokens=False)["input_ids"])
        if n >= min_tokens:
            out.append(" ".join(cur))
            cur, n = [], 0
    return out


def _encode(tokenizer, texts: list[str], max_length: int) -> dict:
    return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")


def sentence_batches(tokenizer, texts: list[str], batch_size: int, max_length: int = 128):
    """``(input_ids [B, N], attention_mask [B, N])`` batches of ``texts`` in order (right-padded)."""
    for i in range(0, len(texts), batch_size):
        enc = _encode(tokenizer, texts[i : i + batch_size], max_length)
        yield enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def sentence_embeddings(model: nn.Module, tokenizer, texts: list[str], batch_size: int = 32, max_length: int = 128, progress: bool = True) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings ``[len(texts), hidden]``."""
    from tqdm.auto import tqdm

    model.eval()
    base = getattr(model, "base_model", model)
    out = []
    for ids, mask in tqdm(list(sentence_batches(tokenizer, texts, batch_size, max_length)), desc="embeddings", disable=not progress, leave=False):
        dev = next(model.parameters()).device
        ids, mask = ids.to(dev), mask.to(dev)
        h = base(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        m = mask.unsqueeze(-1).float()
        e = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)
        out.append(torch.nn.functional.normalize(e, dim=-1))
    return torch.cat(out).cpu()


def embedding_cosine(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Cosine between matching rows of two normalised embedding matrices."""
    cos = (reference * other).sum(-1)
    return {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()), "sentences": int(cos.numel())}


@torch.no_grad()
def accuracy(model: nn.Module, tokenizer, texts: list[str], labels: list[int], batch_size: int = 32, max_length: int = 128, progress: bool = True,
             metrics: Sequence[str] = ("accuracy",)) -> dict:
    """Accuracy of a sequence classifier: ``{"accuracy", "examples"}``, and each further metric in
    ``metrics`` (``evaluate`` when it loads, else hf_rfa's offline ``f1`` / ``precision`` / ``recall``:
    :func:`hf_rfa.integrations.metrics.classification_metrics`) on the same predictions."""
    from types import SimpleNamespace

    from tqdm.auto import tqdm

    model.eval()
    preds = []
    for ids, mask in tqdm(list(sentence_batches(tokenizer, texts, batch_size, max_length)), desc="accuracy", disable=not progress, leave=False):
        dev = next(model.parameters()).device
        preds.append(model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits.argmax(-1).cpu())
    pred = torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long)
    gold = torch.tensor(labels[: len(pred)])
    out = {"accuracy": int((pred == gold).sum()) / len(texts), "examples": len(texts)}
    extra = [m for m in metrics if m != "accuracy"]
    if extra and len(pred):
        from ..integrations.metrics import classification_metrics

        num_labels = getattr(getattr(model, "config", None), "num_labels", None)
        scores = classification_metrics(extra, num_labels=num_labels)(SimpleNamespace(predictions=pred.numpy(), label_ids=gold.numpy()))
        out.update({k: v for k, v in scores.items() if k != "accuracy"})
    return out


__all__ = [
    "next_token_nll", "token_nll", "pack_texts", "accuracy", "embedding_cosine", "load_labelled",
    "load_text", "perplexity", "prefix_consistent", "sentence_batches", "sentence_embeddings",
    "shuffled_batches", "token_windows", "tokenize", "window_starts",
]
