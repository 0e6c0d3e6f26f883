"""``memory_score="feature_error"``: the exact memory keeps the keys the feature state recalls
worst (LoLA-style), against its twins.

Oracle chain: a sequential Python simulation written here (lists, one key at a time) = the
twin's from-scratch ``feature_error_scores`` + ``memory_membership`` = the op's incremental form
(prefill, autograd) = cached continuation in any split.
"""

import math

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryCall, MemoryState, continue_memory_attention, value_norm
from hf_rfa.ops.reference import feature_error_scores, memory_membership, quadratic_kernel_attention
from conftest import paired_grads, rel
from tolerances import GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D = 2, 4, 2, 71, 16
MAPS = ["favor+", "hedgehog"]
KW = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score="feature_error")


def _inputs(seed: int, dtype=torch.float32, n: int = N, pad: int = 7):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, x, n, D, generator=g, dtype=dtype) for x in (H, HKV, HKV))
    v = v * torch.rand(B, HKV, n, 1, generator=g, dtype=dtype) * 3
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :pad] = False
    return q, k, v, mask


def _map(name: str, dtype=torch.float32):
    return hf_rfa.build_feature_map(name, head_dim=D, num_features=32, seed=0).to(dtype)


def _simulate(k, v, mask, fm, window, sinks, memory, every):
    """Scores ``[B, Hkv, N]`` and the final memory (sets of positions) by a plain simulation:
    refresh by refresh, new candidates scored against the keys folded so far, then a Python sort."""
    b, hkv, n, d = k.shape
    ks = k.double() * d**-0.25
    fk = fm.double().forward_keys(ks)
    fm.float()
    lk = fk.log_scale if fk.log_scale is not None else torch.zeros(b, hkv, n, dtype=torch.float64)
    scores = torch.full((b, hkv, n), float("-inf"))
    final = {}
    for bi in range(b):
        real = [s for s in range(n) if mask[bi, s]]
        elig = [s for s in real if s not in set(real[:sinks])]
        for hi in range(hkv):
            mem, folded, seen = [], [], set()
            for r in range(0, n, every):
                new = [s for s in elig if s <= r - window and s not in seen]
                if not new:
                    continue
                for s in new:
                    seen.add(s)
                    w = [float((fk.phi[bi, hi, s] @ fk.phi[bi, hi, j]).detach()) * math.exp(float(lk[bi, hi, j] - lk[bi, hi].max())) for j in folded]
                    den = sum(w)
                    pred = sum((wi * v[bi, hi, j].double() for wi, j in zip(w, folded)), torch.zeros(v.shape[-1], dtype=torch.float64)) / den if den > 0 else torch.zeros(v.shape[-1], dtype=torch.float64)
                    err = float(torch.linalg.vector_norm(v[bi, hi, s].double() - pred))
                    scores[bi, hi, s] = round(math.log2(max(err, 1e-30)) * 1024) / 1024
                pool = sorted(mem + new, key=lambda s: (-float(scores[bi, hi, s]), s))
                mem = pool[:memory]
                folded += pool[memory:]
            final[bi, hi] = set(mem)
    return scores, final


@pytest.mark.parametrize("name", MAPS)
def test_twin_scores_and_memory_equal_a_plain_simulation(name):
    _, k, v, mask = _inputs(0)
    fm = _map(name)
    window, sinks, memory, every = 5, 2, 4, 8
    want, final = _simulate(k, v, mask, fm, window, sinks, memory, every)
    got = feature_error_scores(k.double() * D**-0.25, v, fm.double(), mask, window, sinks, memory, every)
    fm.float()
    scored = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), scored) and scored.sum() > 100
    assert torch.allclose(got[scored], want[scored], atol=2 / 1024)  # equal up to a rounding step
    assert (got[scored] == want[scored]).float().mean() > 0.97
    # the last refresh's memory of the twin = the simulation's
    last = (N - 1) // every * every
    mem = memory_membership(v, mask, window, sinks, memory, every, 1, got)[:, :, 0]
    for (bi, hi), s in final.items():
        assert set(mem[bi, hi].nonzero().flatten().tolist()) == s, (bi, hi, last)


