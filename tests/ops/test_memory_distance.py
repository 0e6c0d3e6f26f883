"""The exact memory read at a clamped rotary distance (``memory_distance`` Δ with ``memory_rope``, the
rotation of position Δ): a memory key more than Δ positions behind its query scores as if Δ behind.

Checked against the rotary embedding itself (a query rotated at t against a key rotated at t − Δ),
against the quadratic twin (which turns the key back where the op turns the query forward) in
prefill, gradients and cached continuation, and the period-parallel form against the sequential."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryCall, MemoryState, continue_memory_attention
from hf_rfa.ops.reference import quadratic_kernel_attention
from hf_rfa.ops.rotary import far_queries, unrotate
from conftest import paired_grads, rel
from tolerances import GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D = 2, 4, 2, 61, 16
DELTA = 12
SCORES = ["value_norm", "feature_error"]


def _tables(n: int, dr: int, scale: float, dtype=torch.float32):
    """cos/sin ``[n, dr]`` of positions 0..n−1 in transformers' convention, times ``scale``."""
    inv = 1.0 / (100.0 ** (torch.arange(0, dr, 2, dtype=dtype) / dr))
    ang = torch.cat([torch.arange(n, dtype=dtype)[:, None] * inv[None]] * 2, -1)
    return ang.cos() * scale, ang.sin() * scale


def _rotate(x, cos, sin):
    dr = cos.shape[-1]
    x1, x2 = x[..., : dr // 2], x[..., dr // 2 : dr]
    out = x[..., :dr] * cos + torch.cat([-x2, x1], -1) * sin
    return torch.cat([out, x[..., dr:]], -1)


@pytest.mark.parametrize("dr,scale", [(D, 1.0), (D, 1.3), (8, 1.0)], ids=["full", "scaled", "partial"])
def test_far_queries_score_as_a_key_rotated_delta_behind(dr, scale):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, D, generator=g, dtype=torch.float64), torch.randn(2, 5, D, generator=g, dtype=torch.float64)
    cos, sin = _tables(300, dr, scale, torch.float64)
    for t in (40, 97, 299):
        want = (_rotate(q, cos[t], sin[t]) * _rotate(k, cos[t - DELTA], sin[t - DELTA])).sum(-1)
        got = (far_queries(q, (cos[DELTA], sin[DELTA])) * k).sum(-1)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)  # float64: the two forms round differently
        true = (_rotate(q, cos[t], sin[t]) * _rotate(k, cos[3], sin[3])).sum(-1)
        assert not torch.allclose(got, true, atol=1e-3)  # the true distance scores otherwise


def _inputs(seed: int, dtype=torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    fq, fk, v = (torch.randn(B, x, N, D, generator=g, dtype=dtype) for x in (H, HKV, HKV))
    v = v * torch.rand(B, HKV, N, 1, generator=g, dtype=dtype) * 3
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :6] = False
    cos, sin = _tables(N, D, scale, dtype)
    q, k = _rotate(fq, cos, sin), _rotate(fk, cos, sin)
    return q, k, v, mask, fq, fk, (cos[DELTA], sin[DELTA])


def _map(dtype=torch.float32):
    return hf_rfa.build_feature_map("hedgehog", head_dim=D, num_features=16, seed=0).to(dtype)


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("scale", [1.0, 1.3], ids=["plain", "scaled"])
def test_op_equals_twin(score, scale):
    q, k, v, mask, fq, fk, far = _inputs(0, scale=scale)
    fm = _map()
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score, feature_q=fq, feature_k=fk)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, memory_distance=DELTA, memory_rope=far, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, memory_distance=DELTA, memory_rope=far, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    true = quadratic_kernel_attention(q, k, v, fm, True, mask, **kw)
    assert rel(true[real], ref[real]) > 100 * ORACLE_FP32  # the clamp changes the memory's scores
    wide = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, memory_distance=N, memory_rope=far, **kw)
    plain = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **kw)
    assert torch.equal(wide, plain)  # no key is further than N: the true distances, bit for bit


@pytest.mark.parametrize("score", SCORES)
def test_float64_last_queries_and_gradients(score):
    q, k, v, mask, fq, fk, far = _inputs(1, torch.float64)
    fm = _map(torch.float64)
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score, memory_distance=DELTA, memory_rope=far)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, feature_q=fq, feature_k=fk, **kw)
    tail = hf_rfa.random_feature_attention(q[:, :, -9:], k, v, fm, True, mask, chunk_size=8, feature_q=fq[:, :, -9:], feature_k=fk, **kw)
    assert rel(tail, ref[:, :, -9:]) <= 1e-12
    q, k, v, mask, fq, fk, far = _inputs(2)
    fq, fk, v = (x.clone().requires_grad_(True) for x in (fq, fk, v))
    cos, sin = _tables(N, D, 1.0)
    fm = _map()
    params = [p for p in fm.parameters() if p.requires_grad]
    kw["memory_rope"] = far
    # the graph runs through the rotation, as in a model (one rotation per call: each graph is freed after its backward)
    out = hf_rfa.random_feature_attention(_rotate(fq, cos, sin), _rotate(fk, cos, sin), v, fm, True, mask, chunk_size=8, feature_q=fq, feature_k=fk, **kw)
    ref = quadratic_kernel_attention(_rotate(fq, cos, sin), _rotate(fk, cos, sin), v, fm, True, mask, feature_q=fq, feature_k=fk, **kw)
    for x, y in paired_grads(out, ref, mask, (fq, fk, v, *params), 3):
        assert rel(x, y) <= GRAD_FP32


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("splits", [[17], [3, 9, 20], [1]], ids=["prefill17", "3+9+20", "token-by-token"])
def test_continuation_equals_full_forward(score, splits):
    q, k, v, mask, fq, fk, far = _inputs(3)
    fm = _map()
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score)
    full = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, feature_q=fq, feature_k=fk, memory_distance=DELTA, memory_rope=far, **kw)
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32, feature_keys=True)
    settings = MemoryCall(chunk_size=8, distance=DELTA, far_rope=far, **kw)
    outs, i = [], 0
    for s in splits + [1] * (N - sum(splits)):
        sl = slice(i, i + s)
        o, state = continue_memory_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], settings, (fq[:, :, sl], fk[:, :, sl]))
        outs.append(o)
        i += s
    real = mask[:, None, :, None].expand_as(full)
    assert rel(torch.cat(outs, 2)[real], full[real]) <= ORACLE_FP32


def test_bad_settings_are_refused_in_one_line():
    q, k, v, mask, fq, fk, far = _inputs(4)
    fm = _map()
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_distance=DELTA)
    with pytest.raises(ValueError, match="needs the feature inputs un-rotated"):
        hf_rfa.random_feature_attention(q, k, v, fm, True, mask, memory_rope=far, **kw)
    with pytest.raises(ValueError, match=r"needs memory_rope = \(cos, sin\)"):
        hf_rfa.random_feature_attention(q, k, v, fm, True, mask, feature_q=fq, feature_k=fk, **kw)
    with pytest.raises(ValueError, match="memory_distance"):
        hf_rfa.random_feature_attention(q, k, v, fm, True, mask, feature_q=fq, feature_k=fk, memory_rope=far, **{**kw, "memory_distance": -1})
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32, feature_keys=False)
    with pytest.raises(ValueError, match="needs the feature inputs un-rotated"):
        continue_memory_attention(state, q, k, v, fm, mask, MemoryCall(window=5, sinks=2, memory=4, distance=DELTA, far_rope=far))
