"""The fast paths of the causal op: blocked chunk scans (any chunk/block size, odd lengths),
the unscaled (``lk is None``) path, carried states, and the fused per-block feature path used by
``random_feature_attention`` — each against a quadratic reference. These are the PyTorch forms:
the compiled CPU kernel (``hf_rfa.ops.backends.native``) is switched off here and tested against them in
``test_native.py``."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import LinearState, finalize, fold, quadratic_kernel_attention
from hf_rfa.ops.feature.fused import ScanRun, causal_feature_attention
from hf_rfa.ops.feature.linear import causal_linear
from hf_rfa.ops.masks import NEG
from tolerances import GRAD_FP32, ORACLE_FP32
from conftest import rel


@pytest.fixture(autouse=True)
def pytorch_forms_only():
    from hf_rfa.ops.backends import native

    old = native.native_enabled()
    native.set_native(False)
    yield
    native.set_native(old)


def features(b=2, hkv=2, g=2, n=63, f=12, dv=8, lscale=3.0, seed=0, scaled=True):
    gen = torch.Generator().manual_seed(seed)
    qf = torch.rand(b, hkv, g, n, f, generator=gen)
    kf = torch.rand(b, hkv, n, f, generator=gen)
    v = torch.randn(b, hkv, n, dv, generator=gen)
    lq = lscale * torch.randn(b, hkv, g, n, generator=gen) if scaled else None
    lk = lscale * torch.randn(b, hkv, n, generator=gen) if scaled else None
    return qf, lq, kf, lk, v


def masked_features(fm, xq, xk, mask):
    """Whole-sequence features in the ops' layout: ``qf [B,Hkv,G,N,F]``, ``lq``, and keys with
    padded positions (``mask`` False) zeroed / at log scale NEG."""
    b, h, n, _ = xq.shape
    hkv = xk.shape[1]
    fq, fk = fm.forward_queries(xq), fm.forward_keys(xk)
    qf = fq.phi.reshape(b, hkv, h // hkv, n, -1)
    lq = fq.log_scale.reshape(b, hkv, h // hkv, n) if fq.log_scale is not None else None
    kf = fk.phi * mask[:, None, :, None]
    lk = torch.where(mask[:, None], fk.log_scale, torch.full_like(fk.log_scale, NEG)) if fk.log_scale is not None else None
    return qf, lq, kf, lk


def quadratic(qf, lq, kf, lk, v, prefix=0):
    """float64 ``Σ_{s≤t} φq_t·φk_s e^{lq_t+lk_s} v_s / Σ(…)``; queries are the last rows, keys may
    include ``prefix`` earlier positions (seen by every query)."""
    qf, kf, v = qf.double(), kf.double(), v.double()
    n, nk = qf.shape[-2], kf.shape[-2]
    lq = torch.zeros(qf.shape[:-1], dtype=torch.float64) if lq is None else lq.double()
    lk = torch.zeros(kf.shape[:-1], dtype=torch.float64) if lk is None else lk.double()
    dot = qf @ kf.unsqueeze(2).transpose(-1, -2)  # [B,Hkv,G,N,Nk]
    logw = lq.unsqueeze(-1) + lk[:, :, None, None, :]
    t = torch.arange(nk - n, nk).view(-1, 1)
    s = torch.arange(nk).view(1, -1)
    vis = s <= t
    off = torch.where(vis, logw, torch.full_like(logw, -1e300)).amax(-1, keepdim=True)
    w = dot * torch.exp(torch.where(vis, logw - off, torch.full_like(logw, -1e300)))
    return (w @ v.unsqueeze(2)) / w.sum(-1, keepdim=True)


def out_of(part):
    return finalize(part, 1e-30)


@pytest.mark.parametrize("n", [1, 63, 500])
@pytest.mark.parametrize("chunk,block", [(1, 1), (3, 7), (16, 16), (16, 48), (64, None), (64, 1024), (500, None)])
@pytest.mark.parametrize("scaled", [True, False], ids=["logscale", "unscaled"])
def test_blocked_causal_linear_matches_quadratic(n, chunk, block, scaled):
    qf, lq, kf, lk, v = features(n=n, scaled=scaled)
    part, _ = causal_linear(qf, lq, kf, lk, v, chunk, block_size=block)
    assert part.num.shape == (2, 2, 2, n, 8) and part.den.shape == part.log_scale.shape == (2, 2, 2, n)
    assert rel(out_of(part), quadratic(qf, lq, kf, lk, v)) <= ORACLE_FP32


def test_large_log_scale_jumps_stay_exact():
    """Key log scales jumping by hundreds (within a chunk and across blocks) never overflow."""
    qf, lq, kf, lk, v = features(n=200, lscale=80.0, seed=3)
    lk[..., 150] = 400.0  # a huge key late in the sequence
    part, st = causal_linear(qf, lq, kf, lk, v, 16, block_size=32)
    assert torch.isfinite(part.num).all() and torch.isfinite(st.S).all()
    assert rel(out_of(part), quadratic(qf, lq, kf, lk, v)) <= ORACLE_FP32


@pytest.mark.parametrize("chunk,block", [(4, 8), (16, None)])
@pytest.mark.parametrize("scaled", [True, False], ids=["logscale", "unscaled"])
def test_carried_state_and_returned_state(chunk, block, scaled):
    qf, lq, kf, lk, v = features(n=90, scaled=scaled, seed=1)
    p = 37  # prefix folded into the state, the rest run with it
    st0 = fold(LinearState.zeros(2, 2, 12, 8), kf[:, :, :p], None if lk is None else lk[..., :p], v[:, :, :p])
    part, st = causal_linear(qf[:, :, :, p:], None if lq is None else lq[..., p:], kf[:, :, p:], None if lk is None else lk[..., p:], v[:, :, p:], chunk, st0, block_size=block)
    ref = quadratic(qf[:, :, :, p:], None if lq is None else lq[..., p:], kf, lk, v)
    assert rel(out_of(part), ref) <= ORACLE_FP32
    # the returned state equals folding every key at once
    full = fold(LinearState.zeros(2, 2, 12, 8), kf, lk, v)
    assert rel(st.S * torch.exp(st.ref - full.ref)[..., None, None], full.S) <= ORACLE_FP32
    assert rel(st.z * torch.exp(st.ref - full.ref)[..., None], full.z) <= ORACLE_FP32


def test_masked_keys_and_empty_prefix():
    """Keys with NEG log scale and zero features (padding) contribute nothing; rows with no
    visible key have den == 0 and a finite output after finalize."""
    qf, lq, kf, lk, v = features(n=50, seed=2)
    kf[:, :, :9] = 0.0
    lk[:, :, :9] = NEG
    part, _ = causal_linear(qf, lq, kf, lk, v, 8, block_size=16)
    assert (part.den[..., :9] == 0).all()
    assert torch.isfinite(out_of(part)).all()
    assert rel(out_of(part)[..., 9:, :], quadratic(qf, lq, kf, lk, v)[..., 9:, :]) <= ORACLE_FP32


@pytest.mark.parametrize("name", ["favor+", "rff", "hedgehog", "elu", "rfa"])
@pytest.mark.parametrize("n", [1, 63, 500])
def test_fused_feature_path_equals_unfused(name, n):
    b, h, hkv, d = 2, 4, 2, 16
    gen = torch.Generator().manual_seed(4)
    xq = 0.5 * torch.randn(b, h, n, d, generator=gen)
    xk = 0.5 * torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, : n // 3] = False
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=8)
    qf, lq, kf, lk = masked_features(fm, xq, xk, mask)
    ref, st_ref = causal_linear(qf, lq, kf, lk, v, 16)
    for chunk, block in ((16, None), (5, 15), (64, 64)):
        part, st = causal_feature_attention(fm, xq, xk, v, (mask, None, None), ScanRun(chunk, block_size=block))
        ok = mask.view(b, 1, 1, n).expand(part.den.shape)
        assert rel(out_of(part)[ok], out_of(ref)[ok]) <= ORACLE_FP32
        assert rel(st.S, st_ref.S) <= ORACLE_FP32


@pytest.mark.parametrize("name", ["favor+", "rfa", "hedgehog"])
@pytest.mark.parametrize("n,chunk", [(1, 64), (63, 7), (500, 64), (500, 1)])
def test_public_causal_path_matches_quadratic_twin(name, n, chunk):
    gen = torch.Generator().manual_seed(5)
    b, h, hkv, d = 1, 4, 2, 16
    q, k, v = (torch.randn(b, hh, n, d, generator=gen) for hh in (h, hkv, hkv))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, : n // 4] = False
    kw = {"gate": True} if name == "rfa" else {}
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=16, **kw)
    fast = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, chunk_size=chunk, sinks=1 if n > 1 else 0)
    ref = quadratic_kernel_attention(q, k, v, fm, causal=True, attention_mask=mask, sinks=1 if n > 1 else 0)
    sel = mask[0]
    assert rel(fast[:, :, sel], ref[:, :, sel]) <= ORACLE_FP32


@pytest.mark.parametrize("chunk,block", [(16, None), (4, 12), (7, 7)])
def test_fused_path_is_streaming_safe(chunk, block):
    """Earlier outputs are bit-identical when later tokens (same chunk, later chunks, later
    blocks) change, whatever the chunk/block boundaries."""
    gen = torch.Generator().manual_seed(6)
    b, h, n, d = 1, 2, 70, 16
    xq, xk, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    fm = hf_rfa.build_feature_map("favor+", head_dim=d, num_features=16)
    p1, _ = causal_feature_attention(fm, xq, xk, v, (None, None, None), ScanRun(chunk, block_size=block))
    for t in (0, 5, 29, 40):
        xq2, xk2, v2 = xq.clone(), xk.clone(), v.clone()
        xq2[:, :, t + 1 :] *= 30
        xk2[:, :, t + 1 :] = 30 * torch.randn(b, h, n - t - 1, d, generator=gen)
        v2[:, :, t + 1 :] = torch.randn(b, h, n - t - 1, d, generator=gen)
        p2, _ = causal_feature_attention(fm, xq2, xk2, v2, (None, None, None), ScanRun(chunk, block_size=block))
        for a, c in ((p1.num, p2.num), (p1.den, p2.den), (p1.log_scale, p2.log_scale)):
            assert torch.equal(a[:, :, :, : t + 1], c[:, :, :, : t + 1])


@pytest.mark.parametrize("name", ["favor+", "rff", "rfa"])
def test_fused_path_gradients(name):
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, n, d = 1, 4, 2, 45, 8
    q, k, v = (torch.randn(b, hh, n, d, generator=gen) for hh in (h, hkv, hkv))
    if name == "rff":
        q, k = 0.4 * q, 0.4 * k
    kw = {"gate": True} if name == "rfa" else {}
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=8, **kw)
    up = torch.randn(b, h, n, d, generator=gen)
    grads = []
    for fn in (lambda *a: hf_rfa.random_feature_attention(*a, causal=True, chunk_size=4), lambda *a: quadratic_kernel_attention(*a, causal=True)):
        fm.zero_grad()
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        (fn(qq, kk, vv, fm) * up).sum().backward()
        grads.append([qq.grad, kk.grad, vv.grad] + [p.grad.clone() for p in fm.parameters() if p.grad is not None])
    for a, c in zip(*grads):
        assert rel(a, c) <= GRAD_FP32


# ---- the inference form (no autograd, reused workspace) vs the autograd form ---------------------
@pytest.mark.parametrize("name", ["favor+", "favor++", "hedgehog", "rff"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
def test_inference_form_matches_autograd_form(name, h, hkv):
    """The same call with an autograd graph (``chunkwise.causal_block``) and without one
    (``causal_infer.causal_block_into`` on a reused workspace, output normalised in place): two
    full blocks and a short one, padded keys, GQA."""
    gen = torch.Generator().manual_seed(11)
    b, n, d = 2, 2 * 128 + 37, 16
    q, k, v = (torch.randn(b, hh, n, d, generator=gen) for hh in (h, hkv, hkv))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :20] = False
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=16)
    from hf_rfa.ops.feature import scan

    old = scan.DEFAULT_BLOCK_SIZE
    scan.DEFAULT_BLOCK_SIZE = 128
    try:
        qg = q.clone().requires_grad_()
        slow = hf_rfa.random_feature_attention(qg, k, v, fm, causal=True, attention_mask=mask, chunk_size=32).detach()
        with torch.no_grad():
            fast = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, chunk_size=32)
            part_g, st_g = causal_feature_attention(fm, q.requires_grad_(), k, v, (mask, None, None), ScanRun(32))
        q.requires_grad_(False)
        part, st = causal_feature_attention(fm, q, k, v, (mask, None, None), ScanRun(32))
    finally:
        scan.DEFAULT_BLOCK_SIZE = old
    ref = quadratic_kernel_attention(q, k, v, fm, causal=True, attention_mask=mask)
    sel = mask.view(b, 1, n, 1).expand(fast.shape)
    assert rel(fast[sel], slow[sel]) <= ORACLE_FP32
    assert rel(fast[sel], ref[sel]) <= ORACLE_FP32
    assert rel(out_of(part), out_of(part_g)) <= ORACLE_FP32 and rel(st.S, st_g.S) <= ORACLE_FP32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_converted_block_by_block(dtype):
    """bf16/fp16 q, k, v take the fused path without a whole-sequence float32 copy; the float32
    arithmetic is the same as for the float32 copies of the same values (one final rounding)."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 4, 1100, 16, generator=gen).to(dtype) for _ in range(3))
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=16)
    with torch.no_grad():
        low = hf_rfa.random_feature_attention(q, k, v, fm)
        ref = hf_rfa.random_feature_attention(q.float(), k.float(), v.float(), fm)
    assert low.dtype == dtype
    assert torch.equal(low, ref.to(dtype))


