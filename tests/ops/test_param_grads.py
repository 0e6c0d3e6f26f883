"""Parameter gradients of every trainable feature map through the op equal the quadratic twin's.

float64, causal (recomputing scan and autograd form) and bidirectional, with and without window
and sinks, several scan blocks per sequence (the block size is made small here), left/right
padding, grouped-query heads. The signed maps (``rfa``, learnable ``rff``) are run where their
normaliser crosses zero in some rows, so the eps floor is exercised (asserted): there the output
depends on the stabilisation scale, and the gradient is the one with that scale held constant in
both forms (``ops/partial.finalize``). Before that was so, the op dropped the gradient of an
unmerged Partial's log scale on floored rows (rfa ``log_sigma``/gate, rff: 3-80% off).
A float64 ``gradcheck`` over the parameters (and q, k, v) checks the gradients themselves on a
tiny shape where no row is floored.
"""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import quadratic_kernel_attention
from hf_rfa.ops.feature import scan
from conftest import rel
from tolerances import GRAD_FP64

B, H, HKV, D, M = 2, 4, 2, 8, 16

#: every registered map with trainable parameters, in each of its trainable forms
TRAINABLE = {
    "rfa-gate": ("rfa", {"gate": True, "num_kv_heads": HKV}),
    "rfa": ("rfa", {"num_kv_heads": HKV}),
    "hedgehog": ("hedgehog", {"num_heads": H, "num_kv_heads": HKV}),
    "hedgehog-mix": ("hedgehog", {"num_heads": H, "num_kv_heads": HKV, "hybrid_mix": True}),
    "t2r": ("t2r", {"num_heads": H, "num_kv_heads": HKV}),
    "rff-learnable": ("rff", {"learnable": True}),
    "positive-learnable": ("positive", {"learnable": True}),
    "favor+-learnable": ("favor+", {"learnable": True}),
    "favor++-learnable": ("favor++", {"learnable": True}),
}
#: the cases where the signed normaliser is floored in some rows (checked, not assumed, causal)
FLOORED = {"rfa-gate", "rfa", "rff-learnable"}
SETTINGS = [(True, 0, 0, True), (True, 0, 0, False), (True, 5, 2, True), (True, 5, 2, False), (True, 0, 3, True), (False, 0, 0, True), (False, 4, 1, True)]
SETTING_IDS = ["causal-ckpt", "causal-autograd", "causal-W5S2-ckpt", "causal-W5S2-autograd", "causal-S3-ckpt", "bidir", "bidir-W4S1"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 16 tokens: the scan (and its recompute) carries state across several blocks."""
    monkeypatch.setattr(scan, "DEFAULT_BLOCK_SIZE", 16)


def _map(key: str, seed: int = 1, spread: float = 0.3):
    """The map in float64 with every parameter moved off its initial value (seeded)."""
    name, kw = TRAINABLE[key]
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=M, seed=0, **kw).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(spread * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return fm


def _inputs(n: int, causal: bool, std: float = 1.0, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = std * torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    k = std * torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, n, dtype=torch.bool)
    if causal:
        mask[1, :5] = False  # left padding
    else:
        mask[1, -5:] = False  # right padding
    up = torch.randn(B, H, n, D, generator=g, dtype=torch.float64) * mask[:, None, :, None]
    return q, k, v, mask, up


def _grads(fn, fm, q, k, v, up, **kw):
    fm.zero_grad()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, fm, **kw)
    (out * up).sum().backward()
    return out.detach(), {"q": leaves[0].grad, "k": leaves[1].grad, "v": leaves[2].grad} | {n: p.grad.clone() for n, p in fm.named_parameters() if p.grad is not None}


def _floored(fm, q, k, v, **kw) -> bool:
    """Whether any row's normaliser is on the eps floor (the output changes with a tiny floor)."""
    with torch.no_grad():
        a = quadratic_kernel_attention(q, k, v, fm, **kw)
        eps, fm.eps = fm.eps, 1e-300
        try:
            b = quadratic_kernel_attention(q, k, v, fm, **kw)
        finally:
            fm.eps = eps
    return not torch.equal(a, b)


def _rel_floored(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """``rel(a, b)``, with the denominator at least 1e-6 of ``ref``'s norm: a gradient that is
    exactly 0 in exact arithmetic (hedgehog's ``mix`` where no exact part is merged: the scale
    cancels) is rounding noise in both forms."""
    return float((a - b).norm() / torch.maximum(b.norm(), 1e-6 * ref.norm()))


def test_every_trainable_map_is_covered():
    for name in hf_rfa.available_feature_maps():
        if any(n == name for n, _ in TRAINABLE.values()):
            continue
        fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=M)
        assert not any(p.requires_grad for p in fm.parameters()), f"{name} has trainable parameters but no gradient twin test"


@pytest.mark.parametrize("key", list(TRAINABLE))
@pytest.mark.parametrize("causal,window,sinks,ckpt", SETTINGS, ids=SETTING_IDS)
def test_parameter_gradients_match_quadratic_twin(key, causal, window, sinks, ckpt):
    n = 45  # 3 scan blocks (last one short)
    q, k, v, mask, up = _inputs(n, causal)
    fm = _map(key)
    kw = dict(causal=causal, attention_mask=mask, window=window, sinks=sinks)
    if key in FLOORED and causal and window == 0 and sinks == 0:
        assert _floored(fm, q, k, v, **kw), "this case is meant to exercise the eps floor"
    out_op, g_op = _grads(hf_rfa.random_feature_attention, fm, q, k, v, up, chunk_size=8, checkpoint_blocks=ckpt, **kw)
    out_tw, g_tw = _grads(quadratic_kernel_attention, fm, q, k, v, up, **kw)
    assert rel(out_op, out_tw) <= GRAD_FP64
    assert g_op.keys() == g_tw.keys()
    params = [n for n, p in fm.named_parameters()]
    if not causal and key == "rfa-gate":
        params.remove("gate_weight"), params.remove("gate_bias")  # the gate is causal only
    assert set(params) <= g_tw.keys()
    for name in g_tw:
        assert _rel_floored(g_op[name], g_tw[name], g_tw["v"]) <= GRAD_FP64, name


@pytest.mark.parametrize("key", list(TRAINABLE))
@pytest.mark.parametrize("causal,window,sinks", [(True, 0, 0), (True, 2, 1), (False, 0, 0), (False, 2, 1)], ids=["causal", "causal-W2S1", "bidir", "bidir-W2S1"])
def test_gradcheck_parameters_float64(key, causal, window, sinks):
    b, h, hkv, n, d = 1, 2, 1, 7, 4
    name, kw = TRAINABLE[key]
    kw = {k_: v_ for k_, v_ in kw.items() if k_ not in ("num_heads", "num_kv_heads")}
    if name in ("hedgehog", "t2r"):
        kw |= {"num_heads": h, "num_kv_heads": hkv}
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=8, seed=0, **kw).double()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    q, k, v = (0.5 * torch.randn(b, hh, n, d, generator=g, dtype=torch.float64) for hh in (h, hkv, hkv))
    names = [nm for nm, p in fm.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in fm.parameters()]
    assert not _floored(fm, q, k, v, causal=causal, window=window, sinks=sinks)

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fm = fm

        def forward(self, q, k, v):
            return hf_rfa.random_feature_attention(q, k, v, self.fm, causal=causal, window=window, sinks=sinks, chunk_size=3)

    call = Call()

    def f(q, k, v, *ps):
        return torch.func.functional_call(call, {f"fm.{nm}": p for nm, p in zip(names, ps)}, (q, k, v))

    leaves = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(f, (*leaves, *params), eps=1e-6, atol=1e-6, fast_mode=True)
