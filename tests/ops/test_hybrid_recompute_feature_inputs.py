"""The recomputing causal hybrid (``HybridFunction``) with feature inputs (``feature_q``/
``feature_k``: the feature scan reads other q/k than the exact window and sinks, as
``RFAConfig(feature_input="unrotated")``), and the recomputing Functions' parameter handling.

Twins: the autograd form (``checkpoint_blocks=False``) with the same inputs — output and
gradients of q, k, v, feature_q, feature_k and every map parameter, float32 and float64; float64
gradcheck; the saved-tensor bytes (q, k, v, feature_q, feature_k once plus O(N)) against the
separate band/scan Functions. Parameters: under ``torch.func.functional_call`` the gradients are
those of the autograd form with the same substitute parameters (``HybridFunction`` and
``ScanFunction``), and a parameter changed in place between forward and backward is an error
(before, backward silently recomputed with the map's current tensors).
"""
import functools

import pytest
import torch

import hf_rfa
from hf_rfa.ops import attention
from conftest import rel
from tolerances import GRAD_FP32, GRAD_FP64

B, H, HKV, N, D = 2, 4, 2, 53, 8
# the same forms-only and small-block fixtures as the plain hybrid tests (pytorch_forms_only is autouse)
from test_hybrid_recompute import pytorch_forms_only, small_blocks  # noqa: E402,F401
def _inputs(n=N, h=H, hkv=HKV, dtype=torch.float32, seed=0, pad=True):
    """q, k, v, feature_q, feature_k (independent draws) and a padding mask."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, fq, fk = (0.7 * torch.randn(B, x, n, D, generator=g, dtype=dtype) for x in (h, hkv, hkv, h, hkv))
    mask = torch.ones(B, n, dtype=torch.bool)
    if pad:
        mask[-1, :5] = False  # left padding in the last row
    return q, k, v, fq, fk, mask
def _fm(name, decay=False, dtype=torch.float32, h=H, hkv=HKV):
    kw = {"gate": True} if name == "rfa" else {"hybrid_mix": True} if name == "hedgehog-mix" else {}
    fm = hf_rfa.build_feature_map(name.split("-")[0], head_dim=D, num_features=12, seed=3, num_heads=h, num_kv_heads=hkv, **kw)
    if decay:
        fm.enable_decay(6.0)
        with torch.no_grad():  # a different half-life per kv head
            fm.decay_log_rate.add_(torch.linspace(0.0, 1.0, hkv))
    if name == "rfa":  # an input-dependent gate (computed from the feature keys) that really decays
        with torch.no_grad():
            fm.gate_weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    return fm.to(dtype)
def _graph_has(out: torch.Tensor, name: str) -> bool:
    """Whether a node whose type name contains ``name`` is in ``out``'s graph."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if name in type(fn).__name__:
            return True
        todo += [f for f, _ in fn.next_functions]
    return False
def _grads(fm, tensors, up, ckpt, chunk_size=4, **kw):
    """Output and gradients (q, k, v, feature_q, feature_k, then every map parameter) of
    ``(op * up).sum()``."""
    fm.zero_grad()
    q, k, v, fq, fk = leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = hf_rfa.random_feature_attention(q, k, v, fm, chunk_size=chunk_size, checkpoint_blocks=ckpt, feature_q=fq, feature_k=fk, **kw)
    assert _graph_has(out, "HybridFunction") == ckpt
    (out * up).sum().backward()
    return [out] + [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in fm.parameters()]