@pytest.mark.parametrize("name", ["favor+", "hedgehog", "rff"])
@pytest.mark.parametrize("block", [7, 64, None])
def test_blockwise_bidirectional_matches_whole_sequence_twin(name, block):
    """Keys folded block by block (inference form) = ``bidirectional_linear`` on whole-sequence
    features; GQA, padded keys, Nq != Nk, Partial and normalised-output forms."""
    from hf_rfa.ops import bidirectional_linear
    from hf_rfa.ops.feature.bidirectional import bidirectional_feature_attention

    gen = torch.Generator().manual_seed(15)
    b, h, hkv, nq, nk, d = 2, 4, 2, 50, 90, 16
    q = 0.7 * torch.randn(b, h, nq, d, generator=gen)
    k = 0.7 * torch.randn(b, hkv, nk, d, generator=gen)
    v = torch.randn(b, hkv, nk, d, generator=gen)
    mask = torch.ones(b, nk, dtype=torch.bool)
    mask[1, :30] = False
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=16)
    qf, lq, kf, lk = masked_features(fm, q, k, mask)
    twin = bidirectional_linear(qf, lq, kf, lk, v)
    part = bidirectional_feature_attention(fm, q, k, v, mask, block_size=block)
    assert rel(out_of(part), out_of(twin)) <= ORACLE_FP32
    dest = torch.empty(b, hkv, 2, nq, d)
    assert bidirectional_feature_attention(fm, q, k, v, mask, block_size=block, out=dest) is None
    assert rel(dest, finalize(twin, fm.eps)) <= ORACLE_FP32  # the map's own normaliser floor


