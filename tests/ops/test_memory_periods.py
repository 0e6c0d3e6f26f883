"""The exact memory's period-parallel form (``memory_periods.run_periods``) against the sequential
form (``memory._run``, itself checked against the quadratic twin in test_memory*.py): same
outputs, same final state (so cached decoding continues identically), same gradients — for every
kind of map, both scores, un-rotated feature inputs, padding, no window / no sinks, calls that
start mid-period from a non-empty state, and blocks of periods."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.memory import periods as memory_periods
from hf_rfa.ops.memory import MemoryState
from hf_rfa.ops.memory.sequential import run_sequential as _run
from hf_rfa.ops.memory.periods import run_periods
from hf_rfa.ops.memory.state import MemoryCall
from conftest import rel

B, H, HKV, D = 2, 4, 2, 16


def _inputs(n: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k, v, fq, fk = (torch.randn(B, x, n, D, generator=g, dtype=dtype) for x in (H, HKV, HKV, H, HKV))
    v = v * torch.rand(B, HKV, n, 1, generator=g, dtype=dtype) * 3
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :5] = False
    mask[0, 17] = False
    return q, k, v, fq, fk, mask


def _map(kind: str, dtype=torch.float64):
    if kind == "rfa-gate":
        return hf_rfa.build_feature_map("rfa", head_dim=D, num_features=16, seed=0, gate=True, num_heads=H, num_kv_heads=HKV).to(dtype)
    fm = hf_rfa.build_feature_map(kind, head_dim=D, num_features=16, seed=0, num_heads=H, num_kv_heads=HKV)
    if kind in ("hedgehog", "favor+"):
        fm.enable_decay(6.0)
    return fm.to(dtype)


def _state(fm, sinks, memory, dtype, feature_keys):
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return MemoryState.empty((B, HKV, D, D, fm.feature_dim), sinks, memory, dtype, None, ct, feature_keys=feature_keys)


def _both(fm, q, k, v, fq, fk, mask, window, sinks, memory, every, score, splits):
    """Run the sequence in calls of the given lengths by each form → (outs, final states)."""
    res = []
    for form in (_run, run_periods):
        st = _state(fm, sinks, memory, q.dtype, fk is not None)
        outs, i = [], 0
        for s in splits:
            sl = slice(i, i + s)
            o, st = form(st, q[:, :, sl], k[:, :, sl], v[:, :, sl], mask[:, sl], fm, MemoryCall(window, sinks, memory, every, D**-0.5, 8, False, score),
                         (fq[:, :, sl] if fq is not None else None, fk[:, :, sl] if fk is not None else None))
            outs.append(o)
            i += s
        res.append((torch.cat(outs, dim=2), st))
    return res


def _assert_same_state(a: MemoryState, b: MemoryState, tol: float):
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys() and a.seen == b.seen
    ok = a.mem_ok
    assert torch.equal(ok, b.mem_ok) and torch.equal(a.mem_pos[ok], b.mem_pos[ok])  # the same keys chosen
    for name in ta:
        x, y = ta[name], tb[name]
        if name.startswith("mem_") and name != "mem_ok":  # empty slots hold whatever: compare the filled ones
            x, y = x[ok], y[ok]
        if x.dtype == torch.bool or not x.is_floating_point():
            assert torch.equal(x, y), name
        elif x.numel():
            assert rel(x, y) <= tol, name


CASES = [  # kind, window, sinks, memory, every, splits (n = sum)
    ("hedgehog", 5, 2, 4, 8, [70]),
    ("favor+", 5, 2, 4, 8, [70]),
    ("rfa-gate", 5, 2, 4, 8, [70]),
    ("none", 5, 2, 4, 8, [70]),
    ("hedgehog", 0, 0, 3, 5, [53]),
    ("favor+", 7, 0, 6, 4, [30, 1, 25, 13]),  # mid-period starts from non-empty states
    ("hedgehog", 9, 3, 5, 16, [19, 40, 12]),
    ("rfa-gate", 3, 1, 2, 6, [11, 29, 1, 20]),
    ("rff", 4, 1, 3, 7, [50]),
    ("favor++", 6, 2, 5, 9, [33, 2, 31]),
    ("elu", 2, 0, 3, 3, [26]),
]


@pytest.mark.parametrize("kind,window,sinks,memory,every,splits", CASES)
@pytest.mark.parametrize("score", ["value_norm", "feature_error"])
def test_periods_equal_sequential_float64(kind, window, sinks, memory, every, splits, score):
    if kind == "none" and score == "feature_error":
        pytest.skip("feature_error needs a feature state")
    q, k, v, fq, fk, mask = _inputs(sum(splits), 0)
    fm = _map(kind)
    for feat_in in ((None, None), (fq, fk)) if kind != "none" else ((None, None),):
        (oa, sa), (ob, sb) = _both(fm, q, k, v, *feat_in, mask, window, sinks, memory, every, score, splits)
        real = mask[:, None, :, None].expand_as(oa)
        assert rel(ob[real], oa[real]) <= 1e-12
        _assert_same_state(sa, sb, 1e-12)
        assert sa.mem_ok.any()  # the memory was used


@pytest.mark.parametrize("kind", ["hedgehog", "rfa-gate"])
def test_blocks_of_periods_and_float32(kind, monkeypatch):
    monkeypatch.setattr(memory_periods, "PERIOD_BLOCK", 2)  # several blocks of periods
    q, k, v, fq, fk, mask = _inputs(61, 1, torch.float32)
    fm = _map(kind, torch.float32)
    (oa, sa), (ob, sb) = _both(fm, q, k, v, fq, fk, mask, 5, 2, 4, 8, "feature_error", [61])
    real = mask[:, None, :, None].expand_as(oa)
    assert rel(ob[real], oa[real]) <= 1e-5
    _assert_same_state(sa, sb, 1e-5)


@pytest.mark.parametrize("kind", ["hedgehog", "favor+", "rfa-gate"])
def test_gradients_equal_sequential(kind):
    q, k, v, fq, fk, mask = _inputs(45, 2)
    fm = _map(kind)
    params = [p for p in fm.parameters() if p.requires_grad]
    up = torch.randn(B, H, 45, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * mask[:, None, :, None]
    grads = []
    for form in (_run, run_periods):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, fq, fk)]
        st = _state(fm, 2, 4, torch.float64, True)
        out, _ = form(st, xs[0], xs[1], xs[2], mask, fm, MemoryCall(5, 2, 4, 8, D**-0.5, 8, False, "feature_error"), (xs[3], xs[4]))
        grads.append(torch.autograd.grad((out * up).sum(), (*xs, *params)))
    for ga, gb in zip(*grads):
        assert rel(gb, ga) <= 1e-10


def test_prefill_and_long_continuations_use_the_periods(monkeypatch):
    """The op routes calls longer than one period through the period form, decoding steps not."""
    calls = []
    real = memory_periods.run_periods
    monkeypatch.setattr(memory_periods, "run_periods", lambda *a, **kw: calls.append(a[1].shape[2]) or real(*a, **kw))
    q, k, v, _, _, mask = _inputs(40, 4, torch.float32)
    fm = _map("hedgehog", torch.float32)
    hf_rfa.random_feature_attention(q, k, v, fm, True, mask, window=5, sinks=2, memory=4, memory_every=8)
    assert calls == [40]
    st = _state(fm, 2, 4, torch.float32, False)
    from hf_rfa.ops.memory import continue_memory_attention

    for s in (20, 8, 1):
        _, st = continue_memory_attention(st, q[:, :, :s], k[:, :, :s], v[:, :, :s], fm, mask[:, :s], MemoryCall(5, 2, 4, 8))
    assert calls == [40, 20]
