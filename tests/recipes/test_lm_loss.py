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


def _kl_reference(student_logits, teacher_logits, labels):
    """KL(teacher ‖ student) per predicted position, by torch's kl_div, averaged (in the logits' dtype, at least float32)."""
    wide = torch.promote_types(student_logits.dtype, torch.float32)
    s, t = student_logits[:, :-1].to(wide), teacher_logits[:, :-1].to(wide)
    valid = labels[:, 1:] != -100
    per = torch.nn.functional.kl_div(torch.log_softmax(s, -1), torch.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    return per[valid].mean()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_distill_loss_and_gradients_equal_the_full_logits_kl(family):
    """Student: a converted copy; teacher: the original's final hidden states. The chunked KL equals
    torch's kl_div on the full logits, and so do its gradients, at any chunk size; padding is left
    out; a student equal to its teacher scores 0. In float64, so that the comparison is of the
    algebra: in float32 the head's matmul rounds differently for different chunk shapes, by about
    4e-8 on this KL of 1.5e-3 (machine-dependent)."""
    from hf_rfa.recipes.conversion.lm_loss import distill_loss

    teacher = tiny_model(family).double().eval()
    student = tiny_model(family).double().eval()
    student.load_state_dict(teacher.state_dict())
    ids, mask = batch(family, n=23, b=3)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        t_hidden = teacher.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        t_logits = teacher(input_ids=ids, attention_mask=mask, use_cache=False).logits
    same = distill_loss(student, ids, mask, labels, t_hidden, chunk=5)
    assert abs(float(same.detach())) < 1e-6
    hf_rfa.convert(student, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    params = [p for p in student.parameters() if p.requires_grad]
    ref = _kl_reference(student(input_ids=ids, attention_mask=mask, use_cache=False).logits, t_logits, labels)
    assert float(ref) > 1e-4  # the conversion does change the predictions
    ref_grads = torch.autograd.grad(ref, params)
    for chunk in (1, 5, 512):
        loss = distill_loss(student, ids, mask, labels, t_hidden, chunk=chunk)
        grads = torch.autograd.grad(loss, params)
        assert loss.dtype == torch.float64
        assert torch.allclose(loss, ref, rtol=1e-10, atol=0), (chunk, float(loss), float(ref))
        worst = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)) for g, r in zip(grads, ref_grads))
        assert worst < 1e-10, (chunk, worst)
    with pytest.raises(ValueError, match="teacher_hidden must have the student's hidden shape"):
        distill_loss(student, ids, mask, labels, t_hidden[:, :-1])