def test_workspace_is_reused_and_released():
    from hf_rfa.ops.backends import causal_infer

    causal_infer.release_workspaces()
    gen = torch.Generator().manual_seed(12)
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)
    q, k, v = (torch.randn(1, 2, 1100, 8, generator=gen) for _ in range(3))
    with torch.no_grad():
        a = hf_rfa.random_feature_attention(q, k, v, fm)
        ws = causal_infer._CACHE.ws[1]
        b = hf_rfa.random_feature_attention(q, k, v, fm)
        assert causal_infer._CACHE.ws[1] is ws  # same shape: same buffers
        hf_rfa.random_feature_attention(q[:, :1], k[:, :1], v[:, :1], fm)  # another shape replaces it
        assert causal_infer._CACHE.ws[1] is not ws
    assert torch.equal(a, b)  # reusing buffers changes nothing
    with torch.inference_mode():  # inference tensors: a workspace of their own, both ways round
        c = hf_rfa.random_feature_attention(q, k, v, fm)
    with torch.no_grad():
        d = hf_rfa.random_feature_attention(q, k, v, fm)
    assert torch.equal(c, a) and torch.equal(d, a)
    causal_infer.release_workspaces()
    assert causal_infer._CACHE.ws is None


def _true_features(f):
    return f.phi if f.log_scale is None else f.phi * torch.exp(f.log_scale).unsqueeze(-1)


