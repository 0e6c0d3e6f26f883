"""The rotary embedding undone inside the op (``random_feature_attention(feature_rope=(cos,
sin))``, what ``RFAConfig(feature_input="unrotated")`` trains with).

Twins: :func:`~hf_rfa.ops.rotary.unrotate` against transformers' rotation (inverse, partial
rotary dims, a scaled rotation); :func:`~hf_rfa.ops.rotary.unrotate_adjoint` against autograd's
vector-Jacobian product of ``unrotate``; the op with ``feature_rope`` against the op with
``feature_q = unrotate(q)``, ``feature_k = unrotate(k)`` — output and every gradient, float32 and
float64, the recomputing hybrid (``HybridFunction``, which un-rotates block by block) and the
autograd form; float64 gradcheck; and the bytes autograd saves: no un-rotated copy of q or k.
"""
import functools

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_rfa
from hf_rfa.ops import attention
from hf_rfa.ops.rotary import unrotate, unrotate_adjoint
from conftest import rel
from tolerances import GRAD_FP32, GRAD_FP64

from test_hybrid_recompute import pytorch_forms_only, small_blocks  # noqa: E402,F401
from test_hybrid_recompute_feature_inputs import _close, _fm, _graph_has, _saved_bytes

B, H, HKV, N, D = 2, 4, 2, 53, 8


def _rope(n=N, dr=D, b=1, dtype=torch.float32, scale=1.0):
    """transformers-style ``cos, sin [b, n, dr]`` (the two halves repeat the frequencies)."""
    inv = 1.0 / (10000 ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return cos.expand(b, n, dr).contiguous(), sin.expand(b, n, dr).contiguous()


@pytest.mark.parametrize("dr,scale", [(D, 1.0), (D // 2, 1.0), (D, 1.3)], ids=["full", "partial-rotary", "scaled"])
def test_unrotate_inverts_transformers_rotation_and_adjoint_is_its_vjp(dr, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    cos, sin = _rope(dr=dr, b=B, dtype=torch.float64, scale=scale)
    rotated = torch.cat([apply_rotary_pos_emb(x[..., :dr], x[..., :dr], cos, sin)[0], x[..., dr:]], dim=-1)
    assert rel(unrotate(rotated, cos, sin), x) < 1e-12
    xl = rotated.clone().requires_grad_()
    up = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    (unrotate(xl, cos, sin) * up).sum().backward()
    assert rel(unrotate_adjoint(up, cos, sin), xl.grad) < 1e-12


def _qk(dtype=torch.float32, seed=0, pad=True, h=H):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (0.7 * torch.randn(B, x, N, D, generator=g, dtype=dtype) for x in (h, HKV, HKV))
    mask = torch.ones(B, N, dtype=torch.bool)
    if pad:
        mask[-1, :5] = False
    return q, k, v, mask


def _run(fm, q, k, v, up, rope, lazy: bool, ckpt: bool = True, **kw):
    """Output and gradients (q, k, v, then every map parameter) of ``(op * up).sum()`` with the
    rotary embedding undone by the op (``lazy``) or by the caller (feature_q/feature_k)."""
    fm.zero_grad()
    q, k, v = leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if lazy:
        out = hf_rfa.random_feature_attention(q, k, v, fm, chunk_size=4, checkpoint_blocks=ckpt, feature_rope=rope, **kw)
    else:
        out = hf_rfa.random_feature_attention(q, k, v, fm, chunk_size=4, checkpoint_blocks=ckpt, feature_q=unrotate(q, *rope), feature_k=unrotate(k, *rope), **kw)
    (out * up).sum().backward()
    return out, [out] + [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in fm.parameters()]


CASES = {  # name: (map, decay, window, sinks, rotary dims, cos/sin batch)
    "hedgehog-mix-decay-W6-S2": ("hedgehog-mix", True, 6, 2, D, 1),
    "favor+-W5-S1-partial-rotary": ("favor+", False, 5, 1, D // 2, B),
    "rfa-gate-W6-S2": ("rfa", False, 6, 2, D, 1),
    "hedgehog-S3": ("hedgehog", False, 0, 3, D, 1),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, GRAD_FP32), (torch.float64, GRAD_FP64)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", list(CASES))
def test_feature_rope_equals_unrotated_feature_inputs(case, dtype, tol, small_blocks):
    """HybridFunction un-rotating block by block = the same Function given the un-rotated q/k
    (and = the autograd form): output and all gradients."""
    name, decay, window, sinks, dr, cb = CASES[case]
    q, k, v, mask = _qk(dtype)
    fm = _fm(name, decay, dtype)
    rope = _rope(dr=dr, b=cb, dtype=dtype)
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    kw = dict(attention_mask=mask, window=window, sinks=sinks)
    out, got = _run(fm, q, k, v, up, rope, True, **kw)
    assert _graph_has(out, "HybridFunction")
    _, want = _run(fm, q, k, v, up, rope, False, **kw)
    _close(got, want, tol)
    _, ref = _run(fm, q, k, v, up, rope, False, ckpt=False, **kw)
    _close(got, ref, tol)
    assert all(float(x.abs().max()) > 0 for x in got[1:4])


def test_feature_rope_without_grad_and_autograd_form_equal_unrotated_inputs():
    """Paths other than the recomputing hybrid un-rotate up front: inference (no grad) and
    ``checkpoint_blocks=False`` give the feature-input result."""
    q, k, v, mask = _qk()
    fm = _fm("hedgehog", True)
    rope = _rope()
    with torch.no_grad():
        got = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=6, sinks=2, feature_rope=rope)
        want = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=6, sinks=2, feature_q=unrotate(q, *rope), feature_k=unrotate(k, *rope))
    assert rel(got, want) < 1e-6
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1))
    _close(_run(fm, q, k, v, up, rope, True, ckpt=False, attention_mask=mask, window=6, sinks=2)[1], _run(fm, q, k, v, up, rope, False, ckpt=False, attention_mask=mask, window=6, sinks=2)[1], GRAD_FP32)


def test_gradcheck_float64(monkeypatch):
    monkeypatch.setattr(attention, "hybrid_attention", functools.partial(attention.hybrid_attention, block_size=4))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 4, generator=g, dtype=torch.float64).requires_grad_() for h in (2, 1, 1))
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, :2] = False
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=4, num_features=4, seed=1, num_heads=2, num_kv_heads=1)
    fm.enable_decay(3.0)
    fm = fm.double()
    rope = _rope(n=11, dr=4, dtype=torch.float64, scale=1.1)

    def f(q, k, v):
        out = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=3, sinks=1, chunk_size=2, feature_rope=rope)
        assert _graph_has(out, "HybridFunction")
        return out[:, :, 2:]

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


