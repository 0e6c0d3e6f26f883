"""The exact memory with feature inputs (``feature_q``/``feature_k``, ``feature_rope``: the feature
part reads un-rotated q/k while window, sinks and memory score the rotated ones) against the
quadratic twin, in prefill, gradients and cached continuation, for both memory scores."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import MemoryCall, MemoryState, continue_memory_attention
from hf_rfa.ops.reference import quadratic_kernel_attention
from hf_rfa.ops.rotary import unrotate
from conftest import paired_grads, rel
from tolerances import GRAD_FP32, ORACLE_FP32

B, H, HKV, N, D = 2, 4, 2, 61, 16
SCORES = ["value_norm", "feature_error"]


def _inputs(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, x, N, D, generator=g, dtype=dtype) for x in (H, HKV, HKV))
    v = v * torch.rand(B, HKV, N, 1, generator=g, dtype=dtype) * 3
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :6] = False
    pos = torch.arange(N, dtype=dtype)
    inv = 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=dtype) / D))
    ang = torch.cat([pos[:, None] * inv[None]] * 2, -1)[None]  # [1,N,D]
    return q, k, v, mask, (ang.cos(), ang.sin())


def _map(dtype=torch.float32):
    return hf_rfa.build_feature_map("hedgehog", head_dim=D, num_features=16, seed=0).to(dtype)


@pytest.mark.parametrize("score", SCORES)
def test_op_equals_twin_and_rope_equals_given_inputs(score):
    q, k, v, mask, rope = _inputs(0)
    fm = _map()
    fq, fk = unrotate(q, *rope), unrotate(k, *rope)
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score)
    out = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, feature_q=fq, feature_k=fk, **kw)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, feature_q=fq, feature_k=fk, **kw)
    real = mask[:, None, :, None].expand_as(ref)
    assert rel(out[real], ref[real]) <= ORACLE_FP32
    by_rope = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, feature_rope=rope, **kw)
    assert rel(by_rope[real], out[real]) <= ORACLE_FP32
    rotated = quadratic_kernel_attention(q, k, v, fm, True, mask, **kw)
    assert rel(rotated[real], ref[real]) > 100 * ORACLE_FP32  # the features read other inputs
    no_mem = quadratic_kernel_attention(q, k, v, fm, True, mask, window=5, sinks=2, feature_q=fq, feature_k=fk)
    assert rel(no_mem[real], ref[real]) > 100 * ORACLE_FP32  # and the memory is used


@pytest.mark.parametrize("score", SCORES)
def test_float64_last_queries_and_gradients(score):
    q, k, v, mask, rope = _inputs(1, torch.float64)
    fm = _map(torch.float64)
    fq, fk = unrotate(q, *rope), unrotate(k, *rope)
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score)
    ref = quadratic_kernel_attention(q, k, v, fm, True, mask, feature_q=fq, feature_k=fk, **kw)
    tail = hf_rfa.random_feature_attention(q[:, :, -9:], k, v, fm, True, mask, chunk_size=8, feature_q=fq[:, :, -9:], feature_k=fk, **kw)
    assert rel(tail, ref[:, :, -9:]) <= 1e-12
    q32, k32, v32, mask, rope = _inputs(2)
    q32, k32, v32 = (x.clone().requires_grad_(True) for x in (q32, k32, v32))
    fm = _map()
    params = [p for p in fm.parameters() if p.requires_grad]
    out = hf_rfa.random_feature_attention(q32, k32, v32, fm, True, mask, chunk_size=8, feature_rope=rope, **kw)
    ref = quadratic_kernel_attention(q32, k32, v32, fm, True, mask, feature_q=unrotate(q32, *rope), feature_k=unrotate(k32, *rope), **kw)
    pairs = paired_grads(out, ref, mask, (q32, k32, v32, *params), 3)
    for x, y in pairs:
        assert rel(x, y) <= GRAD_FP32


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("splits", [[17], [3, 9, 20], [1]], ids=["prefill17", "3+9+20", "token-by-token"])
def test_continuation_equals_full_forward(score, splits):
    q, k, v, mask, rope = _inputs(3)
    fm = _map()
    fq, fk = unrotate(q, *rope), unrotate(k, *rope)
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score)
    full = hf_rfa.random_feature_attention(q, k, v, fm, True, mask, chunk_size=8, feature_q=fq, feature_k=fk, **kw)
    state = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32, feature_keys=True)
    outs, i = [], 0
    for s in splits + [1] * (N - sum(splits)):
        sl = slice(i, i + s)
        o, state = continue_memory_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], MemoryCall(chunk_size=8, **kw), (fq[:, :, sl], fk[:, :, sl]))
        outs.append(o)
        i += s
    real = mask[:, None, :, None].expand_as(full)
    assert rel(torch.cat(outs, 2)[real], full[real]) <= ORACLE_FP32
    assert state.mem_kf is not None and state.base.win_kf.shape[2] <= 5 + 8
    with pytest.raises(ValueError, match="exactly when the state keeps feature keys"):
        continue_memory_attention(state, q[:, :, :1], k[:, :, :1], v[:, :, :1], fm, mask[:, :1], MemoryCall(chunk_size=8, **kw))


@pytest.mark.parametrize("score", SCORES)
def test_derived_feature_keys_equal_kept_copies(score):
    """A state without copies of its keys' feature inputs (``key_fn`` derives them from the kept
    keys and their positions where a call reads them) gives the same outputs, bit for bit, and the
    same state less the copies, as one that keeps them; the memory's are derived only for calls
    that refresh it (in their place the others carry the rotated keys, which would change the
    outputs if they were read)."""
    q, k, v, mask, rope = _inputs(3)
    fm = _map()
    fq, fk = unrotate(q, *rope), unrotate(k, *rope)
    kw = dict(window=5, sinks=2, memory=4, memory_every=8, memory_score=score)
    settings = MemoryCall(chunk_size=8, **kw)
    kept = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32, feature_keys=True)
    derived = MemoryState.empty((B, HKV, D, D, fm.feature_dim), 2, 4, torch.float32, feature_keys=False)
    memory_reads = []

    def key_fn(keys, positions):  # the rotations of positions [L] (buffer) or [B, Hkv, M] (memory)
        cos, sin = rope
        if positions.dim() == 1:
            return unrotate(keys, cos[:, positions], sin[:, positions])
        memory_reads.append(int(positions.max()))
        b, h, m, d = keys.shape
        flat = positions.reshape(b, h * m)
        return unrotate(keys.reshape(b, 1, h * m, d), cos[0][flat], sin[0][flat]).reshape(b, h, m, d)

    i = 0
    for s in [17, 3] + [1] * (N - 20):
        sl = slice(i, i + s)
        args = (q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], settings)
        o1, kept = continue_memory_attention(kept, *args, (fq[:, :, sl], fk[:, :, sl]))
        o2, derived = continue_memory_attention(derived, *args, (fq[:, :, sl], fk[:, :, sl], key_fn))
        assert torch.equal(o1, o2), i
        i += s
    assert derived.mem_kf is None and derived.base.win_kf is None
    for name, t in derived.tensors().items():
        assert torch.equal(t, kept.tensors()[name]), name
    assert kept.nbytes() - derived.nbytes() == (kept.mem_kf.numel() + kept.base.win_kf.numel()) * 4
    assert 2 <= len(memory_reads) <= (N - 17) // 8 + 2  # the refreshes only, not every step
    with pytest.raises(ValueError, match="build it with MemoryState.empty"):
        continue_memory_attention(kept, q[:, :, :1], k[:, :, :1], v[:, :, :1], fm, mask[:, :1], settings, (fq[:, :, :1], fk[:, :, :1], key_fn))
    with pytest.raises(ValueError, match="feature_k must be given"):
        continue_memory_attention(derived, q[:, :, :1], k[:, :, :1], v[:, :, :1], fm, mask[:, :1], settings, (None, None, key_fn))