@pytest.mark.parametrize("name", sorted(n for n in hf_rfa.available_feature_maps() if n != "none"))
def test_features_into_equals_forward(name):
    gen = torch.Generator().manual_seed(13)
    fm = hf_rfa.build_feature_map(name, head_dim=8, num_features=8, num_heads=2)
    x = 0.5 * torch.randn(1, 2, 10, 8, generator=gen)
    for is_query in (True, False):
        want = fm.forward_queries(x) if is_query else fm.forward_keys(x)
        buf = torch.empty_like(want.phi)
        got = fm.features_into(x.clone(), buf, is_query)
        assert got.phi.data_ptr() == buf.data_ptr()
        assert rel(_true_features(got), _true_features(want)) <= ORACLE_FP32


# ---- compiled inference kernels (hf_rfa.set_compile) --------------------------------------------
@pytest.fixture
def compiled_kernels():
    hf_rfa.set_compile(True)
    yield
    hf_rfa.set_compile(False)


def test_set_compile_validates():
    with pytest.raises(ValueError, match="enabled"):
        hf_rfa.set_compile("yes")
    assert hf_rfa.compile_enabled() is False


@pytest.mark.slow
@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
def test_compiled_kernels_match_eager_and_quadratic(name, compiled_kernels):
    """N = 1100 covers two full 512-token blocks (compiled) and a short last block (eager)."""
    gen = torch.Generator().manual_seed(8)
    b, h, hkv, n, d = 1, 4, 2, 1100, 16
    q, k, v = (torch.randn(b, hh, n, d, generator=gen) for hh in (h, hkv, hkv))
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=16)
    with torch.no_grad():
        fast = hf_rfa.random_feature_attention(q, k, v, fm, causal=True)
        hf_rfa.set_compile(False)
        eager = hf_rfa.random_feature_attention(q, k, v, fm, causal=True)
        ref = quadratic_kernel_attention(q, k, v, fm, causal=True)
    from hf_rfa.ops.backends import kernels
    from hf_rfa.ops.feature.chunkwise import block_step

    assert block_step in kernels._COMPILED  # the compiled kernel really ran
    assert rel(fast, eager) <= ORACLE_FP32
    assert rel(fast, ref) <= ORACLE_FP32