def test_saves_no_unrotated_copy():
    """SmolLM2-shaped layer (9 / 3 heads, D 64, Hedgehog m 64 + decay, W 64, 4 sinks, N 1024):
    un-rotating inside saves at least the bytes of an un-rotated q and k less than passing them."""
    b, h, hkv, n, d = 1, 9, 3, 1024, 64
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=d, num_features=64, seed=0, num_heads=h, num_kv_heads=hkv)
    fm.enable_decay(64.0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, x, n, d, generator=g).requires_grad_() for x in (h, hkv, hkv))
    rope = _rope(n=n, dr=d)
    kw = dict(window=64, sinks=4)
    lazy = _saved_bytes(lambda: hf_rfa.random_feature_attention(q, k, v, fm, feature_rope=rope, **kw))
    eager = _saved_bytes(lambda: hf_rfa.random_feature_attention(q, k, v, fm, feature_q=unrotate(q, *rope), feature_k=unrotate(k, *rope), **kw))
    qk = (q.numel() + k.numel()) * 4
    assert eager - lazy >= qk, (eager, lazy, qk)


def test_feature_rope_errors():
    q, k, v, _ = _qk()
    fm = _fm("hedgehog", False)
    cos, sin = _rope()
    with pytest.raises(ValueError, match="either feature_q/feature_k or feature_rope"):
        hf_rfa.random_feature_attention(q, k, v, fm, window=4, feature_rope=(cos, sin), feature_q=q, feature_k=k)
    with pytest.raises(ValueError, match="feature_rope: cos/sin must be"):
        hf_rfa.random_feature_attention(q, k, v, fm, window=4, feature_rope=(cos[:, :10], sin[:, :10]))
    with pytest.raises(ValueError, match="rotary dim 3 must be even"):
        hf_rfa.random_feature_attention(q, k, v, fm, window=4, feature_rope=(cos[..., :3], sin[..., :3]))
    with pytest.raises(ValueError, match="pair of tensors"):
        hf_rfa.random_feature_attention(q, k, v, fm, window=4, feature_rope=cos)
