"""Converted models with a decayed feature state (``RFAConfig(decay=H)``): cached decoding with
``RFACache`` equals one full forward, generate() equals recomputation, save/load keeps the learned
decay, attention transfer fits it, and bidirectional models are refused."""

import pytest
import torch

import hf_rfa
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import transfer
from tiny_models import VOCAB, tiny_model
from tolerances import DECODE_LOGITS

SETTINGS = {
    "favor+": dict(feature_map="favor+", num_features=32, window=4, sinks=2, decay=3.0, chunk_size=8),
    "hedgehog": dict(feature_map="hedgehog", num_features=16, window=3, sinks=1, decay=5.0, chunk_size=4, feature_map_options={"hybrid_mix": True}),
}


def _batch(n=26, pad=5):
    ids = torch.randint(2, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_cached_decoding_matches_full_forward(family, setting):
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(**SETTINGS[setting]))
    ids, mask = _batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        plain = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(**{**SETTINGS[setting], "decay": 0.0}))(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        outs, t = [], 0
        for step in (7, 5) + (1,) * (ids.shape[1] - 12):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            t += step
    assert (torch.cat(outs, 1) - full)[mask.bool()].abs().max().item() <= DECODE_LOGITS
    assert (plain - full)[mask.bool()].abs().max().item() > 10 * DECODE_LOGITS  # the decay is used


def test_generate_matches_recompute_and_save_load_keeps_learned_decay(tmp_path):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["favor+"]))
    fm = model.model.layers[1].self_attn.rfa.feature_map
    with torch.no_grad():  # as if trained: no longer the configured half-life
        fm.decay_log_rate.copy_(torch.tensor([0.3, -1.2]))
    ids, mask = _batch(n=14, pad=3)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, use_cache=False)
        assert isinstance(out.cache, hf_rfa.RFACache)
        assert torch.equal(out.sequences, ref)
        beams = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
        assert torch.equal(beams, model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, use_cache=False))
        model.save_pretrained(tmp_path)
        again = hf_rfa.from_pretrained(str(tmp_path), type(model))
        assert torch.equal(again.model.layers[1].self_attn.rfa.feature_map.decay_log_rate, torch.tensor([0.3, -1.2]))
        assert hf_rfa.RFAConfig.from_dict(again.config.rfa_config).decay == 3.0
        assert torch.equal(again(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_bidirectional_model_with_decay_is_refused():
    with pytest.raises(ValueError, match="decay"):
        hf_rfa.convert(tiny_model("bert"), hf_rfa.RFAConfig(window=4, decay=16.0))


def test_attention_transfer_fits_the_decay():
    m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["hedgehog"]))
    fms = [layer.self_attn.rfa.feature_map for layer in m.model.layers]
    before = [fm.decay_log_rate.detach().clone() for fm in fms]
    assert all(any(p is fm.decay_log_rate for p in transfer.rfa_parameters(m)) for fm in fms)
    ids = torch.randint(2, VOCAB, (64 * 6,), generator=torch.Generator().manual_seed(1))
    transfer.attention_transfer(m, evaluation.shuffled_batches(ids, 64, 1, seed=0), tokens=64 * 4, lr=3e-2, progress=False)
    assert all((fm.decay_log_rate - b).abs().max() > 1e-3 for fm, b in zip(fms, before))


def test_lora_can_train_the_decay_end_to_end():
    """``lora_finetune(train_feature_maps=True)``: the decay moves, the merged model is a plain
    converted model (no PEFT wrappers) that carries the trained decay; the default keeps maps frozen."""
    ids = torch.randint(2, VOCAB, (64 * 6,), generator=torch.Generator().manual_seed(2))
    for train_maps in (True, False):
        m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["favor+"]))
        before = m.model.layers[0].self_attn.rfa.feature_map.decay_log_rate.detach().clone()
        merged, res = transfer.lora_finetune(m, evaluation.shuffled_batches(ids, 64, 1, seed=0), 64 * 4, lr=3e-2, progress=False, train_feature_maps=train_maps)
        after = merged.model.layers[0].self_attn.rfa.feature_map.decay_log_rate
        assert res.steps == 4 and not any("lora_" in n or "modules_to_save" in n for n, _ in merged.named_parameters())
        assert ((after - before).abs().max() > 1e-3) == train_maps
    with pytest.raises(ValueError, match="train_feature_maps"):
        transfer.lora_finetune(hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=8)),
                               evaluation.shuffled_batches(ids, 64, 1, seed=0), 64, progress=False, train_feature_maps=True)


def test_init_mixing_accounts_for_the_decay():
    """A decayed feature part carries less mass, so the closed-form mix starts higher; with a
    half-life far beyond the sequence it equals the undecayed init."""
    from hf_rfa.recipes.conversion import calibration

    ids = torch.randint(2, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    mixes = {}
    for hl in (0.0, 1e9, 2.0):
        m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**SETTINGS["hedgehog"], "decay": hl}))
        transfer.init_mixing(m, calibration.capture(m, ids))
        mixes[hl] = torch.cat([layer.self_attn.rfa.feature_map.mix.detach() for layer in m.model.layers])
    assert torch.allclose(mixes[1e9], mixes[0.0], atol=1e-5)
    assert (mixes[2.0] > mixes[0.0] + 0.5).all()


def test_transfer_with_position_offsets():
    """``max_position``: captured q/k come from shifted positions (rotary: different q, the same
    softmax output up to rounding); the run is deterministic and a too-small bound is refused."""
    from hf_rfa.recipes.conversion import calibration

    m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["hedgehog"]))
    ids = torch.randint(2, VOCAB, (1, 32), generator=torch.Generator().manual_seed(6))
    a = calibration.capture(m, ids)[0]
    b = calibration.capture(m, ids, position_ids=torch.arange(32).view(1, -1) + 500)[0]
    assert (a.q - b.q).abs().max() > 1e-2 and torch.allclose(a.out, b.out, atol=1e-4)
    stream = torch.randint(2, VOCAB, (64 * 6,), generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(2):
        mm = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["hedgehog"]))
        r = transfer.attention_transfer(mm, evaluation.shuffled_batches(stream, 64, 1, seed=0), 64 * 3, progress=False, max_position=4096, seed=3)
        runs.append(r.losses)
    plain = transfer.attention_transfer(hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**SETTINGS["hedgehog"])),
                                        evaluation.shuffled_batches(stream, 64, 1, seed=0), 64 * 3, progress=False)
    assert runs[0] == runs[1] and runs[0] != plain.losses
    with pytest.raises(ValueError, match="max_position"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(stream, 64, 1, seed=0), 64, progress=False, max_position=32)
