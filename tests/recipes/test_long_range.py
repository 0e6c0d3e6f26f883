"""Long-range evaluators (copy, passkey): structure of the prompts and determinism on a tiny model."""

import pytest
import torch

import hf_rfa
from hf_rfa.recipes import long_range
from tiny_models import tiny_model


class _DigitTokenizer:
    """A stand-in tokenizer: one token per character (digits stay single tokens, like SmolLM2's)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 + 2 for c in text]}


def test_copy_sequences_repeat_the_passage_and_are_seeded():
    ids = torch.arange(5000)
    seqs = long_range.copy_sequences(ids, passage=32, gap=100, draws=4, seed=3)
    assert seqs.shape == (4, 164)
    assert torch.equal(seqs[:, :32], seqs[:, 132:])  # the second copy is the first
    assert not torch.equal(seqs[:, :32], seqs[:, 32:64])
    assert torch.equal(seqs, long_range.copy_sequences(ids, 32, 100, 4, seed=3))
    assert not torch.equal(seqs, long_range.copy_sequences(ids, 32, 100, 4, seed=4))
    with pytest.raises(ValueError, match="needs a text"):
        long_range.copy_sequences(torch.arange(100), 32, 100, 4, 0)
    with pytest.raises(ValueError, match="draws"):
        long_range.copy_sequences(ids, 32, 100, 0, 0)


def test_copy_task_is_deterministic_and_sees_the_first_copy_only_through_attention():
    ids = torch.randint(2, 100, (4000,), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    a = long_range.copy_task(model, ids, gap=40, passage=24, draws=3, skip=4, progress=False)
    b = long_range.copy_task(model, ids, gap=40, passage=24, draws=3, skip=4, progress=False)
    assert a == b and a["length"] == 88 and len(a["per_draw"]) == 3
    # window-only with a window shorter than the gap cannot see the first copy: dropping the first
    # copy's tokens from view changes the second copy's perplexity only through attention
    none = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="none", window=8, sinks=1))
    c = long_range.copy_task(none, ids, gap=40, passage=24, draws=3, skip=4, progress=False)
    assert c["second"] != a["second"]


def test_passkey_prompt_places_the_key_at_the_depth():
    tok = _DigitTokenizer()
    for depth in (0.1, 0.5, 0.9):
        prompt, answer = long_range.passkey_prompt(tok, 2000, depth, "12345")
        assert abs(len(prompt) + len(answer) - 2000) < 200
        needle = tok(" The pass key is 12345")["input_ids"]
        pos = next(i for i in range(len(prompt)) if prompt[i : i + len(needle)].tolist() == needle)
        assert abs(pos / len(prompt) - depth) < 0.1
        assert answer.tolist() == tok(" 12345")["input_ids"]
    with pytest.raises(ValueError, match="too short"):
        long_range.passkey_prompt(tok, 50, 0.5, "12345")


def test_passkey_task_is_deterministic_and_counts_exact_matches():
    tok = _DigitTokenizer()
    model = tiny_model("llama")
    r1 = long_range.passkey_task(model, tok, lengths=[450], depths=[0.5], trials=3, batch_size=2, progress=False)
    r2 = long_range.passkey_task(model, tok, lengths=[450], depths=[0.5], trials=3, batch_size=3, progress=False)
    assert r1["accuracy"] == r2["accuracy"]
    assert 0.0 <= r1["accuracy"]["450"]["0.5"] <= 1.0
    with pytest.raises(ValueError, match="depths"):
        long_range.passkey_task(model, tok, lengths=[450], depths=[1.5], trials=1, progress=False)


class _Oracle(torch.nn.Module):
    """Predicts the next token of its own input (``shift``=1) or a wrong one (``shift``=0)."""

    def __init__(self, shift):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.shift = shift

    def forward(self, input_ids, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1) if self.shift else input_ids * 0 + 1
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, 200).float()})()


@pytest.mark.parametrize("shift,expected", [(1, 1.0), (0, 0.0)])
def test_passkey_accuracy_of_an_oracle_and_of_a_wrong_model(shift, expected):
    r = long_range.passkey_task(_Oracle(shift), _DigitTokenizer(), lengths=[450, 500], depths=[0.1, 0.9], trials=4, progress=False)
    assert all(v == expected for cell in r["accuracy"].values() for v in cell.values())
    assert r["mean"] == {"450": expected, "500": expected} and r["key_mean"] == r["mean"]


class _NoNumberStart(_Oracle):
    """Predicts its input's next token except a space (it never starts the number): holds every
    digit of the key but fails the answer's leading space token."""

    def forward(self, input_ids, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1)
        nxt = torch.where(nxt == _DigitTokenizer()(" ")["input_ids"][0], torch.ones_like(nxt), nxt)
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, 200).float()})()


