"""The causal hybrid in training as one recomputing Function (``hf_rfa.ops.hybrid.function``):
gradients of q, k, v and every feature-map parameter against the autograd form
(``checkpoint_blocks=False``, the reference twin) in float32 and float64, float64 gradcheck, and
the saved-tensor bytes of one layer (saved-tensor hooks): q, k, v once plus O(N)."""

import functools

import pytest
import torch

import hf_rfa
from hf_rfa.ops import attention
from hf_rfa.ops.backends import native
from hf_rfa.ops.hybrid.blocks import window_slice as _window_slice
from hf_rfa.ops.hybrid.function import HybridArgs
from hf_rfa.ops.spec import AttentionSpec, CallPlan
from conftest import rel
from tolerances import GRAD_FP32, GRAD_FP64

B, H, HKV, N, D = 2, 4, 2, 53, 8


@pytest.fixture(autouse=True)
def pytorch_forms_only():
    old = native.native_enabled()
    native.set_native(False)
    yield
    native.set_native(old)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 tokens (chunk 4): four blocks at N = 53, the last one split by the scan."""
    monkeypatch.setattr(attention, "hybrid_attention", functools.partial(attention.hybrid_attention, block_size=16))


def _inputs(n=N, h=H, hkv=HKV, dtype=torch.float32, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (0.7 * torch.randn(B, x, n, D, generator=g, dtype=dtype) for x in (h, hkv, hkv))
    mask = torch.ones(B, n, dtype=torch.bool)
    if pad:
        mask[-1, :5] = False  # left padding in the last row
    return q, k, v, mask


def _fm(name, decay=False, dtype=torch.float32, h=H, hkv=HKV):
    kw = {"gate": True} if name == "rfa" else {}
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=12, seed=3, num_heads=h, num_kv_heads=hkv, **kw)
    if decay:
        fm.enable_decay(6.0)
        with torch.no_grad():  # a different half-life per kv head
            fm.decay_log_rate.add_(torch.linspace(0.0, 1.0, hkv))
    if name == "rfa":  # an input-dependent gate that really decays
        with torch.no_grad():
            fm.gate_weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    return fm.to(dtype)


def _has_hybrid_function(out: torch.Tensor) -> bool:
    """Whether ``HybridFunction`` is in ``out``'s graph."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "HybridFunction" in type(fn).__name__:
            return True
        todo += [f for f, _ in fn.next_functions]
    return False


def _grads(fm, tensors, up, ckpt, chunk_size=4, **kw):
    """Output and gradients (q, k, v, then every parameter of the map) of ``(op * up).sum()``."""
    fm.zero_grad()
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = hf_rfa.random_feature_attention(*leaves, fm, chunk_size=chunk_size, checkpoint_blocks=ckpt, **kw)
    assert _has_hybrid_function(out) == ckpt
    (out * up).sum().backward()
    return [out] + [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in fm.parameters()]


