"""Token ids of a long text, tokenised in pieces.

A fast tokenizer given a whole text at once builds its full encoding (ids, tokens, offsets, masks)
and the Python list of ids next to it: about 450 bytes per token while it runs (0.3 GiB for the
670k tokens of the Wikipedia training split here; a 100M-token text would need ~45 GB), for ids
that take 8 bytes per token as a tensor. :func:`token_ids` tokenises ``piece`` characters at a
time instead, and gives the same ids as the whole text would.

Where a text may be cut without changing its ids depends on the tokenizer (a byte-level BPE
splits words before a newline; a SentencePiece tokenizer that prepends a space to every input
changes the first token of each piece). So each cut is placed before a newline and *checked*: the
text around it (``context`` characters either side) must tokenise to the same ids whole as in two
parts. A cut that fails is moved to a later newline; after :data:`TRIES` failures the rest of the
text is tokenised whole. Pre-tokenisers split by rules that look a few characters around a
position, so a cut that holds within its context holds in the whole text; the tests compare with
whole-text tokenisation on real text for byte-level BPE (SmolLM2, GPT-2) and WordPiece (BERT).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

#: characters per piece (about 60k tokens of English text)
PIECE = 1 << 18
#: characters either side of a cut that are tokenised to check it
CONTEXT = 2048
#: later newlines tried for a cut before the rest of the text is tokenised whole
TRIES = 8


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def safe_cut(tokenizer, text: str, at: int, context: int = CONTEXT) -> bool:
    """Whether cutting ``text`` at ``at`` leaves its ids unchanged around the cut: the
    ``context`` characters either side tokenise to the same ids whole as in two parts."""
    left, right = text[max(0, at - context) : at], text[at : at + context]
    return _ids(tokenizer, left + right) == _ids(tokenizer, left) + _ids(tokenizer, right)


def pieces(tokenizer, text: str, piece: int = PIECE, context: int = CONTEXT) -> Iterator[str]:
    """``text`` in consecutive pieces of about ``piece`` characters, each cut before a newline that
    :func:`safe_cut` accepts; joined, they are ``text``."""
    if piece < 1:
        raise ValueError(f"piece must be >= 1 character, got {piece}")
    start = 0
    while len(text) - start > piece:
        cut, at = None, start + piece
        for _ in range(TRIES):
            at = text.find("\n", at)
            if at <= start:
                break
            if safe_cut(tokenizer, text, at, context):
                cut = at
                break
            at += 1
        if cut is None:  # no checked cut ahead: the rest whole
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def token_ids(tokenizer, text: str, piece: int = PIECE) -> torch.Tensor:
    """Token ids ``[N]`` (long) of ``text``, no special tokens added, tokenised :func:`pieces` at a
    time: the ids of the whole text, without its whole encoding in memory."""
    # "sequence longer than the maximum" is expected here: silence only the tokenizer loggers (not
    # transformers' global verbosity, which hf_rfa's own logger follows: that would drop its INFO)
    quiet = [logging.getLogger(f"transformers.{m}") for m in ("tokenization_utils_base", "tokenization_utils_tokenizers", "tokenization_python")]
    old = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        parts = [torch.tensor(_ids(tokenizer, p), dtype=torch.long) for p in pieces(tokenizer, text, piece)]
    finally:
        for lg, lvl in zip(quiet, old):
            lg.setLevel(lvl)
    return torch.cat(parts)


__all__ = ["CONTEXT", "PIECE", "TRIES", "pieces", "safe_cut", "token_ids"]