def test_first_refresh_scores_are_value_norm():
    """Against an empty state the prediction is 0: the score is ‖v‖'s."""
    _, k, v, mask = _inputs(1)
    fm = _map("favor+")
    got = feature_error_scores(k * D**-0.25, v, fm, None, 5, 0, 4, 8)
    # refresh 8: keys 0..3 all fit in the 4 slots, nothing is folded; so the keys first scored at
    # refresh 16 (positions <= 11) see an empty state too
    first = torch.arange(N) <= 16 - 5
    assert torch.equal(got[..., first], value_norm(v)[..., first])
    later = torch.isfinite(got) & ~first
    assert (got[later] != value_norm(v)[later]).float().mean() > 0.9  # and not afterwards


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("window,sinks,memory,every,chunk", [(5, 2, 4, 8, 8), (7, 0, 3, 16, 5), (0, 1, 6, 4, 64)], ids=["W5-S2-M4-E8", "W7-M3-E16-C5", "S1-M6-E4"])
def test_op_equals_twin(name, seed, window, sinks, memory, every, chunk):
    q, k, v, mask = _inputs(seed)
    fm = _map(name)
    kw = dict(memory=memory, memory_every=every, memory_score="feature_error")
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, window, sinks, chunk_size=chunk, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    by_norm = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks, memory=memory, memory_every=every)
    assert rel(by_norm[real], ref[real]) > 100 * ORACLE_FP32  # the score chose other keys


@pytest.mark.parametrize("name", MAPS)
def test_op_equals_twin_float64_and_last_queries(name):
    q, k, v, mask = _inputs(3, torch.float64)
    fm = _map(name, torch.float64)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **KW)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= 1e-12
    tail = hf_rfa.random_feature_attention(q[:, :, -10:], k, v, fm, True, mask, chunk_size=8, **KW)
    assert rel(tail, ref[:, :, -10:]) <= 1e-12


@pytest.mark.parametrize("name", MAPS)
def test_gradients_equal_twin(name):
    q, k, v, mask = _inputs(4)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    fm = _map(name)
    params = [p for p in fm.parameters() if p.requires_grad]
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **KW)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **KW)
    pairs = paired_grads(out, ref, mask, (q, k, v, *params), 9)
    for x, y in pairs:
        assert rel(x, y) <= GRAD_FP32


@pytest.mark.parametrize("name", MAPS)
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
    scores = feature_error_scores(k * D**-0.25, v, fm, mask, 5, 2, 4, 8)
    want = memory_membership(v, mask, 5, 2, 4, 8, None, scores)[:, :, -1]
    got = torch.zeros_like(want).scatter_(2, state.mem_pos, state.mem_ok)
    assert torch.equal(got, want) and got.any()
    assert not torch.equal(want, memory_membership(v, mask, 5, 2, 4, 8)[:, :, -1])  # not ‖v‖'s choice


def test_bad_memory_score_is_refused():
    q, k, v, mask = _inputs(6)
    with pytest.raises(ValueError, match="memory_score must be one of"):
        hf_rfa.random_feature_attention(q, k, v, _map("favor+"), True, mask, 5, 2, memory=4, memory_score="norm")
    with pytest.raises(ValueError, match="feature_map='none' has none"):
        hf_rfa.random_feature_attention(q, k, v, hf_rfa.build_feature_map("none", head_dim=D), True, mask, 5, 2, memory=4, memory_score="feature_error")
    with pytest.raises(ValueError, match="memory_score must be one of"):
        hf_rfa.RFAConfig(memory=4, memory_score="norm")
    with pytest.raises(ValueError, match="feature_map='none' has none"):
        hf_rfa.RFAConfig(feature_map="none", window=4, memory=4, memory_score="feature_error")
