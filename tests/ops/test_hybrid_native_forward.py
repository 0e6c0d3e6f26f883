"""The recomputing hybrid's forward with the exact band answered by the C++ kernel
(``HybridSpec.native_band``; backward recomputes the band in PyTorch): outputs and every gradient
against the same Function with the PyTorch band and against the autograd form (the reference twin),
float32 and bf16 inputs, padding, sinks, decay, gates, rotary inputs; the kernel is really called;
``backend="torch"``, float64 and ``torch.compile`` keep the PyTorch band."""

import functools

import pytest
import torch

from hf_rfa.ops import attention
from hf_rfa.ops.hybrid import function as hybrid_recompute
from hf_rfa.ops.backends import native
from tolerances import GRAD_FP32, ORACLE_FP32

from test_hybrid_recompute import B, CASES, D, H, N, _case, _close, _fm, _grads, _inputs

pytestmark = pytest.mark.skipif(native.load() is None, reason="the C++ kernel does not build here")


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(attention, "hybrid_attention", functools.partial(attention.hybrid_attention, block_size=16))


@pytest.fixture
def band_calls(monkeypatch):
    """Counts the C++ band calls made by the hybrid's forward."""
    calls = []
    real = native.causal_band

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(hybrid_recompute.native, "causal_band", spy)
    return calls


def _run(fm, tensors, up, enabled: bool, **kw):
    old = native.native_enabled()
    native.set_native(enabled)
    try:
        return _grads(fm, tensors, up, True, **kw)
    finally:
        native.set_native(old)


@pytest.mark.parametrize("case", list(CASES))
def test_native_band_forward_matches_the_pytorch_band(case, small_blocks, band_calls):
    fm, qkv, up, kw = _case(case)
    want = _run(fm, qkv, up, False, **kw)
    assert band_calls == []
    got = _run(fm, qkv, up, True, **kw)
    assert len(band_calls) == 1  # one call for the whole sequence
    assert (got[0] - want[0]).abs().max() <= ORACLE_FP32 * want[0].abs().max()
    _close(got, want, GRAD_FP32)
    twin = _grads(fm, qkv, up, False, **kw)  # the autograd form
    _close(got, twin, GRAD_FP32)


def test_bf16_inputs_and_rotary_feature_inputs(small_blocks, band_calls):
    """What a converted Llama trains with under autocast: bf16 q/k/v, the feature part reading
    q/k with the rotary embedding undone, a decay, sinks and padding."""
    q, k, v, mask = _inputs()
    q, k, v = (x.bfloat16() for x in (q, k, v))
    pos = torch.arange(N, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)[None]
    rope = (ang.cos(), ang.sin())
    fm = _fm("hedgehog", decay=True)
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=mask, window=6, sinks=2, feature_rope=rope)
    want = _run(fm, (q, k, v), up, False, **kw)
    got = _run(fm, (q, k, v), up, True, **kw)
    assert len(band_calls) == 1 and got[0].dtype == torch.bfloat16
    assert (got[0].float() - want[0].float()).abs().max() <= 1e-2 * want[0].float().abs().max()  # one bf16 rounding of the output
    _close(got[1:], want[1:], GRAD_FP32)  # backward is the same PyTorch recomputation


def test_torch_backend_and_float64_keep_the_pytorch_band(small_blocks, band_calls):
    q, k, v, mask = _inputs()
    fm = _fm("favor+")
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1))
    _run(fm, (q, k, v), up, True, attention_mask=mask, window=6, sinks=2, backend="torch")
    q64, k64, v64 = (x.double() for x in (q, k, v))
    _run(_fm("favor+", dtype=torch.float64), (q64, k64, v64), up.double(), True, attention_mask=mask, window=6, sinks=2)
    assert band_calls == []
