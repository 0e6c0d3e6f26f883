"""The decay of the feature state (``RFAConfig(decay=H)``, ``FeatureMap.enable_decay``).

S_t = γ S_{t−1} + φ(k_t) v_tᵀ, γ = 2^(−1/H) per kv head. Twins: an independent brute-force
weight matrix (exact exp scores in the window and sinks, ``γ^(t−s) φ(q_t)·φ(k_s)`` for the
other visible keys, one row normaliser), the quadratic twin, cached decoding against one full
forward, and parameter gradients against the twin in float64.
"""

import math

import pytest
import torch

import hf_rfa
from hf_rfa.ops import quadratic_kernel_attention
from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention
from conftest import rel
from tolerances import GRAD_FP64, ORACLE_FP32

B, H, HKV, D = 2, 4, 2, 8


def _map(name, half_life, **kw):
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=16, seed=1, num_heads=H, num_kv_heads=HKV, **kw)
    fm.enable_decay(half_life)
    with torch.no_grad():  # a different half-life per kv head
        fm.decay_log_rate.add_(torch.linspace(0.0, 1.0, HKV))
    return fm


def _qkv(n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g, dtype=dtype) for h in (H, HKV, HKV)]


def brute_force(q, k, v, fm, window, sinks, mask=None):
    """Independent twin: the weight matrix built entry by entry from the definition."""
    b, h, n, d = q.shape
    g = h // k.shape[1]
    x = d**-0.25
    fq, fk = fm.forward_queries(q * x), fm.forward_keys(k * x)
    lq = fq.log_scale if fq.log_scale is not None else torch.zeros(fq.phi.shape[:-1], dtype=q.dtype)
    lk = fk.log_scale if fk.log_scale is not None else torch.zeros(fk.phi.shape[:-1], dtype=q.dtype)
    rate = fm.decay_log_rate.exp()  # -log γ per kv head
    out = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        real = [s for s in range(n) if mask is None or bool(mask[bi, s])]
        sink_set = set(real[:sinks])
        for hi in range(h):
            kv = hi // g
            for t in range(n):
                if t not in real:
                    continue
                w = torch.zeros(n, dtype=q.dtype)
                for s in real:
                    if s > t:
                        continue
                    if t - s < window or s in sink_set:
                        w[s] = torch.exp((q[bi, hi, t] * k[bi, kv, s]).sum() / d**0.5)
                    else:
                        # decay over the real positions s+1..t (padding never decays)
                        steps = sum(1 for r in real if s < r <= t)
                        w[s] = (fq.phi[bi, hi, t] @ fk.phi[bi, kv, s]) * torch.exp(lq[bi, hi, t] + lk[bi, kv, s] - steps * rate[kv])
                out[bi, hi, t] = (w @ v[bi, kv]) / w.sum()
    return out


@pytest.mark.parametrize("name,kw", [("favor+", {}), ("hedgehog", {"hybrid_mix": True}), ("elu", {})], ids=["favor+", "hedgehog-mix", "elu"])
@pytest.mark.parametrize("window,sinks", [(0, 0), (4, 2)], ids=["pure", "W4-S2"])
def test_op_matches_brute_force(name, kw, window, sinks):
    n = 23
    q, k, v = _qkv(n)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    fm = _map(name, 6.0, **kw).double()
    want = brute_force(q, k, v, fm, window, sinks, mask)
    got = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks, chunk_size=4)
    real = mask[:, None, :, None].expand_as(want)
    assert rel(got[real], want[real]) <= 1e-10
    twin = quadratic_kernel_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks)
    assert rel(twin[real], want[real]) <= 1e-10


def test_decay_changes_the_output_and_a_long_half_life_does_not():
    """The decay is really applied (a short half-life moves the output; 1e9 tokens is no decay)."""
    n = 40
    q, k, v = _qkv(n, torch.float32)
    plain = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=16, seed=1)
    out0 = hf_rfa.random_feature_attention(q, k, v, plain, causal=True, window=4)
    fast = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=16, seed=1)
    fast.enable_decay(2.0)
    slow = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=16, seed=1)
    slow.enable_decay(1e9)
    assert rel(hf_rfa.random_feature_attention(q, k, v, fast, causal=True, window=4), out0) > 1e-2
    assert rel(hf_rfa.random_feature_attention(q, k, v, slow, causal=True, window=4), out0) <= 1e-5


