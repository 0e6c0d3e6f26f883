"""The backend registry (``hf_rfa.ops.backends``): the auto rule, named backends per call and per
config against the ``torch`` autograd forms, refusals, and the debug line naming the backend."""

import importlib
import logging

import pytest
import torch

import hf_rfa
from hf_rfa.ops import backends, random_feature_attention
from hf_rfa.ops.backends import kernels, native
from tiny_models import batch, tiny_model
from tolerances import ORACLE_FP32, PLUMBING_LOGITS

CPU, F32 = torch.device("cpu"), torch.float32


def _qkv(n=150, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, hh, n, d, generator=g) for hh in (h, hkv, hkv))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :7] = 0
    return q, k, v, mask


def _no_grad_backends(causal):
    names = ["inference"] + (["native"] if causal and native.usable(CPU, F32) else [])
    return [pytest.param(n, id=n) for n in names]


@pytest.mark.parametrize("causal,window,sinks", [(True, 0, 0), (True, 24, 3), (False, 0, 0)], ids=["causal", "causal_hybrid", "bidirectional"])
@pytest.mark.parametrize("fm_name", ["favor+", "hedgehog"])
def test_named_backends_match_torch(rel_err, causal, window, sinks, fm_name):
    q, k, v, mask = _qkv()
    fm = hf_rfa.build_feature_map(fm_name, head_dim=16, num_features=32, seed=0, num_heads=4, num_kv_heads=2) if fm_name == "hedgehog" else hf_rfa.build_feature_map(fm_name, head_dim=16, num_features=32, seed=0)
    kw = dict(causal=causal, attention_mask=mask, window=window, sinks=sinks, chunk_size=16)
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, backend="torch", **kw)
        auto = random_feature_attention(q, k, v, fm, **kw)
        assert rel_err(auto, ref) <= ORACLE_FP32
        for name in [p.values[0] for p in _no_grad_backends(causal)]:
            assert rel_err(random_feature_attention(q, k, v, fm, backend=name, **kw), ref) <= ORACLE_FP32, name


def test_auto_rule():
    assert backends.resolve("auto", grad=True, causal=True, device=CPU, dtype=F32) == "torch"
    expected = "native" if native.usable(CPU, F32) else "inference"
    assert backends.resolve("auto", grad=False, causal=True, device=CPU, dtype=F32) == expected
    assert backends.resolve("auto", grad=False, causal=False, device=CPU, dtype=F32) == "inference"  # no bidirectional C++ kernel
    assert backends.resolve("auto", grad=False, causal=True, device=CPU, dtype=torch.float64) == "inference"
    hf_rfa.set_compile(True)
    try:
        assert backends.resolve("auto", grad=False, causal=True, device=CPU, dtype=F32) == "compiled"
        assert backends.resolve("auto", grad=True, causal=True, device=CPU, dtype=F32) == "torch"
    finally:
        hf_rfa.set_compile(False)


def test_refusals_name_the_reason():
    q, k, v, _ = _qkv(n=20)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=8, seed=0)
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'torch', 'inference', 'compiled', 'native', 'flex', 'fla'\]"):
        random_feature_attention(q, k, v, fm, backend="cuda")
    with pytest.raises(ValueError, match="without autograd only"):
        random_feature_attention(q.requires_grad_(), k, v, fm, backend="inference")
    with pytest.raises(ValueError, match="causal attention only"):
        backends.resolve("native", grad=False, causal=False, device=CPU, dtype=F32)
    with pytest.raises(ValueError, match="set_compile"):
        backends.resolve("compiled", grad=False, causal=True, device=CPU, dtype=F32)
    with pytest.raises(ValueError, match="backend must be one of"):
        hf_rfa.RFAConfig(backend="fast")


def test_torch_backend_without_grad_skips_compiled_kernels(monkeypatch):
    """A call that names a backend never runs the opt-in compiled kernels, even when enabled."""
    q, k, v, _ = _qkv(n=40)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=8, seed=0)
    seen = []
    monkeypatch.setattr(kernels, "compiled", lambda fn: seen.append(fn) or fn)
    positive = importlib.import_module("hf_rfa.feature_maps.positive")
    monkeypatch.setattr(positive, "_compiled", lambda fn: seen.append(fn) or fn)  # no real compile here
    hf_rfa.set_compile(True)
    try:
        with torch.no_grad():
            random_feature_attention(q, k, v, fm, backend="torch", chunk_size=8)
            assert seen == []
            random_feature_attention(q, k, v, fm, backend="compiled", chunk_size=8)
            assert seen, "backend='compiled' must reach the compiled kernels"
    finally:
        hf_rfa.set_compile(False)