def _close(got: list, want: list, tol: float) -> None:
    """Each pair within ``tol`` (relative), or both None (a parameter without a gradient)."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert rel(a, b) <= tol, (i, rel(a, b))
CASES = {  # name: (map, decay, window, sinks, padding, query heads)
    "favor+-W6-S3": ("favor+", False, 6, 3, True, H),
    "favor+-W20-S2-nopad": ("favor+", False, 20, 2, False, H),
    "favor+-S3": ("favor+", False, 0, 3, True, H),
    "favor+-decay-W6-S2": ("favor+", True, 6, 2, True, H),
    "favor+-MHA-W6-S1": ("favor+", False, 6, 1, True, HKV),
    "hedgehog-W6-S2": ("hedgehog", False, 6, 2, True, H),
    "hedgehog-W6": ("hedgehog", False, 6, 0, False, H),
    "hedgehog-decay-W6-S2": ("hedgehog", True, 6, 2, True, H),
    "hedgehog-mix-decay-W5-S1": ("hedgehog-mix", True, 5, 1, True, H),
    "hedgehog-W>=N-S2": ("hedgehog", False, 60, 2, True, H),
    "rfa-gate-W6-S2": ("rfa", False, 6, 2, True, H),
}
@pytest.mark.parametrize("case", list(CASES))
def test_feature_inputs_match_autograd_form_float32(case, small_blocks):
    name, decay, window, sinks, pad, h = CASES[case]
    q, k, v, fq, fk, mask = _inputs(h=h, pad=pad)
    fm = _fm(name, decay, h=h)
    up = torch.randn(B, h, N, D, generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=mask, window=window, sinks=sinks)
    want = _grads(fm, (q, k, v, fq, fk), up, False, **kw)
    got = _grads(fm, (q, k, v, fq, fk), up, True, **kw)
    assert len(got) == 6 + len(list(fm.parameters()))
    if window < N:  # every input and parameter gets a gradient (W >= N: no feature part)
        assert all(x is not None for x in got) and all(float(g.abs().max()) > 0 for g in got[4:6])
    _close(got, want, GRAD_FP32)
@pytest.mark.parametrize("case", ["favor+-W6-S3", "favor+-decay-W6-S2", "hedgehog-decay-W6-S2", "hedgehog-mix-decay-W5-S1", "rfa-gate-W6-S2"])
def test_feature_inputs_match_autograd_form_float64(case, small_blocks):
    name, decay, window, sinks, pad, h = CASES[case]
    q, k, v, fq, fk, mask = _inputs(h=h, pad=pad, dtype=torch.float64)
    fm = _fm(name, decay, torch.float64, h=h)
    up = torch.randn(B, h, N, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kw = dict(attention_mask=mask, window=window, sinks=sinks)
    want = _grads(fm, (q, k, v, fq, fk), up, False, **kw)
    got = _grads(fm, (q, k, v, fq, fk), up, True, **kw)
    assert got[0].dtype == torch.float64
    _close(got, want, GRAD_FP64)
@pytest.mark.parametrize("chunk_size", [6, 64], ids=["chunk6-blocks12", "chunk>N"])
def test_chunk_sizes_the_blocks_do_not_divide(chunk_size, small_blocks):
    """Blocks of 12 tokens (chunk 6, block 16 rounded down) or one chunk longer than N."""
    q, k, v, fq, fk, mask = _inputs()
    fm = _fm("hedgehog", decay=True)
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=mask, window=7, sinks=2, chunk_size=chunk_size)
    _close(_grads(fm, (q, k, v, fq, fk), up, True, **kw), _grads(fm, (q, k, v, fq, fk), up, False, **kw), GRAD_FP32)
def test_queries_fewer_than_keys(small_blocks):
    """Nq < Nk: the queries (and feature queries) are the last Nq positions."""
    q, k, v, fq, fk, mask = _inputs()
    fm = _fm("favor+", decay=True)
    up = torch.randn(B, H, 20, D, generator=torch.Generator().manual_seed(1))
    tensors = (q[:, :, -20:], k, v, fq[:, :, -20:], fk)
    kw = dict(attention_mask=mask, window=6, sinks=2)
    _close(_grads(fm, tensors, up, True, **kw), _grads(fm, tensors, up, False, **kw), GRAD_FP32)
def test_dispatcher_passes_feature_inputs_to_hybrid_function(monkeypatch):
    """The causal hybrid in training with feature inputs runs HybridFunction, and the feature
    inputs reach it (not q/k); the separate band/scan Functions are not used."""
    seen = []
    real = attention.hybrid_attention

    def spy(*a, **kw):
        args = a[5]  # the HybridArgs
        seen.append((args.feature_q, args.feature_k))
        return real(*a, **kw)

    monkeypatch.setattr(attention, "hybrid_attention", spy)
    q, k, v, fq, fk, mask = (x.requires_grad_() if x.is_floating_point() else x for x in _inputs())
    fm = _fm("hedgehog", decay=True)
    out = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=6, sinks=2, chunk_size=4, feature_q=fq, feature_k=fk)
    assert len(seen) == 1 and seen[0][0] is not None and seen[0][1] is not None
    assert torch.equal(seen[0][0], fq) and torch.equal(seen[0][1], fk)
    assert _graph_has(out, "HybridFunction")
    assert not _graph_has(out, "BandFunction") and not _graph_has(out, "ScanFunction")
@pytest.mark.parametrize("name,decay,window,sinks", [("favor+", False, 3, 2), ("hedgehog", True, 3, 1), ("hedgehog", False, 0, 2)], ids=["favor+-W3-S2", "hedgehog-decay-W3-S1", "hedgehog-S2"])
def test_gradcheck_float64(name, decay, window, sinks, monkeypatch):
    monkeypatch.setattr(attention, "hybrid_attention", functools.partial(attention.hybrid_attention, block_size=4))
    g = torch.Generator().manual_seed(0)
    q, k, v, fq, fk = (torch.randn(1, h, 11, 3, generator=g, dtype=torch.float64).requires_grad_() for h in (2, 1, 1, 2, 1))
    mask = torch.ones(1, 11, dtype=torch.bool)
    mask[0, :2] = False
    fm = hf_rfa.build_feature_map(name, head_dim=3, num_features=4, seed=1, num_heads=2, num_kv_heads=1)
    if decay:
        fm.enable_decay(3.0)
    fm = fm.double()

    def f(q, k, v, fq, fk):
        out = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=2, feature_q=fq, feature_k=fk)
        assert _graph_has(out, "HybridFunction")
        return out[:, :, 2:]  # real rows

    assert torch.autograd.gradcheck(f, (q, k, v, fq, fk), eps=1e-6, atol=1e-6, fast_mode=True)
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
def test_saved_bytes_are_inputs_plus_o_of_n(monkeypatch):
    """SmolLM2-shaped un-rotated hybrid layer (9 query / 3 kv heads, D 64, Hedgehog m 64 with a
    decay, window 64, 4 sinks, N = 1024): what autograd keeps is q, k, v, feature_q, feature_k
    once, the map's parameters (saved, not copied), the scan's state entering each 512-token block
    and O(N) masks/gate terms — and the form of separate Functions exceeds that bound."""
    b, h, hkv, n, d, m = 1, 9, 3, 1024, 64, 64
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=d, num_features=m, seed=0, num_heads=h, num_kv_heads=hkv)
    fm.enable_decay(64.0)
    g = torch.Generator().manual_seed(0)
    q, k, v, fq, fk = (torch.randn(b, x, n, d, generator=g).requires_grad_() for x in (h, hkv, hkv, h, hkv))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, fq, fk))
    params = sum(p.numel() * p.element_size() for p in fm.parameters())
    states = (n // 512) * b * hkv * (fm.feature_dim * (d + 1) + 1) * 4  # [F, Dv+1] and the reference, per block
    bound = inputs + params + states + 16 * b * h * n  # + O(N): 16 bytes per query row and head
    call = lambda: hf_rfa.random_feature_attention(q, k, v, fm, window=64, sinks=4, feature_q=fq, feature_k=fk)  # noqa: E731
    new = _saved_bytes(call)
    assert new <= bound, (new, bound)
    monkeypatch.setattr(attention, "_hybrid_function_applies", lambda *a: False)  # separate Functions
    old = _saved_bytes(call)
    assert old > 1.5 * bound, (old, bound)
# ---- parameters: backward uses the tensors forward ran with ------------------------------------
class _Layer(torch.nn.Module):
    """One attention call as a Module, so that ``torch.func.functional_call`` can substitute the
    map's parameters (``fm.<name>``)."""

    def __init__(self, fm, **kw):
        super().__init__()
        self.fm = fm
        self.kw = kw

    def forward(self, q, k, v, fq=None, fk=None):
        return hf_rfa.random_feature_attention(q, k, v, self.fm, feature_q=fq, feature_k=fk, **self.kw)
