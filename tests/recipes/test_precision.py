"""Mixed precision of the conversion's training stages (hf_rfa.recipes.conversion.precision):
``train_autocast`` validation and resolution, and attention transfer / LoRA under bf16 autocast
on tiny models against the same runs in float32."""

from __future__ import annotations

import math

import pytest
import torch

import hf_rfa
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import precision, transfer
from hf_rfa.recipes.conversion.config import ConversionConfig
from tiny_models import VOCAB, tiny_model

HYBRID = dict(feature_map="hedgehog", num_features=16, window=4, sinks=1, feature_map_options={"hybrid_mix": True})


def _ids(n=64 * 12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (24,), generator=g)
    return base.repeat(n // 24 + 1)[:n] + torch.randint(0, 2, (n,), generator=g)


def test_bad_train_autocast_is_a_value_error_naming_field_and_choices():
    with pytest.raises(ValueError, match=r"train_autocast must be one of \['auto', 'off', 'bf16'\], got 'fp8'"):
        ConversionConfig(model="m", train_autocast="fp8")
    with pytest.raises(ValueError, match="train_autocast"):
        precision.resolve_autocast("fp16", "cpu")


def test_resolution(monkeypatch):
    assert precision.resolve_autocast("off", "cpu") is None
    assert precision.resolve_autocast("bf16", "cpu") is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    assert precision.resolve_autocast("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: False)
    assert precision.resolve_autocast("auto", "cpu") is None


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n")
    assert not precision.cpu_has_fast_bf16(f)
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert precision.cpu_has_fast_bf16(f)
    assert not precision.cpu_has_fast_bf16(tmp_path / "missing")


def test_autocast_context_casts_linear_layers_only_when_asked():
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with precision.autocast("cpu", torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
    with precision.autocast("cpu", None):
        assert lin(x).dtype == torch.float32


def _lora(dtype):
    torch.manual_seed(0)
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    merged, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2 * 3, lr=1e-2, progress=False, autocast=dtype)
    return merged, res


def test_lora_under_bf16_autocast_tracks_float32():
    m32, r32 = _lora(None)
    m16, r16 = _lora(torch.bfloat16)
    assert r16.as_dict()["autocast"] == "bf16" and "autocast" not in r32.as_dict()
    assert r16.steps == r32.steps == 3 and all(math.isfinite(x) for x in r16.losses)
    # same data and init: bf16 matmuls change the losses by rounding only
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(r16.losses, r32.losses))
    w16, w32 = m16.model.layers[0].self_attn.q_proj.weight, m32.model.layers[0].self_attn.q_proj.weight
    assert w16.dtype == torch.float32  # adapters merged into float32 weights
    assert not torch.equal(w16, w32)  # it did run in another precision


def _transfer(dtype):
    torch.manual_seed(0)
    m = tiny_model("llama")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj")):
                p.mul_(4)
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    res = transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 2, seed=0), tokens=64 * 2 * 20, lr=3e-2, progress=False, autocast=dtype)
    return res


def test_attention_transfer_under_bf16_autocast_learns_like_float32():
    r32, r16 = _transfer(None), _transfer(torch.bfloat16)
    assert r16.as_dict()["autocast"] == "bf16"
    assert all(math.isfinite(x) for x in r16.losses)
    assert r16.losses[-1] < 0.7 * r16.losses[0]  # it learns
    assert r16.losses[-1] < 1.5 * r32.losses[-1]  # and about as well as in float32
