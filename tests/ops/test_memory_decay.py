"""The exact memory with a decaying / gated feature state (``decay=H``, RFA's ``gate=True``):
feature keys weigh exp(G_t − G_s)(1 − g_s) as in the op without memory; the memory and the
window stay exact. Against the quadratic twin (prefill, float64, gradients incl. the decay
rate's) and cached continuation in any split, with both memory scores and with un-rotated
feature inputs."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryCall, MemoryState, continue_memory_attention
from hf_rfa.ops.reference import feature_error_scores, memory_membership, quadratic_kernel_attention
from hf_rfa.ops.rotary import unrotate
from conftest import paired_grads, rel
from tolerances import GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D = 2, 4, 2, 67, 16
SCORES = ["value_norm", "feature_error"]


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, x, N, D, generator=g, dtype=dtype) for x in (H, HKV, HKV))
    v = v * torch.rand(B, HKV, N, 1, generator=g, dtype=dtype) * 3
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :6] = False
    return q, k, v, mask


def _map(kind: str, dtype=torch.float32):
    if kind == "rfa-gate":
        return hf_rfa.build_feature_map("rfa", head_dim=D, num_features=16, seed=0, gate=True, num_heads=H, num_kv_heads=HKV).to(dtype)
    fm = hf_rfa.build_feature_map(kind, head_dim=D, num_features=16, seed=0, num_heads=H, num_kv_heads=HKV)
    fm.enable_decay(6.0)
    with torch.no_grad():  # one rate per kv head, differing
        fm.decay_log_rate.add_(torch.linspace(-0.5, 0.5, fm.decay_log_rate.numel()))
    return fm.to(dtype)


KINDS = ["hedgehog", "favor+", "rfa-gate"]
KW = dict(window=5, sinks=2, memory=4, memory_every=8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("score", SCORES)
def test_op_equals_twin(kind, score):
    q, k, v, mask = _inputs(0)
    fm = _map(kind)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, memory_score=score, **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, memory_score=score, **KW)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    no_mem = quadratic_kernel_attention(q, k, v, fm, True, mask, window=5, sinks=2)
    assert rel(no_mem[real], ref[real]) > 100 * ORACLE_FP32


@pytest.mark.parametrize("kind", ["hedgehog", "rfa-gate"])
def test_float64_and_last_queries(kind):
    q, k, v, mask = _inputs(1, torch.float64)
    fm = _map(kind, torch.float64)
    for score in SCORES:
        ref = quadratic_kernel_attention(q, k, v, fm, True, mask, memory_score=score, **KW)
        out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, memory_score=score, **KW)
        real = mask[:, None, :, None].expand_as(ref)
        assert rel(out[real], ref[real]) <= 1e-12
        tail = hf_rfa.random_feature_attention(q[:, :, -9:], k, v, fm, True, mask, chunk_size=8, memory_score=score, **KW)
        assert rel(tail, ref[:, :, -9:]) <= 1e-12


@pytest.mark.parametrize("kind", ["hedgehog", "rfa-gate"])
def test_gradients_equal_twin_including_the_decay(kind):
    q, k, v, mask = _inputs(2)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    fm = _map(kind)
    params = [p for p in fm.parameters() if p.requires_grad]
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, memory_score="feature_error", **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, memory_score="feature_error", **KW)
    pairs = paired_grads(out, ref, mask, (q, k, v, *params), 3)
    for x, y in pairs:
        assert rel(x, y) <= GRAD_FP32
    if kind == "hedgehog":
        names = [n for n, p in fm.named_parameters() if p.requires_grad]
        assert pairs[3 + names.index("decay_log_rate")][0].abs().sum() > 0  # the decay rate is trained through the memory path


@pytest.mark.parametrize("kind", ["hedgehog", "rfa-gate"])
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("splits", [[19], [3, 9, 20], [1]], ids=["prefill19", "3+9+20", "token-by-token"])
def test_continuation_equals_full_forward(kind, score, splits):
    q, k, v, mask = _inputs(3)
    fm = _map(kind)
    full = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, memory_score=score, **KW)
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32)
    outs, i = [], 0
    with torch.no_grad():
        for s in splits + [1] * (N - sum(splits)):
            sl = slice(i, i + s)
            o, state = continue_memory_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], MemoryCall(chunk_size=8, memory_score=score, **KW))
            outs.append(o)
            i += s
    real = mask[:, None, :, None].expand_as(full)
    assert rel(torch.cat(outs, 2)[real], full[real].detach()) <= ORACLE_FP32
    scores = feature_error_scores(k * D**-0.25, v, fm, mask, 5, 2, 4, 8) if score == "feature_error" else None
    want = memory_membership(v, mask, 5, 2, 4, 8, None, scores)[:, :, -1]
    got = torch.zeros_like(want).scatter_(2, state.mem_pos, state.mem_ok)
    assert torch.equal(got, want)


def test_decay_with_unrotated_inputs_and_memory():
    q, k, v, mask = _inputs(4)
    fm = _map("hedgehog")
    ang = torch.arange(N, dtype=torch.float32)[:, None] * (1.0 / (100.0 ** (torch.arange(0, D, 2) / D)))[None]
    cos, sin = torch.cat([ang] * 2, -1).cos()[None], torch.cat([ang] * 2, -1).sin()[None]
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, feature_rope=(cos, sin), memory_score="feature_error", **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, feature_q=unrotate(q, cos, sin), feature_k=unrotate(k, cos, sin), memory_score="feature_error", **KW)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
