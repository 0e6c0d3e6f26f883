"""``feature_q``/``feature_k``: the feature part reads other tensors than the softmax part
(``RFAConfig(feature_input="unrotated")``: q/k before the rotary embedding).

Twins: the quadratic twin with the same feature inputs (an independent weight matrix built from
the definition for the simplest case), the op's autograd and recompute forms, float64 gradients
of every input and map parameter against the twin, and cached decoding against one full forward.
"""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import quadratic_kernel_attention, random_feature_attention
from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention
from conftest import rel
from tolerances import GRAD_FP64, ORACLE_FP32

B, H, HKV, D = 2, 4, 2, 8


def _map(name, decay=0.0, dtype=torch.float64, **kw):
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=16, seed=3, num_heads=H, num_kv_heads=HKV, **kw).to(dtype)
    if decay:
        fm.enable_decay(decay)
    return fm


def _inputs(n, dtype=torch.float64, seed=0, nq=None):
    g = torch.Generator().manual_seed(seed)
    q, k, v, fq, fk = (torch.randn(B, h, n, D, generator=g, dtype=dtype) for h in (H, HKV, HKV, H, HKV))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :3] = False
    if nq is not None:
        q, fq = q[:, :, -nq:], fq[:, :, -nq:]
    return q, k, v, fq, fk, mask


CASES = [  # (map, map kwargs, decay, causal, window, sinks, nq)
    ("favor+", {}, 0.0, True, 0, 0, None),
    ("favor+", {}, 0.0, True, 6, 2, None),
    ("favor+", {}, 0.0, True, 6, 2, 5),
    ("hedgehog", {"hybrid_mix": True}, 0.0, True, 5, 1, None),
    ("hedgehog", {"hybrid_mix": True}, 12.0, True, 5, 1, None),
    ("hedgehog", {}, 12.0, True, 0, 2, 7),
    ("rfa", {"gate": True}, 0.0, True, 4, 1, None),
    ("favor+", {}, 0.0, False, 0, 0, None),
    ("hedgehog", {"hybrid_mix": True}, 0.0, False, 4, 2, None),
]


@pytest.mark.parametrize("name,kw,decay,causal,window,sinks,nq", CASES)
@pytest.mark.parametrize("checkpoint", [True, False])
def test_op_equals_the_twin_with_feature_inputs(name, kw, decay, causal, window, sinks, nq, checkpoint):
    fm = _map(name, decay, **kw)
    q, k, v, fq, fk, mask = _inputs(29, nq=nq)
    args = dict(causal=causal, attention_mask=mask, window=window, sinks=sinks, feature_q=fq, feature_k=fk)
    out = random_feature_attention(q, k, v, fm, chunk_size=8, checkpoint_blocks=checkpoint, **args)
    ref = quadratic_kernel_attention(q, k, v, fm, **args)
    assert rel(out, ref) <= 1e-12
    plain = quadratic_kernel_attention(q, k, v, fm, causal=causal, attention_mask=mask, window=window, sinks=sinks)
    assert rel(plain, ref) > 1e-3  # the feature inputs are read (not q/k)


def test_float32_fast_paths_equal_the_twin():
    for name, kw, decay, causal, window, sinks, nq in CASES:
        fm = _map(name, decay, dtype=torch.float32, **kw)
        q, k, v, fq, fk, mask = _inputs(70, dtype=torch.float32, nq=nq)
        args = dict(causal=causal, attention_mask=mask, window=window, sinks=sinks, feature_q=fq, feature_k=fk)
        with torch.no_grad():
            out = random_feature_attention(q, k, v, fm, chunk_size=16, **args)
        ref = quadratic_kernel_attention(q.double(), k.double(), v.double(), fm.double(), **{**args, "feature_q": fq.double(), "feature_k": fk.double()})
        fm.float()
        assert rel(out.double(), ref) <= ORACLE_FP32, (name, causal, window)