def _substitutes(fm, seed=7):
    """Parameters unlike the map's own (leaves requiring grad), by name."""
    g = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)).requires_grad_() for n, p in fm.named_parameters()}
def _functional_grads(fm, tensors, ckpt, fn_name, **kw):
    """Output and gradients of the inputs and of substitute parameters under functional_call;
    the map's own parameters get no gradient."""
    fm.zero_grad()
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    subs = _substitutes(fm)
    out = torch.func.functional_call(_Layer(fm, checkpoint_blocks=ckpt, chunk_size=4, **kw), {"fm." + n: t for n, t in subs.items()}, tuple(leaves))
    assert _graph_has(out, fn_name) == ckpt
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    assert all(p.grad is None for p in fm.parameters())
    return [out] + [t.grad for t in leaves] + [subs[n].grad for n in sorted(subs)]
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("form", ["hybrid-feature-inputs", "hybrid", "scan"])
def test_functional_call_parameters_are_used_in_backward(form, dtype, small_blocks):
    """Under functional_call the recomputing Functions' gradients are the autograd form's with the
    same substitute parameters (before: backward recomputed with the map's own parameters)."""
    q, k, v, fq, fk, mask = _inputs(dtype=dtype)
    fm = _fm("hedgehog-mix", decay=True, dtype=dtype)
    tensors = (q, k, v, fq, fk) if form == "hybrid-feature-inputs" else (q, k, v)
    kw = dict(attention_mask=mask, window=6, sinks=2) if form != "scan" else dict(attention_mask=mask)
    fn_name = "ScanFunction" if form == "scan" else "HybridFunction"
    got = _functional_grads(fm, tensors, True, fn_name, **kw)
    want = _functional_grads(fm, tensors, False, fn_name, **kw)
    assert all(g is not None for g in got)
    _close(got, want, GRAD_FP32 if dtype == torch.float32 else GRAD_FP64)
    # and the substitutes matter: the map's own parameters give other gradients
    own = _grads_plain(fm, tensors, **kw)
    assert rel(got[1], own[1]) > 1e-3