@pytest.mark.parametrize("splits", [[29], [7], [3, 9], [1]], ids=["one-shot", "prefill7", "3+9", "token-by-token"])
@pytest.mark.parametrize("window,sinks", [(0, 0), (5, 2)], ids=["pure", "W5-S2"])
def test_cached_decoding_matches_full_forward(splits, window, sinks):
    n = 29
    q, k, v = _qkv(n, torch.float32, seed=3)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :4] = False
    fm = _map("favor+", 5.0)
    full = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks, chunk_size=8)
    state = DecodeState.empty((B, HKV, D, D, fm.feature_dim), sinks, torch.float32)
    outs, i = [], 0
    for s in splits + [1] * (n - sum(splits)):
        o, state = continue_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, mask[:, i:i + s], DecodeCall(window=window, sinks=sinks, chunk_size=8))
        outs.append(o)
        i += s
    assert rel(torch.cat(outs, 2), full) <= ORACLE_FP32


@pytest.mark.parametrize("checkpoint", [True, False], ids=["recompute", "autograd"])
@pytest.mark.parametrize("name,kw", [("favor+", {}), ("hedgehog", {"hybrid_mix": True})], ids=["favor+", "hedgehog-mix"])
def test_decay_gradient_matches_twin(name, kw, checkpoint):
    n = 21
    q, k, v = _qkv(n, seed=5)
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, -2:] = False
    fm = _map(name, 4.0, **kw).double()
    g = torch.Generator().manual_seed(9)
    probe = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)

    def grads(fn):
        fm.zero_grad()
        (fn() * probe).sum().backward()
        return fm.decay_log_rate.grad.clone()

    got = grads(lambda: hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, window=3, sinks=1, chunk_size=4, checkpoint_blocks=checkpoint))
    want = grads(lambda: quadratic_kernel_attention(q, k, v, fm, causal=True, attention_mask=mask, window=3, sinks=1))
    assert want.abs().max() > 1e-6  # the decay really moves the loss
    assert rel(got, want) <= GRAD_FP64


def test_enable_decay_initial_half_life_and_bad_values():
    fm = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=16, num_kv_heads=HKV)
    fm.enable_decay(128)
    assert torch.allclose(fm.decay_half_life(), torch.full((HKV,), 128.0, dtype=torch.float32))
    logg, log1mg = fm.log_gate(torch.zeros(1, HKV, 3, D))
    assert torch.allclose(logg, torch.full((1, HKV, 3), -math.log(2) / 128)) and (log1mg == 0).all()
    with pytest.raises(ValueError, match="already has a gate"):
        fm.enable_decay(64)
    for bad in (0, 0.5, -3, float("inf"), float("nan"), True, "64"):
        with pytest.raises(ValueError, match="half-life"):
            hf_rfa.build_feature_map("favor+", head_dim=D, num_features=16).enable_decay(bad)
    with pytest.raises(ValueError, match="'none'"):
        hf_rfa.build_feature_map("none", head_dim=D, num_features=16).enable_decay(64)
    gated = hf_rfa.build_feature_map("rfa", head_dim=D, num_features=16, gate=True)
    with pytest.raises(ValueError, match="already has a gate"):
        gated.enable_decay(64)
    plain_rfa = hf_rfa.build_feature_map("rfa", head_dim=D, num_features=16, num_kv_heads=HKV)
    plain_rfa.enable_decay(32)  # rfa without its gate takes the generic decay
    assert plain_rfa.log_gate(torch.randn(1, HKV, 2, D))[1].abs().max() == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [({"decay": -1.0}, "decay must be"), ({"decay": 0.5}, "decay must be"), ({"decay": True}, "decay must be"),
     ({"decay": "64"}, "decay must be"), ({"decay": float("nan")}, "decay must be"),
     ({"decay": 64.0, "feature_map": "rfa", "gate": True}, "gate"),
     ({"decay": 64.0, "feature_map": "none", "window": 4}, "'none'")],
)
def test_config_refuses_bad_decay(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_rfa.RFAConfig(**kwargs)