def test_twin_equals_a_weight_matrix_built_from_the_definition():
    """Causal FAVOR+, window W and no sinks: weight exp(q_t·k_s/√D) for t−W < s ≤ t, else
    φ(fq_t)·φ(fk_s) (with the maps' log scales), one row normaliser."""
    fm = _map("favor+")
    q, k, v, fq, fk, _ = _inputs(17)
    w_ = 4
    x = D**-0.25
    kq = fm.forward_queries(fq * x)
    kk = fm.forward_keys(fk * x)
    g = H // HKV
    phi_q = kq.phi * kq.log_scale.exp().unsqueeze(-1) if kq.log_scale is not None else kq.phi
    phi_k = kk.phi * kk.log_scale.exp().unsqueeze(-1) if kk.log_scale is not None else kk.phi
    feat = phi_q @ phi_k.repeat_interleave(g, 1).transpose(-1, -2)
    exact = torch.exp((q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * D**-0.5)
    t = torch.arange(17).view(-1, 1)
    s = torch.arange(17).view(1, -1)
    w = torch.where((s <= t) & (s > t - w_), exact, torch.where(s <= t - w_, feat, torch.zeros_like(feat)))
    ref = (w @ v.repeat_interleave(g, 1)) / w.sum(-1, keepdim=True)
    out = quadratic_kernel_attention(q, k, v, fm, causal=True, window=w_, feature_q=fq, feature_k=fk)
    assert rel(out, ref) <= 1e-12


def test_feature_inputs_equal_to_q_and_k_change_nothing():
    fm = _map("hedgehog", 8.0, dtype=torch.float32, hybrid_mix=True)
    q, k, v, _, _, mask = _inputs(40, dtype=torch.float32)
    with torch.no_grad():
        a = random_feature_attention(q, k, v, fm, attention_mask=mask, window=5, sinks=2, chunk_size=8)
        b = random_feature_attention(q, k, v, fm, attention_mask=mask, window=5, sinks=2, chunk_size=8, feature_q=q.clone(), feature_k=k.clone())
    assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_gradients_equal_the_twin_float64(checkpoint):
    fm = _map("hedgehog", 6.0, hybrid_mix=True)
    q, k, v, fq, fk, mask = _inputs(23, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, fq, fk)]
    params = list(fm.parameters())
    assert params

    def grads(fn):
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        gs = [x.grad.clone() for x in leaves] + [p.grad.clone() for p in params]
        for x in leaves + params:
            x.grad = None
        return gs

    args = dict(attention_mask=mask, window=4, sinks=1)
    fast = grads(lambda q, k, v, fq, fk: random_feature_attention(q, k, v, fm, chunk_size=8, checkpoint_blocks=checkpoint, feature_q=fq, feature_k=fk, **args))
    twin = grads(lambda q, k, v, fq, fk: quadratic_kernel_attention(q, k, v, fm, feature_q=fq, feature_k=fk, **args))
    for a, b in zip(fast, twin):
        assert rel(a, b) <= GRAD_FP64
    assert all(float(g.abs().max()) > 0 for g in twin[3:5])  # the feature inputs get gradients


@pytest.mark.parametrize("name,kw,decay", [("favor+", {}, 0.0), ("hedgehog", {"hybrid_mix": True}, 9.0), ("rfa", {"gate": True}, 0.0)])
@pytest.mark.parametrize("window,sinks", [(6, 2), (0, 0), (5, 0)])
def test_cached_decoding_equals_one_full_forward(name, kw, decay, window, sinks):
    fm = _map(name, decay, **kw)
    q, k, v, fq, fk, mask = _inputs(41, seed=4)
    full = random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=8, feature_q=fq, feature_k=fk)
    state = DecodeState.empty((B, HKV, D, D, fm.feature_dim), sinks, torch.float64, compute_dtype=torch.float64, feature_keys=True)
    outs, t = [], 0
    for step in (13, 1, 1, 7, 1, 18):
        sl = slice(t, t + step)
        o, state = continue_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], DecodeCall(window=window, sinks=sinks, chunk_size=8), (fq[:, :, sl], fk[:, :, sl], None))
        outs.append(o)
        t += step
    assert rel(torch.cat(outs, 2), full) <= 1e-12
    assert state.win_kf.shape == (B, HKV, min(window, 41), D)
    plain = DecodeState.empty((B, HKV, D, D, fm.feature_dim), sinks, torch.float64, compute_dtype=torch.float64)
    plain_state = continue_attention(plain, q, k, v, fm, mask, DecodeCall(window=window, sinks=sinks, chunk_size=8))[1]
    assert state.nbytes() == plain_state.nbytes() + state.win_kf.numel() * 8  # the kept feature keys, nothing else


def test_nonfinite_feature_key_poisons_later_rows_only():
    fm = _map("favor+", dtype=torch.float32)
    q, k, v, fq, fk, _ = _inputs(20, dtype=torch.float32)
    fk[0, 1, 9, 3] = float("nan")
    with torch.no_grad():
        out = random_feature_attention(q, k, v, fm, window=3, feature_q=fq, feature_k=fk)
    g = H // HKV
    heads = slice(g, 2 * g)
    assert torch.isnan(out[0, heads, 9:]).all() and torch.isfinite(out[0, heads, :9]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, :g]).all()


