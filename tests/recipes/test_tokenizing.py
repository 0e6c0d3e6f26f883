"""Long texts tokenised in checked pieces (hf_rfa.recipes.tokenizing): the ids of the whole text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_rfa.recipes import evaluation, tokenizing


@pytest.fixture(scope="module")
def text():
    return evaluation.load_text("wikipedia:eval")[:60_000]


def _whole(tok, text):
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


@pytest.mark.parametrize("which", ["smollm2", "gpt2", "minilm"])
def test_pieces_give_the_ids_of_the_whole_text(which, text):
    """Byte-level BPE (SmolLM2, GPT-2) and WordPiece (BERT) on real Wikipedia text, cut every
    ~2,000 characters: the ids equal the whole text's, and the text was really cut."""
    from hf_rfa import assets

    path = {"smollm2": assets.smollm2_path, "gpt2": assets.gpt2_tokenizer_path, "minilm": assets.minilm_path}[which]()
    tok = AutoTokenizer.from_pretrained(path)
    parts = list(tokenizing.pieces(tok, text, piece=2000))
    assert "".join(parts) == text
    assert len(parts) > 20
    assert all(p.startswith("\n") for p in parts[1:])
    assert torch.equal(tokenizing.token_ids(tok, text, piece=2000), _whole(tok, text))


def _prepending_tokenizer():
    """A SentencePiece-style tokenizer that prepends '▁' to every input: a cut changes the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz\n.")}, "▁a": 30, "\n▁": 31}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>")


def test_a_tokenizer_whose_ids_change_at_a_cut_is_not_cut():
    tok = _prepending_tokenizer()
    text = "\n".join(["ab cd."] * 400)
    assert not tokenizing.safe_cut(tok, text, text.index("\n", 100))  # the check does fail here
    parts = list(tokenizing.pieces(tok, text, piece=50))
    assert parts == [text]
    assert torch.equal(tokenizing.token_ids(tok, text, piece=50), _whole(tok, text))


def test_bad_piece_and_short_texts():
    tok = _prepending_tokenizer()
    with pytest.raises(ValueError, match="piece must be >= 1"):
        list(tokenizing.pieces(tok, "abc", piece=0))
    assert tokenizing.token_ids(tok, "").numel() == 0
    assert list(tokenizing.pieces(tok, "ab\ncd", piece=100)) == ["ab\ncd"]


def test_evaluation_tokenize_takes_the_pieces(monkeypatch, text):
    from hf_rfa import assets

    tok = AutoTokenizer.from_pretrained(assets.smollm2_path())
    monkeypatch.setattr(tokenizing, "PIECE", 3000)
    monkeypatch.setattr(tokenizing.token_ids, "__defaults__", (3000,))
    seen = []
    real = tokenizing._ids
    monkeypatch.setattr(tokenizing, "_ids", lambda t, s: seen.append(len(s)) or real(t, s))
    assert torch.equal(evaluation.tokenize(tok, text), _whole(tok, text))
    assert max(seen) < len(text)
