"""LoRA with activation checkpointing (``ConversionConfig.activation_checkpointing``,
``hf-rfa-convert --activation-checkpointing``): the same training, less held for the backward."""

from __future__ import annotations

import pytest
import torch

import hf_rfa
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import memory_plan, transfer
from hf_rfa.recipes.conversion.config import ConversionConfig
from hf_rfa.recipes.conversion.lora import checkpointed_layers
from tiny_models import VOCAB, tiny_model

HYBRID = dict(feature_map="hedgehog", num_features=16, window=4, sinks=1, feature_map_options={"hybrid_mix": True})
RECALL_LIKE = dict(feature_map="hedgehog", num_features=16, window=4, sinks=1, feature_input="unrotated", decay=16)


def _ids(n=64 * 12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (24,), generator=g)
    return base.repeat(n // 24 + 1)[:n] + torch.randint(0, 2, (n,), generator=g)


def _lora(fam, rfa, checkpointing, autocast=None):
    torch.manual_seed(0)
    m = tiny_model(fam)
    if rfa is not None:
        hf_rfa.convert(m, hf_rfa.RFAConfig(**rfa))
    calls = []
    layer = m.get_decoder().layers[0] if fam != "gpt2" else m.transformer.h[0]
    hook = layer.mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # (inside the checkpointed forward)
    torch.manual_seed(1)  # PEFT's adapter initialisation
    merged, res = transfer.lora_finetune(
        m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2 * 3, lr=1e-2, progress=False,
        autocast=autocast, activation_checkpointing=checkpointing,
    )
    hook.remove()
    return merged, res, len(calls)


@pytest.mark.parametrize("fam,rfa", [("llama", HYBRID), ("llama", RECALL_LIKE), ("gpt2", HYBRID), ("qwen2", None)], ids=["llama-hybrid", "llama-unrotated-decay", "gpt2-hybrid", "qwen2-unconverted"])
def test_checkpointed_lora_trains_the_same_weights_and_recomputes_each_layer(fam, rfa):
    """Float32: the same losses and merged weights with and without checkpointing (the recompute is
    the same computation; only the order of a few sums may differ), and each decoder layer's MLP runs
    twice per step instead of once (forward, then again in the backward)."""
    plain, res_p, calls_p = _lora(fam, rfa, False)
    ckpt, res_c, calls_c = _lora(fam, rfa, True)
    assert res_c.steps == res_p.steps == 3
    assert calls_p == 3 and calls_c == 6
    assert res_c.losses == pytest.approx(res_p.losses, rel=1e-6)
    sp, sc = plain.state_dict(), ckpt.state_dict()
    assert sp.keys() == sc.keys()
    for k in sp:
        assert torch.allclose(sc[k], sp[k], rtol=1e-5, atol=1e-6), k
    assert res_c.as_dict()["activation_checkpointing"] is True and "activation_checkpointing" not in res_p.as_dict()
    # switched off again: evaluation and export see the model as it was (no input-grad hook either)
    assert not ckpt.is_activation_checkpointing
    x = torch.randint(2, VOCAB, (1, 8))
    assert not ckpt.get_input_embeddings()(x).requires_grad


def test_checkpointed_lora_under_bf16_autocast_tracks_the_plain_one():
    plain, res_p, _ = _lora("llama", HYBRID, False, autocast=torch.bfloat16)
    ckpt, res_c, _ = _lora("llama", HYBRID, True, autocast=torch.bfloat16)
    assert res_c.losses == pytest.approx(res_p.losses, rel=1e-3)


def test_a_model_already_checkpointing_stays_so_and_an_unsupported_one_is_refused():
    m = tiny_model("llama")
    m.activation_checkpointing_enable()
    with checkpointed_layers(m):
        assert m.is_activation_checkpointing
    assert m.is_activation_checkpointing
    with checkpointed_layers(torch.nn.Linear(2, 2), on=False):
        pass
    with pytest.raises(ValueError, match="activation_checkpointing: Linear does not support"):
        with checkpointed_layers(torch.nn.Linear(2, 2)):
            pass
    with pytest.raises(ValueError, match="activation_checkpointing must be a bool, got 'yes'"):
        ConversionConfig(model="m", activation_checkpointing="yes")


def test_the_plan_holds_each_layer_input_and_one_layer(tmp_path):
    """The LoRA stage's activations: every layer's saved activations without checkpointing; every
    layer's input plus one layer's activations with it. Two more decoder layers add two layers'
    activations without it and two inputs (B·N·hidden at 4 bytes: float32 weights) with it. The
    bf16 autocast copy of float32 weights: all frozen weights without, one decoder layer's and the
    output head's with. Other stages are unchanged."""
    plans = {}
    for layers in (2, 4):
        m = tiny_model("llama")
        m.config.num_hidden_layers = layers
        d = tmp_path / f"llama{layers}"
        m.config.save_pretrained(d)
        base = dict(model=str(d), output="o", calibration_text="c", eval_text="e", lora_context=64, train_autocast="bf16")
        plans[layers] = {c: memory_plan.plan(ConversionConfig(**base, activation_checkpointing=c), runtime_bytes=0) for c in (False, True)}
    hidden = tiny_model("llama").config.hidden_size
    act = {(n, c): p.parts["lora"]["activations"] for n, d in plans.items() for c, p in d.items()}
    assert act[4, True] - act[2, True] == 2 * 64 * hidden * 4
    layer = (act[4, False] - act[2, False]) // 2
    assert layer > 2 * 64 * hidden * 4
    assert act[2, False] - act[2, True] == 2 * layer - (2 * 64 * hidden * 4 + layer)
    for n, d in plans.items():
        assert d[True].parts["lora"]["autocast copy"] < d[False].parts["lora"]["autocast copy"]
        assert d[True].parts["eval"] == d[False].parts["eval"]
        assert d[True].parts.get("transfer") == d[False].parts.get("transfer")


def test_lora_wrapping_does_not_pass_on_peft_deprecation_noise(monkeypatch):
    """PEFT's ``get_peft_model`` reads ``is_gradient_checkpointing``, which transformers >= 5.25
    deprecates with a FutureWarning: ``wrap_with_lora`` (both LoRA stages) drops that one warning,
    and only it. A stand-in for ``get_peft_model`` emits transformers' message, so the filter is
    checked whatever PEFT and transformers do; then the real PEFT wrap passes no such warning on."""
    import warnings

    import peft

    from hf_rfa.recipes.training.peft_utils import lora_config, wrap_with_lora

    message = "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead."

    def noisy_get_peft_model(model, config):
        warnings.warn(message, FutureWarning)
        warnings.warn("another FutureWarning", FutureWarning)
        return model

    def future_warnings(fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        return [str(w.message) for w in caught if w.category is FutureWarning]

    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**HYBRID))
    with monkeypatch.context() as m:
        m.setattr(peft, "get_peft_model", noisy_get_peft_model)
        assert future_warnings(lambda: noisy_get_peft_model(model, None)) == [message, "another FutureWarning"]
        assert future_warnings(lambda: wrap_with_lora(model, None)) == ["another FutureWarning"]
    real = future_warnings(lambda: wrap_with_lora(model, lora_config(model, r=2)))
    assert not [w for w in real if "is_gradient_checkpointing" in w]