def test_bad_feature_inputs_are_refused():
    fm = _map("favor+", dtype=torch.float32)
    q, k, v, fq, fk, _ = _inputs(10, dtype=torch.float32)
    with pytest.raises(ValueError, match="feature_q and feature_k go together"):
        random_feature_attention(q, k, v, fm, feature_q=fq)
    with pytest.raises(ValueError, match="feature_k must have the shape"):
        random_feature_attention(q, k, v, fm, feature_q=fq, feature_k=fk[:, :, :4])
    with pytest.raises(ValueError, match="feature_q must be a floating"):
        random_feature_attention(q, k, v, fm, feature_q=fq.long(), feature_k=fk)
    plain = DecodeState.empty((B, HKV, D, D, fm.feature_dim), 0, torch.float32)
    with pytest.raises(ValueError, match="feature_keys=True"):
        continue_attention(plain, q, k, v, fm, None, DecodeCall(window=2), (fq, fk, None))
    keeping = DecodeState.empty((B, HKV, D, D, fm.feature_dim), 0, torch.float32, feature_keys=True)
    with pytest.raises(ValueError, match="feature_keys=True"):
        continue_attention(keeping, q, k, v, fm, None, DecodeCall(window=2))


# --- cached decoding that derives the feature keys (feature_key_fn): no per-layer key copy ----------
def _rotary(n, seed=7):
    """Rotations ``(cos, sin)`` ``[B, n, D]`` of n positions, different per batch row (as with
    per-row position ids), in transformers' rotate_half convention."""
    ang = torch.rand(B, n, D // 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 40
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), -1) * sin.unsqueeze(1)


def _decode_deriving(q, k, v, fq, fm, mask, cos, sin, steps, window, sinks):
    from hf_rfa.hf.rope import unrotate

    state = DecodeState.empty((B, HKV, D, D, fm.feature_dim), sinks, torch.float64, compute_dtype=torch.float64)
    outs, t = [], 0
    for step in steps:
        sl, wc = slice(t, t + step), state.win_k.shape[2]
        block = slice(t - wc, t + step)  # the local block: kept window + new tokens

        def fn(x, block=block):
            return unrotate(x, cos[:, block], sin[:, block])

        o, state = continue_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], DecodeCall(window=window, sinks=sinks, chunk_size=8), (fq[:, :, sl], None, fn))
        outs.append(o)
        t += step
    return torch.cat(outs, 2), state


@pytest.mark.parametrize("name,kw,decay", [("favor+", {}, 0.0), ("hedgehog", {"hybrid_mix": True}, 9.0), ("rfa", {"gate": True}, 0.0)])
@pytest.mark.parametrize("window,sinks", [(6, 2), (0, 0), (5, 0), (50, 2)])  # 50 > the 41 tokens
@pytest.mark.parametrize("steps", [(1,) * 41, (13, 1, 1, 7, 1, 18)], ids=["token-by-token", "uneven-chunks"])
def test_cached_decoding_deriving_feature_keys_equals_one_full_forward(name, kw, decay, window, sinks, steps):
    """``feature_key_fn`` (the feature keys of the local block derived from the kept rotated keys):
    the same outputs as one full forward with ``feature_q/feature_k`` (GQA, left padding, sinks,
    decay/gate), and the state is exactly the plain one — no copy of the window's feature keys."""
    fm = _map(name, decay, **kw)
    q0, k0, v, fq, fk, mask = _inputs(41, seed=4)
    cos, sin = _rotary(41)
    q, k = _rotate(q0, cos, sin), _rotate(k0, cos, sin)  # the softmax part reads rotated q/k ...
    fq, fk = q0, k0  # ... the feature part the un-rotated ones
    full = random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=8, feature_q=fq, feature_k=fk)
    out, state = _decode_deriving(q, k, v, fq, fm, mask, cos, sin, steps, window, sinks)
    assert rel(out, full) <= 1e-10
    plain_full = random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=8)
    if window < 41:
        assert rel(plain_full, full) > 1e-5  # the derived feature keys are read (not the rotated keys)
    assert state.win_kf is None and state.seen == 41
    plain = DecodeState.empty((B, HKV, D, D, fm.feature_dim), sinks, torch.float64, compute_dtype=torch.float64)
    plain_state = continue_attention(plain, q, k, v, fm, mask, DecodeCall(window=window, sinks=sinks, chunk_size=8))[1]
    assert state.tensors().keys() == plain_state.tensors().keys()
    assert state.nbytes() == plain_state.nbytes()  # nothing per layer beyond the rotated-only state
    assert torch.equal(state.win_k, plain_state.win_k)  # the window keeps the rotated keys only