def _case(case: str, dtype=torch.float32):
    """``(fm, (q, k, v), up, kw)`` of ``CASES[case]`` in ``dtype``: the map, inputs, the output's
    upstream gradient and the op's keyword arguments (mask, window, sinks)."""
    name, decay, window, sinks, pad, h = CASES[case]
    q, k, v, mask = _inputs(h=h, pad=pad, dtype=dtype)
    up = torch.randn(B, h, N, D, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return _fm(name, decay, dtype, h=h), (q, k, v), up, dict(attention_mask=mask, window=window, sinks=sinks)


def _close(got: list, want: list, tol: float) -> None:
    """Each pair within ``tol`` (relative), or both None (a parameter without a gradient: W ≥ N)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert rel(a, b) <= tol


CASES = {  # name: (map, decay, window, sinks, padding, query heads)
    "favor+-W6": ("favor+", False, 6, 0, True, H),
    "favor+-W6-S3": ("favor+", False, 6, 3, True, H),
    "favor+-S3": ("favor+", False, 0, 3, True, H),
    "favor+-W20-S2-nopad": ("favor+", False, 20, 2, False, H),
    "favor+-W>=N-S2": ("favor+", False, 100, 2, True, H),
    "favor+-decay-W6-S2": ("favor+", True, 6, 2, True, H),
    "favor+-MHA-W6-S1": ("favor+", False, 6, 1, True, HKV),
    "hedgehog-W6-S2": ("hedgehog", False, 6, 2, True, H),
    "hedgehog-W6": ("hedgehog", False, 6, 0, False, H),
    "hedgehog-decay-W6-S2": ("hedgehog", True, 6, 2, True, H),
    "hedgehog-W>=N": ("hedgehog", False, 53, 0, True, H),
    "rfa-gate-W6-S2": ("rfa", False, 6, 2, True, H),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_function_matches_autograd_form_float32(case, small_blocks):
    window = CASES[case][2]
    fm, qkv, up, kw = _case(case)
    want = _grads(fm, qkv, up, False, **kw)
    got = _grads(fm, qkv, up, True, **kw)
    assert len(got) == 4 + len(list(fm.parameters()))
    assert all(x is not None for x in got[: 4 if window >= N else None])
    _close(got, want, GRAD_FP32)


@pytest.mark.parametrize("case", ["favor+-W6-S3", "favor+-W>=N-S2", "favor+-decay-W6-S2", "hedgehog-W6-S2", "hedgehog-decay-W6-S2"])
def test_hybrid_function_matches_autograd_form_float64(case, small_blocks):
    fm, qkv, up, kw = _case(case, torch.float64)
    want = _grads(fm, qkv, up, False, **kw)
    got = _grads(fm, qkv, up, True, **kw)
    assert got[0].dtype == torch.float64
    _close(got, want, GRAD_FP64)


@pytest.mark.parametrize("chunk_size", [6, 64], ids=["chunk6-blocks12", "chunk>N"])
def test_chunk_sizes_the_blocks_do_not_divide(chunk_size, small_blocks):
    """Blocks of 12 tokens (chunk 6, block 16 rounded down) or one chunk longer than N."""
    q, k, v, mask = _inputs()
    fm = _fm("favor+", decay=True)
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=mask, window=7, sinks=2, chunk_size=chunk_size)
    _close(_grads(fm, (q, k, v), up, True, **kw), _grads(fm, (q, k, v), up, False, **kw), GRAD_FP32)


def test_queries_fewer_than_keys(small_blocks):
    """Nq < Nk: the queries are the last Nq positions."""
    q, k, v, mask = _inputs()
    fm = _fm("favor+")
    up = torch.randn(B, H, 20, D, generator=torch.Generator().manual_seed(1))
    tensors = (q[:, :, -20:], k, v)
    want = _grads(fm, tensors, up, False, attention_mask=mask, window=6, sinks=2)
    got = _grads(fm, tensors, up, True, attention_mask=mask, window=6, sinks=2)
    _close(got, want, GRAD_FP32)


@pytest.mark.parametrize("name,decay,window,sinks", [("favor+", False, 3, 2), ("favor+", True, 3, 1), ("hedgehog", False, 3, 0), ("favor+", False, 50, 1)], ids=["favor+-W3-S2", "favor+-decay-W3-S1", "hedgehog-W3", "W>=N-S1"])
def test_hybrid_function_gradcheck_float64(name, decay, window, sinks, monkeypatch):
    monkeypatch.setattr(attention, "hybrid_attention", functools.partial(attention.hybrid_attention, block_size=4))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 11, 3, generator=g, dtype=torch.float64).requires_grad_() for h in (2, 1, 1))
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, :2] = False
    fm = hf_rfa.build_feature_map(name, head_dim=3, num_features=4, seed=1, num_heads=2, num_kv_heads=1)
    if decay:
        fm.enable_decay(3.0)
    fm = fm.double()

    def f(q, k, v):
        out = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=2)
        assert _has_hybrid_function(out)
        return out[:, :, 2:]  # real rows

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6, fast_mode=True)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (each counted once per
    save); the result's backward is run to free them."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return total[0]


@pytest.mark.parametrize("decay", [False, True], ids=["plain", "decay"])
def test_saved_bytes_are_qkv_plus_o_of_n(decay, monkeypatch):
    """SmolLM2-shaped hybrid layer (9 query / 3 kv heads, D 64, m 256, window 64, 4 sinks,
    N = 1024): what autograd keeps is q, k, v once, the scan's state entering each 512-token
    block, and O(N) masks/gate terms — and the form of separate Functions exceeds that bound."""
    b, h, hkv, n, d, m = 1, 9, 3, 1024, 64, 256
    fm = hf_rfa.build_feature_map("favor+", head_dim=d, num_features=m, seed=0, num_heads=h, num_kv_heads=hkv)
    if decay:
        fm.enable_decay(64.0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, x, n, d, generator=g).requires_grad_() for x in (h, hkv, hkv))
    qkv = sum(t.numel() * t.element_size() for t in (q, k, v))
    states = (n // 512) * b * hkv * (m * (d + 1) + 1) * 4  # [F, Dv+1] and the reference, per block
    bound = qkv + states + 16 * b * h * n  # + O(N): 16 bytes per query row and head
    call = lambda: hf_rfa.random_feature_attention(q, k, v, fm, window=64, sinks=4)  # noqa: E731
    new = _saved_bytes(call)
    assert new <= bound, (new, bound)
    monkeypatch.setattr(attention, "_hybrid_function_applies", lambda *a: False)  # separate Functions
    old = _saved_bytes(call)
    assert old > 2 * bound, (old, bound)


def test_window_slice_fills_outside_positions():
    x = torch.arange(6.0).view(1, 6)
    assert _window_slice(x, -2, 3, 1, -1.0).tolist() == [[-1, -1, 0, 1, 2]]
    assert _window_slice(x, -5, -1, 1, 0.0).tolist() == [[0, 0, 0, 0]]
    assert _window_slice(x, 4, 8, 1, 9.0).tolist() == [[4, 5, 9, 9]]
    assert _window_slice(x, 1, 4, 1).data_ptr() == x[:, 1:].data_ptr()  # a view when nothing is filled


def _call(window, sinks):
    """A causal call plan at scale 0.3 (what hybrid_attention reads of the call)."""
    return CallPlan(AttentionSpec(window=window, sinks=sinks), True, 0.3, "torch")


def test_hybrid_attention_refuses_bad_arguments():
    q, k, v, mask = _inputs()
    fm = _fm("favor+")
    with pytest.raises(ValueError, match="window"):
        attention.hybrid_attention(q, k, v, fm, _call(0, 0), HybridArgs(mask, mask))
    with pytest.raises(ValueError, match="window"):
        attention.hybrid_attention(q, k, v, fm, _call(N, 0), HybridArgs(mask, mask))
    with pytest.raises(ValueError, match="feat_mask"):
        attention.hybrid_attention(q, k, v, fm, _call(4, 0), HybridArgs(mask, None))
