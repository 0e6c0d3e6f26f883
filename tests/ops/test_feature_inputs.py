"""``feature_q``/``feature_k``: the feature part reads other tensors than the softmax part
(``RFAConfig(feature_input="unrotated")``: q/k before the rotary embedding).

Twins: the quadratic twin with the same feature inputs (an independent weight matrix built from
the definition for the simplest case), the op's autograd and recompute forms, float64 gradients
of every input and map parameter against the twin, and cached decoding against one full forward.
"""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import quadratic_kernel_attention, random_feature_attention
from hf_rfa.ops.decode import DecodeState, continue_attention
from conftest import rel
from tolerances import GRAD_FP64, ORACLE_FP32

B, H, HKV, D = 2, 4, 2, 8


def _map(name, decay=0.0, dtype=torch.float64, **kw):
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=16, seed=3, num_heads=H, num_kv_heads=HKV, **kw).to(dtype)
    if decay:
        fm.enable_decay(decay)
    return fm


def _inputs(n, dtype=torch.float64, seed=0, nq=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v, fq, fk = (torch.randn(B, h, n, D, generator=g, dtype=dtype) for h in (H, HKV, HKV, H, HKV))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :3] = False
    if nq is not None:
        q, fq = q[:, :, -nq:], fq[:, :, -nq:]
    return q, k, v, fq, fk, mask


CASES = [  # (map, map kwargs, decay, causal, window, sinks, nq)
    ("favor+", {}, 0.0, True, 0, 0, None),
    ("favor+", {}, 0.0, True, 6, 2, None),
    ("favor+", {}, 0.0, True, 6, 2, 5),
    ("hedgehog", {"hybrid_mix": True}, 0.0, True, 5, 1, None),
    ("hedgehog", {"hybrid_mix": True}, 12.0, True, 5, 1, None),
    ("hedgehog", {}, 12.0, True, 0, 2, 7),
    ("rfa", {"gate": True}, 0.0, True, 4, 1, None),
    ("favor+", {}, 0.0, False, 0, 0, None),
    ("hedgehog", {"hybrid_mix": True}, 0.0, False, 4, 2, None),
]


@pytest.mark.parametrize("name,kw,decay,causal,window,sinks,nq", CASES)
@pytest.mark.parametrize("checkpoint", [True, False])
def test_op_equals_the_twin_with_feature_inputs(name, kw, decay, causal, window, sinks, nq, checkpoint):
    fm = _map(name, decay, **kw)
    q, k, v, fq, fk, mask = _inputs(29, nq=nq)
    args = dict(causal=causal, attention_mask=mask, window=window, sinks=sinks, feature_q=fq, feature_k=fk)
    out = random_feature_attention(q, k, v, fm, chunk_size=8, checkpoint_blocks=checkpoint, **args)
    ref = quadratic_kernel_attention(q, k, v, fm, **args)
    assert rel(out, ref) <= 1e-12
    plain = quadratic_kernel_attention(q, k, v, fm, causal=causal, attention_mask=mask, window=window, sinks=sinks)
    assert rel(plain, ref) > 1e-3  # the feature inputs are read (not q/k)


def test_float32_fast_paths_equal_the_twin():
    for name, kw, decay, causal, window, sinks, nq in CASES:
        fm = _map(name, decay, dtype=torch.float32, **kw)
        q, k, v, fq, fk, mask = _inputs(70, dtype=torch.float32, nq=nq)
        args = dict(causal=causal, attention_mask=mask, window=window, sinks=sinks, feature_q=fq, feature_k=fk)
        with torch.no_grad():
            out = random_feature_attention(q, k, v, fm, chunk_size=16, **args)
        ref = quadratic_kernel_attention(q.double(), k.double(), v.double(), fm.double(), **{**args, "feature_q": fq.double(), "feature_k": fk.double()})
        fm.float()
        assert rel(out.double(), ref) <= ORACLE_FP32, (name, causal, window)