def test_deriving_and_keeping_feature_keys_agree():
    """The two ways of giving the window's feature keys (kept copy ``win_kf`` / derived by
    ``feature_key_fn``) give the same outputs and the same feature state; only the copy differs."""
    fm = _map("hedgehog", 7.0, hybrid_mix=True)
    q0, k0, v, _, _, mask = _inputs(30, seed=9)
    cos, sin = _rotary(30, seed=2)
    q, k = _rotate(q0, cos, sin), _rotate(k0, cos, sin)
    steps = (9, 1, 4, 1, 15)
    derived, st_d = _decode_deriving(q, k, v, q0, fm, mask, cos, sin, steps, 5, 1)
    st_k = DecodeState.empty((B, HKV, D, D, fm.feature_dim), 1, torch.float64, compute_dtype=torch.float64, feature_keys=True)
    outs, t = [], 0
    for step in steps:
        sl = slice(t, t + step)
        o, st_k = continue_attention(st_k, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], DecodeCall(window=5, sinks=1, chunk_size=8), (q0[:, :, sl], k0[:, :, sl], None))
        outs.append(o)
        t += step
    assert rel(derived, torch.cat(outs, 2)) <= 1e-12
    assert rel(st_d.linear.S, st_k.linear.S) <= 1e-12
    assert st_k.nbytes() - st_d.nbytes() == st_k.win_kf.numel() * 8


def test_bad_feature_key_fn_arguments_are_refused():
    fm = _map("favor+", dtype=torch.float32)
    q, k, v, fq, fk, _ = _inputs(10, dtype=torch.float32)
    plain = DecodeState.empty((B, HKV, D, D, fm.feature_dim), 0, torch.float32)
    ident = lambda x: x  # noqa: E731
    with pytest.raises(ValueError, match="feature_k must be None with feature_key_fn"):
        continue_attention(plain, q, k, v, fm, None, DecodeCall(window=2), (fq, fk, ident))
    with pytest.raises(ValueError, match="feature_key_fn needs feature_q"):
        continue_attention(plain, q, k, v, fm, None, DecodeCall(window=2), (None, None, ident))
    with pytest.raises(ValueError, match="feature_key_fn must be a callable"):
        continue_attention(plain, q, k, v, fm, None, DecodeCall(window=2), (fq, None, 3))
    keeping = DecodeState.empty((B, HKV, D, D, fm.feature_dim), 0, torch.float32, feature_keys=True)
    with pytest.raises(ValueError, match=r"feature_keys=False"):
        continue_attention(keeping, q, k, v, fm, None, DecodeCall(window=2), (fq, None, ident))
    with pytest.raises(ValueError, match="feature_key_fn must return a floating tensor of the local block's shape"):
        continue_attention(plain, q, k, v, fm, None, DecodeCall(window=2), (fq, None, lambda x: x[:, :, 1:]))
    with pytest.raises(ValueError, match="feature_q must have the shape"):
        continue_attention(plain, q, k, v, fm, None, DecodeCall(window=2), (fq[:, :, 1:], None, ident))
    with pytest.raises(ValueError, match="feature_key_fn="):  # a plain state without any feature keys: say how
        continue_attention(keeping, q, k, v, fm, None, DecodeCall(window=2))


@pytest.mark.parametrize("mode", ["derive", "keep"])
def test_nonfinite_feature_inputs_in_decoding_poison_like_the_full_forward(mode):
    """A non-finite feature query / real feature key: the rows softmax would make NaN; one of a
    padded position: nothing. The state stays finite (a derived key is derived again while kept)."""
    fm = _map("favor+")
    q, k, v, fq, _, mask = _inputs(12)  # row 1: positions 0-2 padded
    fq[1, 0, 4, 2] = float("inf")
    scale = torch.ones(B, 12, D, dtype=torch.float64)
    scale[0, 6] = float("nan")  # the feature key of position 6 in row 0
    scale[1, 1] = float("inf")  # and of a padded position
    fk = k * scale.unsqueeze(1)
    full = random_feature_attention(q, k, v, fm, attention_mask=mask, window=2, feature_q=fq, feature_k=fk)
    state = DecodeState.empty((B, HKV, D, D, fm.feature_dim), 0, torch.float64, compute_dtype=torch.float64, feature_keys=mode == "keep")
    outs, t = [], 0
    for step in (5, 1, 1, 5):
        sl, wc = slice(t, t + step), state.win_k.shape[2]
        blk = scale[:, t - wc:t + step]
        feat = (fq[:, :, sl], fk[:, :, sl], None) if mode == "keep" else (fq[:, :, sl], None, lambda x, blk=blk: x * blk.unsqueeze(1))
        o, state = continue_attention(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], fm, mask[:, sl], DecodeCall(window=2), feat)
        outs.append(o)
        t += step
    out = torch.cat(outs, 2)
    real = mask.bool()[:, None, :, None].expand_as(full)
    assert torch.equal(torch.isnan(out) & real, torch.isnan(full) & real) and torch.isnan(full).any()
    ok = ~torch.isnan(full) & real
    assert rel(out[ok], full[ok]) <= 1e-12
    assert all(torch.isfinite(x).all() for x in state.tensors().values() if x.is_floating_point())
