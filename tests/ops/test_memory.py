"""The exact global memory (``memory=M``, :mod:`hf_rfa.ops.memory`) against its twins.

Oracle chain: a per-query brute force written here (Python sort per query) = the quadratic twin's
``memory_membership`` (``feature_map="none"``: a masked softmax) = the twin with features =
the op (prefill, autograd) = cached continuation in any split.
"""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryCall, MemoryState, continue_memory_attention
from hf_rfa.ops.reference import memory_membership, quadratic_kernel_attention
from conftest import paired_grads, rel
from tolerances import GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D = 2, 4, 2, 71, 16
MAPS = ["none", "favor+", "hedgehog"]


def _inputs(seed: int, dtype=torch.float32, n: int = N, pad: int = 7):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, x, n, D, generator=g, dtype=dtype) for x in (H, HKV, HKV))
    v = v * torch.rand(B, HKV, n, 1, generator=g, dtype=dtype) * 3  # spread of ‖v‖
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :pad] = False  # left padding, as transformers batches
    return q, k, v, mask


def _map(name: str, dtype=torch.float32):
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=32, seed=0)
    return fm.to(dtype) if isinstance(fm, torch.nn.Module) else fm


def _brute_memory(v, mask, window, sinks, memory, every):
    """``[B, Hkv, N, N]``: per query t, a Python sort of the candidates by (−‖v‖, position)."""
    b, hkv, n, _ = v.shape
    out = torch.zeros(b, hkv, n, n, dtype=torch.bool)
    norms = torch.log2(torch.linalg.vector_norm(v.double(), dim=-1))
    norms = torch.round(norms * 1024) / 1024  # the documented resolution of the score
    for bi in range(b):
        real = [s for s in range(n) if mask[bi, s]]
        sink = set(real[:sinks])
        for hi in range(hkv):
            for t in range(n):
                r = t // every * every
                cand = [s for s in real if s <= r - window and s not in sink]
                for s in sorted(cand, key=lambda s: (-float(norms[bi, hi, s]), s))[:memory]:
                    out[bi, hi, t, s] = True
    return out


def test_membership_equals_brute_force():
    _, _, v, mask = _inputs(0)
    v[0, 0, 20] = v[0, 0, 30]  # an exact tie: the older key wins
    for window, sinks, memory, every in [(5, 2, 4, 8), (0, 0, 3, 1), (9, 1, 40, 16), (3, 0, 2, 5)]:
        got = memory_membership(v, mask, window, sinks, memory, every)
        assert torch.equal(got, _brute_memory(v, mask, window, sinks, memory, every))
    got = memory_membership(v, mask, 5, 2, 4, 8)
    assert got.sum(-1).max() == 4 and got.any()  # bounded, and used