def test_debug_line_names_the_backend(caplog):
    q, k, v, _ = _qkv(n=20)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=8, seed=0)
    with caplog.at_level(logging.DEBUG, logger="hf_rfa.ops.attention"):
        random_feature_attention(q.requires_grad_(), k, v, fm)
        with torch.no_grad():
            random_feature_attention(q, k, v, fm, causal=False, backend="inference")
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_rfa.ops.attention"]
    assert "random_feature_attention: backend torch (exact band: torch; requested auto)" in lines
    assert "random_feature_attention: backend inference (exact band: inference; requested inference)" in lines


def test_backend_per_config_reaches_every_layer(caplog):
    ids, mask = batch("llama", n=20)
    outs = {}
    for name in ("auto", "torch"):
        model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=4, sinks=1, backend=name))
        assert all(m.backend == name for m in model.modules() if isinstance(m, hf_rfa.hf.attention.RFAAttention))
        with caplog.at_level(logging.DEBUG, logger="hf_rfa.ops.attention"), torch.no_grad():
            caplog.clear()
            outs[name] = model(input_ids=ids, attention_mask=mask).logits
        assert any(f"requested {name}" in r.getMessage() for r in caplog.records)
    assert (outs["auto"] - outs["torch"]).abs().max() <= PLUMBING_LOGITS


def _decode(fm, q, k, v, mask, backend, prefill=50, **kw):
    """A prefill of ``prefill`` tokens then one token at a time by ``continue_attention``."""
    from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention

    b, hkv, n, d = k.shape
    st = DecodeState.empty((b, hkv, d, v.shape[-1], fm.feature_dim), kw.get("sinks", 0), q.dtype)
    outs = []
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, n)]:
        out, st = continue_attention(st, q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1], fm, mask[:, t0:t1], DecodeCall(backend=backend, **kw))
        outs.append(out)
    return torch.cat(outs, dim=2)


def test_decode_honours_the_backend(rel_err, caplog, monkeypatch):
    """generate()'s path (``ops.decode.continue_attention``) takes ``backend=`` as the prefill op
    does: each backend gives the full op's result, the feature scan's backend is logged at DEBUG,
    the same refusals, and a named backend never runs the compiled kernels."""
    q, k, v, mask = _qkv(n=60)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=16, seed=0)
    kw = dict(window=8, sinks=2, chunk_size=16)
    with torch.no_grad():
        full = random_feature_attention(q, k, v, fm, attention_mask=mask, backend="torch", **kw)
    real = mask.bool()[:, None, :, None].expand(full.shape)
    auto = backends.resolve("auto", grad=False, causal=True, device=CPU, dtype=F32)
    for name in ["auto", "torch", "inference"] + (["native"] if native.usable(CPU, F32) else []):
        with caplog.at_level(logging.DEBUG, logger="hf_rfa.ops.decode"), torch.no_grad():
            caplog.clear()
            out = _decode(fm, q, k, v, mask, name, **kw)
        assert rel_err(out[real], full[real]) <= ORACLE_FP32, name
        lines = [r.getMessage() for r in caplog.records if r.name == "hf_rfa.ops.decode"]
        ran = auto if name == "auto" else name
        assert lines == [f"continue_attention: feature scan of 42 key(s) by backend {ran} (requested {name})"], lines
    with pytest.raises(ValueError, match="set_compile"), torch.no_grad():
        _decode(fm, q, k, v, mask, "compiled", **kw)
    with pytest.raises(ValueError, match="without autograd only"):
        _decode(fm, q.clone().requires_grad_(), k, v, mask, "inference", **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        _decode(fm, q, k, v, mask, "cuda", **kw)
    seen = []
    monkeypatch.setattr(kernels, "compiled", lambda fn: seen.append(fn) or fn)
    monkeypatch.setattr(importlib.import_module("hf_rfa.feature_maps.positive"), "_compiled", lambda fn: seen.append(fn) or fn)
    hf_rfa.set_compile(True)
    try:
        with torch.no_grad():
            _decode(fm, q, k, v, mask, "torch", **kw)
            assert seen == []
            _decode(fm, q, k, v, mask, "compiled", **kw)
            assert seen, "backend='compiled' must reach the compiled kernels"
    finally:
        hf_rfa.set_compile(False)
