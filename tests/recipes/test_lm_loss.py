"""The chunked next-token loss (hf_rfa.recipes.conversion.lm_loss) equals the model's own loss and
gradients, and is used only where the model's forward is the plain head."""

from __future__ import annotations

import pytest
import torch

import hf_rfa
from hf_rfa.recipes.conversion.lm_loss import causal_lm_loss, supports_chunked_loss
from tiny_models import batch, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("converted", [False, True])
def test_chunked_loss_and_gradients_equal_the_models_own(family, converted):
    model = tiny_model(family).eval()  # no dropout: the two forwards see the same network
    if converted:
        hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    ids, mask = batch(family, n=23, b=3)
    labels = ids.masked_fill(mask == 0, -100)
    assert supports_chunked_loss(model)
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    ref_grads = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad])
    for chunk in (1, 5, 512):
        loss = causal_lm_loss(model, ids, mask, labels, chunk=chunk)
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        assert torch.allclose(loss, ref, rtol=1e-6, atol=0), (chunk, float(loss), float(ref))
        worst = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)) for g, r in zip(grads, ref_grads))
        assert worst < 1e-5, (chunk, worst)


def test_only_plain_heads_use_it():
    model = tiny_model("llama")
    assert supports_chunked_loss(model)
    model.loss_function = lambda *a, **k: None  # a custom loss: keep the model's own
    assert not supports_chunked_loss(model)
    assert not supports_chunked_loss(tiny_model("bert"))
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        causal_lm_loss(tiny_model("llama"), *batch("llama")[:1], None, batch("llama")[0], chunk=0)


def test_default_chunk_keeps_each_chunks_float32_logits_within_the_budget(monkeypatch):
    """Without ``chunk``, positions per chunk come from the head's vocabulary and the batch
    (``loss_chunk``): with a budget of 7 positions' logits for batch 1, a batch of 2 runs 3
    positions at a time — the head is called ceil(22 / 3) = 8 times, and the loss is the model's."""
    from hf_rfa.recipes.conversion import lm_loss

    model = tiny_model("llama").eval()
    vocab = model.get_output_embeddings().weight.shape[0]
    assert lm_loss.loss_chunk(49152) == 512 and lm_loss.loss_chunk(128256) == 196 and lm_loss.loss_chunk(49152, 2) == 256 and lm_loss.loss_chunk(10**10) == 1
    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_BYTES", 7 * 4 * vocab)
    assert lm_loss.loss_chunk(vocab, 2) == 3
    ids, mask = batch("llama", n=23, b=2)
    labels = ids.masked_fill(mask == 0, -100)
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    loss = causal_lm_loss(model, ids, mask, labels)
    handle.remove()
    assert calls == [(2, 3, calls[0][2])] * 7 + [(2, 1, calls[0][2])]
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    assert torch.allclose(loss, ref, rtol=1e-6, atol=0)
