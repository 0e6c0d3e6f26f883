"""Attention transfer and capture (hf_rfa.recipes.conversion.calibration, hf_rfa.recipes.conversion.transfer) on tiny models."""

from __future__ import annotations

import pytest
import torch

import hf_rfa
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import calibration, transfer
from hf_rfa.ops import quadratic_kernel_attention, softmax_attention
from tiny_models import VOCAB, tiny_model
from tolerances import ORACLE_FP32

HYBRID = dict(feature_map="hedgehog", num_features=16, window=4, sinks=1, feature_map_options={"hybrid_mix": True})


def _ids(n=64 * 12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (24,), generator=g)
    return base.repeat(n // 24 + 1)[:n] + torch.randint(0, 2, (n,), generator=g)  # structured, not uniform


def _batches(ids, n=2):
    return [(w.unsqueeze(0), None) for w in evaluation.token_windows(ids, 64, n)]


@pytest.mark.parametrize("fam", ["llama", "gpt2", "bert"])
def test_capture_is_softmax_and_restores_implementation(fam):
    m = tiny_model(fam)
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    ids, mask = torch.randint(2, VOCAB, (2, 20)), torch.ones(2, 20, dtype=torch.long)
    mask[1, :5 if fam != "bert" else 15] = 0 if fam != "bert" else 1
    if fam == "bert":
        mask[1, 15:] = 0
    caps = calibration.capture(m, ids, mask)
    assert m.config._attn_implementation == "rfa"
    assert sorted(caps) == [0, 1]
    c = caps[0]
    ref = softmax_attention(c.q, c.k, c.v, causal=c.causal, attention_mask=c.mask, scale=c.scale)
    real = c.mask[:, None, :, None]
    assert torch.allclose(c.out * real, ref * real, atol=1e-5)
    assert c.causal == (fam != "bert")


def test_twin_equals_op_on_captured_inputs():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    caps = calibration.capture(m, torch.randint(2, VOCAB, (1, 40)))
    rfa = calibration.rfa_layers(m)[1]
    a = calibration.rfa_output(rfa, caps[1])
    b = calibration.rfa_output(rfa, caps[1], differentiable=True)
    assert float((a - b).detach().norm() / b.detach().norm()) < ORACLE_FP32


def test_hybrid_mix_default_off_and_pure_linear_unchanged():
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    plain = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=4, num_heads=4, num_kv_heads=2)
    mixed = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=4, num_heads=4, num_kv_heads=2, hybrid_mix=True, mix_init=2.0)
    assert not hasattr(plain, "mix") and plain.forward_queries(q).log_scale is None
    torch.testing.assert_close(hf_rfa.random_feature_attention(q, k, v, plain), hf_rfa.random_feature_attention(q, k, v, mixed))
    hp = hf_rfa.random_feature_attention(q, k, v, plain, window=3, sinks=1)
    hm = hf_rfa.random_feature_attention(q, k, v, mixed, window=3, sinks=1)
    assert not torch.allclose(hp, hm)  # the mix weighs features against the exact part
    torch.testing.assert_close(hm, quadratic_kernel_attention(q, k, v, mixed, window=3, sinks=1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hybrid_mix"):
        hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=4, hybrid_mix="yes")


def test_init_mixing_reduces_error():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    b = _batches(_ids())
    before = calibration.layer_errors(m, b, progress=False)
    assert transfer.init_mixing(m, calibration.capture(m, *b[0])) == 2
    after = calibration.layer_errors(m, b, progress=False)
    assert all(a.relative_error < 0.8 * x.relative_error for a, x in zip(after, before))


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_transfer_reduces_per_layer_mse_and_trains_only_feature_maps(fam):
    m = tiny_model(fam)
    with torch.no_grad():  # peaked attention, as in real models (random tiny ones are near-uniform)
        for n, p in m.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj", "c_attn")):
                p.mul_(4)
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16))  # pure linear: W alone
    ids = _ids()
    held = _batches(_ids(seed=1))
    base = {k: v.clone() for k, v in m.state_dict().items() if ".rfa." not in k}
    before = calibration.layer_errors(m, held, progress=False)
    res = transfer.attention_transfer(m, evaluation.shuffled_batches(ids, 64, 2, seed=0), tokens=64 * 2 * 40, lr=3e-2, progress=False)
    after = calibration.layer_errors(m, held, progress=False)
    assert res.steps == 40 and res.tokens == 64 * 2 * 40
    assert all(a.relative_error < 0.85 * x.relative_error for a, x in zip(after, before))
    for k, v in m.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k


def test_transfer_is_deterministic():
    outs = []
    for _ in range(2):
        m = tiny_model("llama")
        hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
        r = transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64 * 5, progress=False)
        outs.append((r.losses, [p.detach().clone() for p in transfer.rfa_parameters(m)]))
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_transfer_needs_trainable_map():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="favor+", num_features=16))
    with pytest.raises(ValueError, match="no trainable parameters"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, progress=False)


def test_lora_finetune_returns_merged_converted_model():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    w0 = m.model.layers[0].self_attn.q_proj.weight.clone()
    merged, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2 * 3, lr=1e-2, progress=False)
    assert res.steps == 3 and type(merged).__name__ == "LlamaForCausalLM"
    assert merged.config._attn_implementation == "rfa" and hasattr(merged.model.layers[0].self_attn, "rfa")
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, w0)


def test_transfer_on_last_queries_only():
    m = tiny_model("llama")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj")):
                p.mul_(4)
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16))
    held = _batches(_ids(seed=1))
    before = calibration.layer_errors(m, held, progress=False)
    transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 2, seed=0), tokens=64 * 2 * 40, lr=3e-2, queries=16, progress=False)
    after = calibration.layer_errors(m, held, progress=False)
    assert all(a.relative_error < 0.9 * x.relative_error for a, x in zip(after, before))