def test_twin_none_equals_masked_softmax():
    """feature_map='none': window + sinks + memory exact, everything else dropped."""
    q, k, v, mask = _inputs(1)
    window, sinks, memory, every = 5, 2, 4, 8
    fm = _map("none")
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks, memory=memory, memory_every=every)
    i, j = torch.arange(N)[:, None], torch.arange(N)[None]
    rank = mask.long().cumsum(-1) - 1
    sink = (mask & (rank < sinks))[:, None, None, :]
    allowed = (((j <= i) & (j > i - window))[None, None] | (sink & (j <= i))) & mask[:, None, None, :]
    allowed = allowed | _brute_memory(v, mask, window, sinks, memory, every)
    allowed = allowed.repeat_interleave(H // HKV, 1)
    s = (q @ k.repeat_interleave(H // HKV, 1).transpose(-1, -2)) * D**-0.5
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ v.repeat_interleave(H // HKV, 1)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(ref[real], want[real]) <= ORACLE_FP32
    plain = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks)
    assert rel(plain[real], want[real]) > 100 * ORACLE_FP32  # the memory changed the result


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window,sinks,memory,every,chunk", [(5, 2, 4, 8, 8), (7, 0, 3, 16, 5), (0, 1, 6, 4, 64), (3, 3, 50, 8, 8)], ids=["W5-S2-M4-E8", "W7-M3-E16-C5", "S1-M6-E4", "M>cands"])
def test_op_equals_twin(name, seed, window, sinks, memory, every, chunk):
    q, k, v, mask = _inputs(seed)
    fm = _map(name)
    if name == "none" and window == 0 and sinks == 0:
        pytest.skip("none needs a window or sinks")
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, window, sinks, chunk_size=chunk, memory=memory, memory_every=every)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks, memory=memory, memory_every=every)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    base = quadratic_kernel_attention(q, k, v, fm, True, mask, window, sinks)
    assert rel(base[real], ref[real]) > 100 * ORACLE_FP32  # memory=M is not memory=0


@pytest.mark.parametrize("name", MAPS)
def test_op_equals_twin_float64_and_last_queries(name):
    q, k, v, mask = _inputs(3, torch.float64)
    fm = _map(name, torch.float64)
    kw = dict(window=5, sinks=2, memory=4, memory_every=8)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= 1e-12
    tail = hf_rfa.random_feature_attention(q[:, :, -10:], k, v, fm, True, mask, chunk_size=8, **kw)  # Nq < Nk
    assert rel(tail, ref[:, :, -10:]) <= 1e-12


@pytest.mark.parametrize("name", MAPS)
def test_gradients_equal_twin(name):
    """The selection is a choice of indices; gradients flow through q, k, v (and the map's
    parameters) of the chosen keys as in the twin."""
    q, k, v, mask = _inputs(4)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    fm = _map(name)
    params = [p for p in (fm.parameters() if isinstance(fm, torch.nn.Module) else []) if p.requires_grad]
    kw = dict(window=5, sinks=2, memory=4, memory_every=8)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **kw)
    pairs = paired_grads(out, ref, mask, (q, k, v, *params), 9)
    for x, y in pairs:
        assert rel(x, y) <= GRAD_FP32
    assert pairs[2][0].abs().sum() > 0


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("splits", [[N], [20], [3, 9, 17], [1], [13, 30]], ids=["one-shot", "prefill20", "3+9+17", "token-by-token", "13+30"])
def test_continuation_equals_full_forward(name, splits):
    """Prefill + chunks + single tokens (the rest) = one full forward; the state stays bounded."""
    q, k, v, mask = _inputs(5)
    fm = _map(name)
    window, sinks, memory, every = 5, 2, 4, 8
    full = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, window, sinks, chunk_size=8, memory=memory, memory_every=every)
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), sinks, memory, torch.float32)
    outs, i, sizes = [], 0, []
    for s in splits + [1] * (N - sum(splits)):
        o, state = continue_memory_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, mask[:, i:i + s], MemoryCall(window, sinks, memory, every, chunk_size=8))
        outs.append(o)
        sizes.append(state.nbytes())
        assert state.base.win_k.shape[2] <= window + every
        i += s
    real = mask[:, None, :, None].expand_as(full)
    assert rel(torch.cat(outs, 2)[real], full[real]) <= ORACLE_FP32
    if len(splits) == 1 and splits[0] == 1:
        assert max(sizes) == max(sizes[window + every:])  # bounded: reached early, never exceeded
    # the state's memory is the twin's memory at the next refresh position
    want = memory_membership(v, mask, window, sinks, memory, every)[:, :, -1]  # [B,Hkv,N]
    got = torch.zeros_like(want).scatter_(2, state.mem_pos, state.mem_ok)
    assert torch.equal(got, want) and got.any()


def test_state_bytes_count_the_memory():
    fm = _map("favor+")
    a = MemoryState.empty((1, HKV, D, D, fm.feature_dim), 2, 128, torch.float32)
    b = MemoryState.empty((1, HKV, D, D, fm.feature_dim), 2, 256, torch.float32)
    assert b.nbytes() - a.nbytes() == b.memory_nbytes() - a.memory_nbytes() > 128 * HKV * 2 * D * 4
    assert a.nbytes() > a.base.nbytes()