def test_passkey_key_accuracy_leaves_out_only_the_leading_space_token():
    tok = _DigitTokenizer()
    _, answer = long_range.passkey_prompt(tok, 450, 0.5, "12345")
    assert long_range._leading_space_tokens(tok(" ")["input_ids"], answer) == 1 and len(answer) == 6
    r = long_range.passkey_task(_NoNumberStart(1), tok, lengths=[450], depths=[0.1, 0.9], trials=3, progress=False)
    assert r["accuracy"] == {"450": {"0.1": 0.0, "0.9": 0.0}} and r["key_accuracy"] == {"450": {"0.1": 1.0, "0.9": 1.0}}
    assert r["key_mean"] == {"450": 1.0} and r["mean"] == {"450": 0.0}
    wrong = long_range.passkey_task(_Oracle(0), tok, lengths=[450], depths=[0.5], trials=2, progress=False)
    assert wrong["key_accuracy"] == {"450": {"0.5": 0.0}}

    class Merged(_DigitTokenizer):  # a tokenizer that writes " 12345" without a space token of its own
        def __call__(self, text, add_special_tokens=False):
            ids = super().__call__(text)["input_ids"]
            return {"input_ids": [199] if text == " " else ids}

    assert long_range._leading_space_tokens(Merged()(" ")["input_ids"], answer) == 0


def test_tokenize_keeps_hf_rfa_progress_logging():
    """Tokenizing a long text must not reset hf_rfa's logger (it follows transformers' verbosity):
    a conversion run would otherwise lose its INFO progress lines after the first text."""
    import logging

    from hf_rfa.recipes import evaluation
    from tests_tokenizer import word_tokenizer

    log = logging.getLogger("hf_rfa")
    old = log.level
    log.setLevel(logging.INFO)
    try:
        ids = evaluation.tokenize(word_tokenizer(), "w1 w2 " * 2000)
        assert ids.numel() == 4000 and log.level == logging.INFO
    finally:
        log.setLevel(old)


def test_token_nll_equals_cross_entropy_in_float32_for_any_chunk():
    from hf_rfa.recipes.evaluation import token_nll

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 37, 50, generator=g) * 4
    targets = torch.randint(0, 50, (3, 37), generator=g)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1), reduction="none").view(3, 37)
    for chunk in (1, 5, 37, 256):
        assert torch.equal(token_nll(logits, targets, chunk=chunk), ref)
    low = logits.bfloat16()
    ref16 = torch.nn.functional.cross_entropy(low.float().reshape(-1, 50), targets.reshape(-1), reduction="none").view(3, 37)
    out = token_nll(low, targets, chunk=8)
    assert out.dtype == torch.float32 and torch.equal(out, ref16)
    with pytest.raises(ValueError, match=r"logits must be \[B, N, V\] and targets \[B, N\], got \(3, 37, 50\) and \(3, 36\)"):
        token_nll(logits, targets[:, 1:])


@pytest.mark.parametrize("fam,rfa", [("llama", None), ("llama", "hybrid"), ("gpt2", "hybrid"), ("qwen2", None), ("mistral", "favor+")])
def test_next_token_nll_never_builds_the_full_logits_and_equals_them(fam, rfa):
    """A plain head (lm_loss.PLAIN_HEADS) runs chunk by chunk on the decoder's hidden states: the
    model's forward (which would make [B, N, vocab] logits) is never called, and the values equal
    token_nll of the forward's logits (float32: up to the rounding of a row-chunked matmul). A model
    outside the plain heads keeps its forward."""
    from hf_rfa.recipes.evaluation import next_token_nll, token_nll

    m = tiny_model(fam).eval()
    if rfa == "hybrid":
        hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    elif rfa:
        hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map=rfa, num_features=8))
    x = torch.randint(0, m.config.vocab_size, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = token_nll(m(input_ids=x, use_cache=False).logits[:, :-1], x[:, 1:])
        calls = []
        hook = m.register_forward_pre_hook(lambda *a: calls.append(1))
        for chunk in (1, 7, 256):
            out = next_token_nll(m, x, chunk=chunk)
            assert out.shape == (2, 28) and out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        assert not calls
        other = type("CustomHeadLM", (type(m),), {})  # a class outside PLAIN_HEADS: the model's own forward
        m.__class__ = other
        torch.testing.assert_close(next_token_nll(m, x), ref, rtol=0, atol=0)
        assert len(calls) == 1
        hook.remove()


def test_passkey_reads_only_the_answers_logits_and_scores_as_the_full_logits_do():
    from hf_rfa.recipes import long_range
    from tiny_models import tiny_model

    model = tiny_model("llama").eval()
    x = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=x, use_cache=False).logits
        last = long_range._last_logits(model, x, 4)

        class NoKeep(torch.nn.Module):  # a model without logits_to_keep: all logits, sliced
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, input_ids, use_cache=False):
                return self.m(input_ids=input_ids, use_cache=use_cache)

        plain = long_range._last_logits(NoKeep(), x, 4)
    assert last.shape == (2, 4, full.shape[-1]) and torch.allclose(last, full[:, -4:], atol=1e-6)
    assert torch.equal(plain, full)
    assert torch.equal(long_range._passkey_hits(model, x, 3), long_range._passkey_hits(NoKeep(), x, 3))
