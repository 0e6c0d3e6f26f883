"""``memory_score="query_mass"``: the exact memory keeps the keys their window's queries attended
to most (selection by the query side), against its twins.

Oracle chain: a per-key Python sum written here (loops over queries and heads) = the twin's
from-scratch ``query_mass_scores`` + ``memory_membership`` = the op's block-wise sums (prefill,
period-parallel and sequential forms, autograd) = cached continuation in any split, whose state
carries the buffered keys' partial sums.
"""

import math

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryCall, MemoryState, continue_memory_attention
from hf_rfa.ops.reference import memory_membership, quadratic_kernel_attention, query_mass_scores
from conftest import paired_grads, rel
from tolerances import GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D = 2, 4, 2, 71, 16
MAPS = ["favor+", "hedgehog", "none"]
KW = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score="query_mass")


def _inputs(seed: int, dtype=torch.float32, n: int = N, pad: int = 7):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, x, n, D, generator=g, dtype=dtype) * 1.5 for x in (H, HKV, HKV))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :pad] = False
    return q, k, v, mask


def _map(name: str, dtype=torch.float32):
    return hf_rfa.build_feature_map(name, head_dim=D, num_features=32, seed=0).to(dtype)


def _plain_mass(q, k, mask, window, sinks):
    """``[B, Hkv, N]`` log2 sums by loops: query t's softmax over its window and sinks."""
    b, h, n, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    out = torch.full((b, hkv, n), round(math.log2(1e-30) * 1024) / 1024)
    for bi in range(b):
        real = [s for s in range(n) if mask[bi, s]]
        sink = set(real[:sinks])
        for hi in range(h):
            kv = hi // g
            acc = [0.0] * n
            for t in real:
                keys = [s for s in real if s <= t and (s > t - window or s in sink)]
                logits = {s: float(q[bi, hi, t].double() @ k[bi, kv, s].double()) / math.sqrt(d) for s in keys}
                top = max(logits.values())
                z = sum(math.exp(x - top) for x in logits.values())
                for s in keys:
                    if s > t - window:
                        acc[s] += math.exp(logits[s] - top) / z
            for s in range(n):
                if acc[s] > 0:
                    out[bi, kv, s] = acc[s] if out[bi, kv, s] < -50 else out[bi, kv, s] + acc[s]
        for kv in range(hkv):
            for s in range(n):
                if out[bi, kv, s] > -50:
                    out[bi, kv, s] = round(math.log2(float(out[bi, kv, s])) * 1024) / 1024
    return out


def test_twin_scores_equal_a_plain_sum():
    q, k, _, mask = _inputs(0, n=30)
    want = _plain_mass(q, k, mask, 5, 2)
    got = query_mass_scores(q * D**-0.25, k * D**-0.25, mask, 5, 2)
    assert (got - want).abs().max() <= 2**-10 + 1e-6
    assert (want > -50).sum() > 40 and want[want > -50].std() > 0.2  # real, varied sums


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("window,sinks,memory,every,chunk", [(5, 2, 4, 8, 8), (7, 0, 3, 16, 5), (12, 1, 6, 4, 64)], ids=["W5-S2-M4-E8", "W7-M3-E16-C5", "W12-S1-M6-E4"])
def test_op_equals_twin(name, seed, window, sinks, memory, every, chunk):
    q, k, v, mask = _inputs(seed)
    fm = _map(name)
    kw = dict(memory=memory, memory_every=every, memory_score="query_mass")
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, window, sinks, chunk_size=chunk, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    by_norm = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks, memory=memory, memory_every=every)
    assert rel(by_norm[real], ref[real]) > 100 * ORACLE_FP32  # the score chose other keys


@pytest.mark.parametrize("name", ["favor+", "none"])
def test_op_equals_twin_float64_and_last_queries(name):
    q, k, v, mask = _inputs(3, torch.float64)
    fm = _map(name, torch.float64)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **KW)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= 1e-12
    tail = hf_rfa.random_feature_attention(q[:, :, -10:], k, v, fm, True, mask, chunk_size=8, **KW)
    ref_tail = quadratic_kernel_attention(q[:, :, -10:], k, v, fm, True, mask, **KW)  # the missing queries count as zeros in both
    assert rel(tail, ref_tail) <= 1e-12
    assert rel(ref_tail, ref[:, :, -10:]) > 1e-3  # the sums read the queries: without them other keys are chosen


def test_gradients_equal_twin():
    q, k, v, mask = _inputs(4)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    fm = _map("hedgehog")
    params = [p for p in fm.parameters() if p.requires_grad]
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **KW)
    pairs = paired_grads(out, ref, mask, (q, k, v, *params), 9)
    for x, y in pairs:
        assert rel(x, y) <= GRAD_FP32


@pytest.mark.parametrize("name", ["hedgehog", "none"])
@pytest.mark.parametrize("splits", [[20], [3, 9, 17], [1]], ids=["prefill20", "3+9+17", "token-by-token"])
def test_continuation_equals_full_forward(name, splits):
    q, k, v, mask = _inputs(5)
    fm = _map(name)
    full = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **KW)
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), KW["sinks"], KW["memory"], torch.float32)
    outs, i = [], 0
    for s in splits + [1] * (N - sum(splits)):
        o, state = continue_memory_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, mask[:, i:i + s], MemoryCall(chunk_size=8, **KW))
        outs.append(o)
        i += s
    real = mask[:, None, :, None].expand_as(full)
    assert rel(torch.cat(outs, 2)[real], full[real]) <= ORACLE_FP32
    scores = query_mass_scores(q * D**-0.25, k * D**-0.25, mask, 5, 2)
    want = memory_membership(v, mask, 5, 2, 4, 8, None, scores)[:, :, -1]
    got = torch.zeros_like(want).scatter_(2, state.mem_pos, state.mem_ok)
    assert torch.equal(got, want) and got.any()
    assert not torch.equal(want, memory_membership(v, mask, 5, 2, 4, 8)[:, :, -1])  # not ‖v‖'s choice
    assert state.buf_mass is not None and state.buf_mass.shape == state.base.win_k.shape[:3]


def test_state_keeps_the_buffer_sums_and_counts_them():
    q, k, v, mask = _inputs(6)
    fm = _map("favor+")
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32)
    plain = state.nbytes()
    _, state = continue_memory_attention(state, q, k, v, fm, mask, MemoryCall(chunk_size=8, **KW))
    lb = state.base.win_k.shape[2]
    assert 0 < lb <= KW["window"] + KW["memory_every"]
    assert state.buf_mass.dtype == torch.float64 and (state.buf_mass[0] > 0).all()
    assert state.nbytes() >= plain + B * HKV * lb * 8
    picked = state.map_batch(lambda t: t[1:])
    assert picked.buf_mass.shape[0] == 1 and torch.equal(picked.buf_mass, state.buf_mass[1:])


def test_config_needs_a_window():
    with pytest.raises(ValueError, match="needs window > 0"):
        hf_rfa.RFAConfig(feature_map="none", sinks=4, memory=8, memory_score="query_mass")
    assert hf_rfa.RFAConfig(feature_map="none", window=8, memory=8, memory_score="query_mass").memory_score == "query_mass"