def test_bad_arguments_name_the_field():
    q, k, v, mask = _inputs(0)
    fm = _map("favor+")
    with pytest.raises(ValueError, match="memory"):
        hf_rfa.random_feature_attention(q, k, v, fm, causal=False, window=4, memory=4)
    with pytest.raises(ValueError, match="memory"):
        hf_rfa.random_feature_attention(q, k, v, fm, memory=-1)
    with pytest.raises(ValueError, match="memory_every"):
        hf_rfa.random_feature_attention(q, k, v, fm, memory=2, memory_every=0)
    with pytest.raises(ValueError, match="memory"):
        quadratic_kernel_attention(q, k, v, fm, causal=False, memory=4)
    for bad in (dict(memory=-1), dict(memory=1.5), dict(memory=2**20), dict(memory_every=0)):
        with pytest.raises(ValueError, match="memory"):
            hf_rfa.RFAConfig(**bad)
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 0, 4, torch.float32)
    with pytest.raises(ValueError, match="memory"):
        continue_memory_attention(state, q, k, v, fm, None, MemoryCall(memory=8))


def test_nonfinite_key_poisons_only_its_rows_in_prefill_and_decoding():
    q, k, v, mask = _inputs(6, n=40, pad=0)
    fm = _map("favor+")
    kw = dict(window=5, sinks=2, memory=4, memory_every=8)
    clean = hf_rfa.random_feature_attention(q, k, v, fm, **kw)
    k[0, 0, 20, 0] = float("nan")
    out = hf_rfa.random_feature_attention(q, k, v, fm, **kw)
    assert torch.isnan(out[0, :2, 20:]).all() and not torch.isnan(out[0, :2, :20]).any() and not torch.isnan(out[0, 2:]).any()
    assert torch.equal(out[1], clean[1]) and torch.equal(out[0, :, :20], clean[0, :, :20])
    state, outs = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32), []
    for i in range(0, 40, 7):
        o, state = continue_memory_attention(state, q[:, :, i:i + 7], k[:, :, i:i + 7], v[:, :, i:i + 7], fm, None, MemoryCall(**kw))
        outs.append(o)
    dec = torch.cat(outs, 2)
    assert torch.equal(torch.isnan(dec), torch.isnan(out)) and rel(dec.nan_to_num(), out.nan_to_num()) <= ORACLE_FP32
    assert all(torch.isfinite(t).all() for t in state.tensors().values() if t.is_floating_point())


def test_ties_keep_the_older_key_in_prefill_and_decoding():
    """±1 values: every ‖v‖ is exactly 4, so the memory is the oldest M candidates."""
    q, k, v, mask = _inputs(7, n=40)
    v = torch.sign(v) + (v == 0)
    fm = _map("none")
    kw = dict(window=5, sinks=2, memory=4, memory_every=8)
    member = memory_membership(v, mask, **kw)
    for bi in range(B):
        real = mask[bi].nonzero().flatten().tolist()
        cands = [s for s in real[2:] if s <= 32 - 5]  # the refresh before the last query: 32
        assert member[bi, :, -1].nonzero()[:, 1].view(HKV, -1).tolist() == [cands[:4]] * HKV
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32)
    for i in range(40):
        _, state = continue_memory_attention(state, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], fm, mask[:, i:i + 1], MemoryCall(**kw))
    assert torch.equal(torch.zeros_like(member[:, :, -1]).scatter_(2, state.mem_pos, state.mem_ok), member[:, :, -1])


def test_score_resolution_absorbs_last_bit_differences():
    """Equal values computed by different matmuls may differ in the last bit: the rounded score
    still ties them (and the older key wins), so prefill and decoding choose alike."""
    _, _, v, mask = _inputs(8)
    v[:, :, 40:] = v[:, :, 10:41]  # repeated tokens
    v[0, 0] = v[0, 0, :1]  # one head: the same value everywhere (every pair a tie)
    bumped = v.clone()
    bumped[:, :, 40:] *= 1 + 2**-22  # the copies a few float32 ulps larger
    a, b = memory_membership(v, mask, 5, 2, 4, 8), memory_membership(bumped, mask, 5, 2, 4, 8)
    assert torch.equal(a, b)