def test_twin_equals_a_weight_matrix_built_from_the_definition():
    """Causal FAVOR+, window W and no sinks: weight exp(q_t·k_s/√D) for t−W < s ≤ t, else
    φ(fq_t)·φ(fk_s) (with the maps' log scales), one row normaliser."""
    fm = _map("favor+")
    q, k, v, fq, fk, _ = _inputs(17)
    w_ = 4
    x = D**-0.25
    kq = fm.forward_queries(fq * x)
    kk = fm.forward_keys(fk * x)
    g = H // HKV
    phi_q = kq.phi * kq.log_scale.exp().unsqueeze(-1) if kq.log_scale is not None else kq.phi
    phi_k = kk.phi * kk.log_scale.exp().unsqueeze(-1) if kk.log_scale is not None else kk.phi
    feat = phi_q @ phi_k.repeat_interleave(g, 1).transpose(-1, -2)
    exact = torch.exp((q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * D**-0.5)
    t = torch.arange(17).view(-1, 1)
    s = torch.arange(17).view(1, -1)
    w = torch.where((s <= t) & (s > t - w_), exact, torch.where(s <= t - w_, feat, torch.zeros_like(feat)))
    ref = (w @ v.repeat_interleave(g, 1)) / w.sum(-1, keepdim=True)
    out = quadratic_kernel_attention(q, k, v, fm, causal=True, window=w_, feature_q=fq, feature_k=fk)
    assert rel(out, ref) <= 1e-12


def test_feature_inputs_equal_to_q_and_k_change_nothing():
    fm = _map("hedgehog", 8.0, dtype=torch.float32, hybrid_mix=True)
    q, k, v, _, _, mask = _inputs(40, dtype=torch.float32)
    with torch.no_grad():
        a = random_feature_attention(q, k, v, fm, attention_mask=mask, window=5, sinks=2, chunk_size=8)
        b = random_feature_attention(q, k, v, fm, attention_mask=mask, window=5, sinks=2, chunk_size=8, feature_q=q.clone(), feature_k=k.clone())
    assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_gradients_equal_the_twin_float64(checkpoint):
    fm = _map("hedgehog", 6.0, hybrid_mix=True)
    q, k, v, fq, fk, mask = _inputs(23, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, fq, fk)]
    params = list(fm.parameters())
    assert params

    def grads(fn):
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        gs = [x.grad.clone() for x in leaves] + [p.grad.clone() for p in params]
        for x in leaves + params:
            x.grad = None
        return gs

    args = dict(attention_mask=mask, window=4, sinks=1)
    fast = grads(lambda q, k, v, fq, fk: random_feature_attention(q, k, v, fm, chunk_size=8, checkpoint_blocks=checkpoint, feature_q=fq, feature_k=fk, **args))
    twin = grads(lambda q, k, v, fq, fk: quadratic_kernel_attention(q, k, v, fm, feature_q=fq, feature_k=fk, **args))
    for a, b in zip(fast, twin):
        assert rel(a, b) <= GRAD_FP64
    assert all(float(g.abs().max()) > 0 for g in twin[3:5])  # the feature inputs get gradients


@pytest.mark.parametrize("name,kw,decay", [("favor+", {}, 0.0), ("hedgehog", {"hybrid_mix": True}, 9.0), ("rfa", {"gate": True}, 0.0)])
@pytest.mark.parametrize("window,sinks", [(6, 2), (0, 0), (5, 0)])
def test_cached_decoding_equals_one_full_forward(name, kw, decay, window, sinks):
    fm = _map(name, decay, **kw)
    q, k, v, fq, fk, mask = _inputs(41, seed=4)
    full = random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=8, feature_q=fq, feature_k=fk)
    state = DecodeState.empty(B, HKV, D, D, fm.feature_dim, sinks, torch.float64, compute_dtype=torch.float64, feature_keys=True)
    outs, t = [], 0
    for step in (13, 1, 1, 7, 1, 18):
        sl = slice(t, t + step)
        o, state = continue_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], window=window, sinks=sinks,
                                      chunk_size=8, feature_q=fq[:, :, sl], feature_k=fk[:, :, sl])
        outs.append(o)
        t += step
    assert rel(torch.cat(outs, 2), full) <= 1e-12
    assert state.win_kf.shape == (B, HKV, min(window, 41), D)
    plain = DecodeState.empty(B, HKV, D, D, fm.feature_dim, sinks, torch.float64, compute_dtype=torch.float64)
    plain_state = continue_attention(plain, q, k, v, fm, mask, window=window, sinks=sinks, chunk_size=8)[1]
    assert state.nbytes() == plain_state.nbytes() + state.win_kf.numel() * 8  # the kept feature keys, nothing else


def test_nonfinite_feature_key_poisons_later_rows_only():
    fm = _map("favor+", dtype=torch.float32)
    q, k, v, fq, fk, _ = _inputs(20, dtype=torch.float32)
    fk[0, 1, 9, 3] = float("nan")
    with torch.no_grad():
        out = random_feature_attention(q, k, v, fm, window=3, feature_q=fq, feature_k=fk)
    g = H // HKV
    heads = slice(g, 2 * g)
    assert torch.isnan(out[0, heads, 9:]).all() and torch.isfinite(out[0, heads, :9]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, :g]).all()


def test_bad_feature_inputs_are_refused():
    fm = _map("favor+", dtype=torch.float32)
    q, k, v, fq, fk, _ = _inputs(10, dtype=torch.float32)
    with pytest.raises(ValueError, match="feature_q and feature_k go together"):
        random_feature_attention(q, k, v, fm, feature_q=fq)
    with pytest.raises(ValueError, match="feature_k must have the shape"):
        random_feature_attention(q, k, v, fm, feature_q=fq, feature_k=fk[:, :, :4])
    with pytest.raises(ValueError, match="memory"):
        random_feature_attention(q, k, v, fm, window=2, memory=4, feature_q=fq, feature_k=fk)
    with pytest.raises(ValueError, match="feature_q must be a floating"):
        random_feature_attention(q, k, v, fm, feature_q=fq.long(), feature_k=fk)
    plain = DecodeState.empty(B, HKV, D, D, fm.feature_dim, 0, torch.float32)
    with pytest.raises(ValueError, match="feature_keys=True"):
        continue_attention(plain, q, k, v, fm, window=2, feature_q=fq, feature_k=fk)
    keeping = DecodeState.empty(B, HKV, D, D, fm.feature_dim, 0, torch.float32, feature_keys=True)
    with pytest.raises(ValueError, match="feature_keys=True"):
        continue_attention(keeping, q, k, v, fm, window=2)
