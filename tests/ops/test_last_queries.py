"""Causal calls whose queries are the last Nq < Nk positions (attention transfer's fitted queries,
``Captured.queries_ending_at``): the keys every query sees through the features are folded into the
state at once (:func:`hf_rfa.ops.feature.fused.fold_keys`) and only the last Nq rows are computed. Twin: the
same call with every position's query (the last Nq rows of its output), forward and gradients."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import quadratic_kernel_attention
from hf_rfa.ops.backends import native
from tolerances import GRAD_FP32, ORACLE_FP32
from conftest import rel

ALL = [n for n in hf_rfa.available_feature_maps() if n != "none"]


def make_fm(name, d, m=16, seed=0, decay=None, **kw):
    if name == "rfa":
        kw.setdefault("gate", True)
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=m, seed=seed, **kw)
    if decay is not None:
        fm.enable_decay(decay)
    return fm


def inputs(b=2, h=4, hkv=2, n=75, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :9] = False  # a left-padded row
    return q, k, v, mask


def _scale(name, q, k):  # rff: near-uniform logits (its normaliser estimate crosses zero otherwise)
    return (0.4 * q, 0.4 * k) if name == "rff" else (q, k)


def _pair(fm, q, k, v, nq, **kw):
    """(Nq-query output, last Nq rows of the full output)."""
    full = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, **kw)
    tail = hf_rfa.random_feature_attention(q[:, :, -nq:], k, v, fm, causal=True, **kw)
    return tail, full[:, :, -nq:]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("window,sinks", [(0, 0), (6, 0), (6, 2), (0, 3)])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_last_queries_equal_the_full_call(name, window, sinks, padded):
    q, k, v, mask = inputs()
    q, k = _scale(name, q, k)
    fm = make_fm(name, 8)
    for nq in (1, 17, 64):
        with torch.no_grad():
            tail, ref = _pair(fm, q, k, v, nq, window=window, sinks=sinks, attention_mask=mask if padded else None, chunk_size=8)
        assert tail.shape == (2, 4, nq, 8)
        assert rel(tail, ref) <= ORACLE_FP32, (nq, rel(tail, ref))


@pytest.mark.parametrize("name", ["hedgehog", "favor+", "rfa"])
@pytest.mark.parametrize("decay", [None, 16.0])
def test_last_queries_match_the_quadratic_twin(name, decay):
    if name == "rfa" and decay is not None:
        pytest.skip("rfa has its own gate")
    q, k, v, mask = inputs(seed=1)
    fm = make_fm(name, 8, decay=decay)
    with torch.no_grad():
        out = hf_rfa.random_feature_attention(q[:, :, -20:], k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask, chunk_size=8)
        twin = quadratic_kernel_attention(q[:, :, -20:], k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask)
    assert rel(out, twin) <= ORACLE_FP32


@pytest.mark.parametrize("name", ["hedgehog", "rfa", "t2r"])
@pytest.mark.parametrize("decay", [None, 16.0])
def test_last_queries_gradients_equal_the_full_call(name, decay):
    """Gradients of q (the fitted rows), k, v and the map's parameters, with feature inputs (the
    un-rotated q/k of the main recipe) and checkpoint_blocks=False (attention transfer's form)."""
    if name == "rfa" and decay is not None:
        pytest.skip("rfa has its own gate")
    q, k, v, mask = inputs(seed=2)
    fq, fk = q.flip(-1).clone(), k.flip(-1).clone()
    fm = make_fm(name, 8, decay=decay)
    nq = 23
    grads = []
    for rows in ("tail", "full"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, fq, fk)]
        for p in fm.parameters():
            p.grad = None
        qq, ffq = (xs[0][:, :, -nq:], xs[3][:, :, -nq:]) if rows == "tail" else (xs[0], xs[3])
        out = hf_rfa.random_feature_attention(qq, xs[1], xs[2], fm, causal=True, window=6, sinks=2, attention_mask=mask, chunk_size=8, checkpoint_blocks=False, feature_q=ffq, feature_k=xs[4])
        out[:, :, -nq:].pow(2).sum().backward()
        grads.append([x.grad for x in xs] + [p.grad.clone() for p in fm.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 5
    for a, b in zip(*grads):
        assert rel(a, b) <= GRAD_FP32


def test_last_queries_gradcheck_float64():
    q, k, v, mask = inputs(b=2, h=2, hkv=1, n=21, d=4, seed=3, dtype=torch.float64)
    fm = make_fm("hedgehog", 4, m=4, decay=8.0).double()
    args = [q[:, :, -5:].clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()]

    def f(q_, k_, v_):
        return hf_rfa.random_feature_attention(q_, k_, v_, fm, causal=True, window=3, sinks=1, attention_mask=mask, chunk_size=4, checkpoint_blocks=False)

    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("backend", ["inference", "native"])
def test_last_queries_inference_backends(backend):
    if backend == "native" and not native.usable(torch.device("cpu"), torch.float32):
        pytest.skip("native kernel not built here")
    q, k, v, mask = inputs(seed=4)
    fm = make_fm("hedgehog", 8, decay=16.0)
    with torch.no_grad():
        tail, ref = _pair(fm, q, k, v, 30, window=6, sinks=2, attention_mask=mask, chunk_size=8, backend=backend)
        torch_ref = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask, chunk_size=8, backend="torch")[:, :, -30:]
    assert rel(tail, ref) <= ORACLE_FP32
    assert rel(tail, torch_ref) <= ORACLE_FP32


def test_last_queries_scan_only_their_rows(monkeypatch):
    """The feature scan runs over the last Nq positions only (the keys before them are folded)."""
    from hf_rfa.ops import attention

    seen = []
    real = attention.causal_feature_attention

    def spy(feature_map, xq, *a, **kw):
        seen.append((xq.shape[2], kw.get("state") is not None))
        return real(feature_map, xq, *a, **kw)

    monkeypatch.setattr(attention, "causal_feature_attention", spy)
    q, k, v, mask = inputs()
    fm = make_fm("hedgehog", 8)
    with torch.no_grad():
        hf_rfa.random_feature_attention(q[:, :, -10:], k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask)
        hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask)
    assert seen == [(10, True), (75, False)]


def test_last_queries_band_runs_on_the_keys_they_see(monkeypatch):
    """The exact band of the last Nq queries runs on sinks + the keys from their first window
    position on (crop = S + W − 1 + Nq), and on every row when a sink lies in that span."""
    from hf_rfa.ops import attention
    from hf_rfa.ops.band import exact as hybrid

    seen = []
    real = hybrid.exact_local

    def spy(xq, xk, *a, **kw):
        seen.append(xk.shape[2])
        return real(xq, xk, *a, **kw)

    monkeypatch.setattr(hybrid, "exact_local", spy)
    monkeypatch.setattr(attention, "exact_local", spy)
    q, k, v, mask = inputs()
    fm = make_fm("hedgehog", 8)
    with torch.no_grad():  # (backend "torch": the native kernel answers the band on every row)
        hf_rfa.random_feature_attention(q[:, :, -10:], k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask, backend="torch")
        # 66 queries: their first window key (position 4) precedes row 1's sinks (positions 9, 10)
        hf_rfa.random_feature_attention(q[:, :, -66:], k, v, fm, causal=True, window=6, sinks=2, attention_mask=mask, backend="torch")
    assert seen == [2 + 5 + 10, 75]