@pytest.mark.slow
def test_compiled_kernels_are_not_used_under_autograd(compiled_kernels):
    """With an autograd graph the eager path runs: gradients equal those with compilation off."""
    from hf_rfa.ops.backends import kernels

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 600, 16, generator=gen, requires_grad=True) for _ in range(3))
    assert not kernels.active(q)
    with torch.no_grad():
        assert kernels.active(q)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=16)
    # the autograd form (checkpoint_blocks=False); the recompute Function's forward runs without a
    # graph and may use the compiled kernels by design (tests/ops/test_recompute.py)
    hf_rfa.random_feature_attention(q, k, v, fm, checkpoint_blocks=False).sum().backward()
    g1 = [x.grad.clone() for x in (q, k, v)]
    hf_rfa.set_compile(False)
    for x in (q, k, v):
        x.grad = None
    hf_rfa.random_feature_attention(q, k, v, fm, checkpoint_blocks=False).sum().backward()
    for a, c in zip(g1, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, c)


# ---- training memory: per-block activation checkpointing ---------------------------------------
def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


@pytest.mark.parametrize("name", ["favor+", "rfa"])
def test_checkpointed_blocks_same_gradients_less_saved_memory(name):
    gen = torch.Generator().manual_seed(16)
    b, h, hkv, n, d = 1, 4, 2, 1100, 16  # two full blocks and a short one
    q, k, v = (torch.randn(b, hh, n, d, generator=gen) for hh in (h, hkv, hkv))
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :7] = False
    kw = {"gate": True} if name == "rfa" else {}
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=64, **kw)
    up = torch.randn(b, h, n, d, generator=gen)
    grads, saved = [], []
    for ckpt in (False, True):
        fm.zero_grad()
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        nbytes, out = _saved_bytes(lambda: hf_rfa.random_feature_attention(qq, kk, vv, fm, attention_mask=mask, checkpoint_blocks=ckpt))
        (out * up).sum().backward()
        saved.append(nbytes)
        grads.append([qq.grad, kk.grad, vv.grad] + [p.grad.clone() for p in fm.parameters() if p.grad is not None])
    for a, c in zip(*grads):
        assert rel(a, c) <= GRAD_FP32
    assert saved[1] * 4 < saved[0], saved  # features/tiles of every block are no longer kept


def test_checkpoint_blocks_config_reaches_the_layers():
    from tiny_models import batch, tiny_model

    with pytest.raises(ValueError, match="checkpoint_blocks"):
        hf_rfa.RFAConfig(checkpoint_blocks="yes")
    model = tiny_model("llama")
    hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=16, checkpoint_blocks=True))
    layers = [m for m in model.modules() if isinstance(m, hf_rfa.hf.attention.RFAAttention)]
    assert layers and all(m.checkpoint_blocks for m in layers)
    ids, mask = batch("llama", n=40)
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