def _grads_plain(fm, tensors, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = _Layer(fm, checkpoint_blocks=True, chunk_size=4, **kw)(*leaves)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    fm.zero_grad()
    return [out] + [t.grad for t in leaves]
@pytest.mark.parametrize("name", ["hedgehog", "favor+-learnable"])
@pytest.mark.parametrize("form", ["hybrid-feature-inputs", "hybrid", "scan"])
def test_parameter_changed_between_forward_and_backward_is_an_error(form, name):
    """An in-place update of a map parameter between forward and backward makes the recomputing
    Functions' backward fail (the parameter is saved, with its version), never recompute with the
    updated tensor as before. (The autograd form fails too where its ops save the parameter
    itself — learnable FAVOR+ — and keeps the forward's values where they save a copy: Hedgehog's
    per-head broadcast matmul.)"""
    q, k, v, fq, fk, mask = _inputs()
    tensors = (q, k, v, fq, fk) if form == "hybrid-feature-inputs" else (q, k, v)
    kw = dict(attention_mask=mask, window=6, sinks=2) if form != "scan" else dict(attention_mask=mask)
    for ckpt in (True, False) if name == "favor+-learnable" else (True,):
        if name == "hedgehog":
            fm = _fm("hedgehog")
        else:
            fm = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=12, seed=3, num_heads=H, num_kv_heads=HKV, learnable=True)
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = _Layer(fm, checkpoint_blocks=ckpt, chunk_size=4, **kw)(*leaves)
        assert _graph_has(out, "ScanFunction" if form == "scan" else "HybridFunction") == ckpt
        with torch.no_grad():
            next(fm.parameters()).mul_(1.5)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
def test_frozen_map_parameters_get_no_gradient(small_blocks):
    """A frozen map (e.g. LoRA on the model only): q, k, v and the feature inputs still get the
    autograd form's gradients, the parameters none."""
    q, k, v, fq, fk, mask = _inputs()
    fm = _fm("hedgehog", decay=True).requires_grad_(False)
    up = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=mask, window=6, sinks=2)
    got = _grads(fm, (q, k, v, fq, fk), up, True, **kw)
    want = _grads(fm, (q, k, v, fq, fk), up, False, **kw)
    assert all(g is None for g in got[6:])
    _close(got, want, GRAD_FP32)
