"""The compiled CPU kernel (``hf_rfa.ops.backends.native``) against its twins: the PyTorch inference form
of the same op (``HF_RFA_NATIVE`` off) and the quadratic kernelised form."""

import platform
import shutil
import types
from pathlib import Path

import pytest
import torch
from conftest import rel
from tolerances import ORACLE_FP32

import hf_rfa
from hf_rfa.ops import LinearState, finalize, quadratic_kernel_attention
from hf_rfa.ops.backends import native
from hf_rfa.ops.feature.fused import ScanRun, causal_feature_attention

HAVE_TOOLCHAIN = shutil.which("g++") is not None and native._ninja_on_path()


def test_kernel_builds_on_this_machine():
    """Where a compiler is present on x86_64 Linux (CI, this project's machines) the kernel must
    build and load; a silent fallback would hide a broken build."""
    if not (HAVE_TOOLCHAIN and platform.machine() == "x86_64"):
        pytest.skip("no g++/ninja or not x86_64: the PyTorch path is used")  # (never the case in CI)
    assert native.load() is not None, native._STATE["failed"]


needs_kernel = pytest.mark.skipif(not HAVE_TOOLCHAIN or native.load() is None, reason="native CPU kernel unavailable here")


@pytest.fixture
def pytorch_path():
    """Run the body with the kernel bypassed, restoring the setting afterwards."""

    def run(fn):
        old = native.native_enabled()
        native.set_native(False)
        try:
            with torch.no_grad():
                return fn()
        finally:
            native.set_native(old)

    return run


@pytest.fixture
def calls(monkeypatch):
    """Count the kernel's calls."""
    box = {"n": 0}
    real = native.causal_positive

    def counted(*a, **kw):
        box["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(native, "causal_positive", counted)
    return box


def _inputs(b, h, hkv, n, d, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(b, h, n, d, generator=gen)
    k = scale * torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    mask = torch.ones(b, n, dtype=torch.bool)
    if b > 1:
        mask[1, : n // 3] = False  # left padding
    mask[0, n // 2 : n // 2 + 3] = False  # holes
    return q, k, v, mask


@needs_kernel
@pytest.mark.parametrize("name", ["favor+", "positive", "favor++"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("n,chunk", [(1, 64), (63, 7), (300, 64), (300, 1)])
def test_kernel_matches_pytorch_inference_form(name, h, hkv, n, chunk, calls, pytorch_path):
    """Partial (num, den, log scale), normalised output and final state, padded keys, GQA, short
    last chunk."""
    q, k, v, mask = _inputs(2, h, hkv, n, 16, seed=1, scale=1.3)
    fm = hf_rfa.build_feature_map(name, head_dim=16, num_features=32)
    with torch.no_grad():
        part, st = causal_feature_attention(fm, q, k, v, (mask, None, None), ScanRun(chunk, x_scale=0.5))
        dest = torch.empty(2, hkv, h // hkv, n, 16)
        none, st2 = causal_feature_attention(fm, q, k, v, (mask, None, None), ScanRun(chunk, x_scale=0.5), out=dest)
    assert calls["n"] == 2 and none is None
    ref, st_ref = pytorch_path(lambda: causal_feature_attention(fm, q, k, v, (mask, None, None), ScanRun(chunk, x_scale=0.5)))
    assert calls["n"] == 2  # the twin did not call the kernel
    sel = mask.view(2, 1, 1, n).expand(part.den.shape)
    want = finalize(ref, fm.eps)
    assert rel(finalize(part, fm.eps)[sel], want[sel]) <= ORACLE_FP32
    assert rel(dest[sel], want[sel]) <= ORACLE_FP32
    # the Partial itself: same log-space bookkeeping (den·e^ls is the true denominator)
    assert rel((part.den * torch.exp(part.log_scale - ref.log_scale))[sel], ref.den[sel]) <= ORACLE_FP32
    for s in (st, st2):
        w = torch.exp(s.ref - st_ref.ref)[..., None]
        assert rel(s.z * w, st_ref.z) <= ORACLE_FP32 and rel(s.S * w[..., None], st_ref.S) <= ORACLE_FP32


@needs_kernel
@pytest.mark.parametrize("window,sinks", [(0, 0), (16, 2), (40, 0)])
def test_public_op_with_kernel_matches_quadratic_twin(window, sinks, calls):
    q, k, v, mask = _inputs(2, 6, 2, 150, 16, seed=2)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=64)
    with torch.no_grad():
        fast = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks, chunk_size=16)
    assert calls["n"] == 1
    ref = quadratic_kernel_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks)
    sel = mask.view(2, 1, 150, 1).expand(fast.shape)
    assert rel(fast[sel], ref[sel]) <= ORACLE_FP32


@needs_kernel
def test_carried_state_and_log_scale_offsets(pytorch_path):
    """Two segments carrying the state = one call; per-key/per-query log-scale offsets (the
    gated maps' ``lk_add``/``lq_add``) as in the PyTorch path."""
    q, k, v, mask = _inputs(2, 4, 2, 130, 16, seed=3)
    gen = torch.Generator().manual_seed(9)
    lk_add = torch.randn(2, 2, 130, generator=gen)
    lq_add = torch.randn(2, 2, 2, 130, generator=gen)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=32)
    with torch.no_grad():
        whole, st_whole = causal_feature_attention(fm, q, k, v, (mask, lq_add, lk_add), ScanRun(16))
        a, st_a = causal_feature_attention(fm, q[:, :, :50], k[:, :, :50], v[:, :, :50], (mask[:, :50], lq_add[..., :50], lk_add[..., :50]), ScanRun(16))
        b, st_b = causal_feature_attention(fm, q[:, :, 50:], k[:, :, 50:], v[:, :, 50:], (mask[:, 50:], lq_add[..., 50:], lk_add[..., 50:]), ScanRun(16), state=st_a)
    ref, _ = pytorch_path(lambda: causal_feature_attention(fm, q, k, v, (mask, lq_add, lk_add), ScanRun(16)))
    sel = mask.view(2, 1, 1, 130).expand(whole.den.shape)
    want = finalize(ref, fm.eps)
    assert rel(finalize(whole, fm.eps)[sel], want[sel]) <= ORACLE_FP32
    split = torch.cat([finalize(a, fm.eps), finalize(b, fm.eps)], dim=3)
    assert rel(split[sel], want[sel]) <= ORACLE_FP32
    assert rel(st_b.S * torch.exp(st_b.ref - st_whole.ref)[..., None, None], st_whole.S) <= ORACLE_FP32


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype, calls):
    """bf16/fp16 q, k, v are read as is and converted per chunk inside the kernel: the result is
    exactly the float32 computation on the same values, rounded once."""
    q, k, v, _ = _inputs(1, 4, 4, 200, 16, seed=4)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=16)
    with torch.no_grad():
        low = hf_rfa.random_feature_attention(q, k, v, fm)
        ref = hf_rfa.random_feature_attention(q.float(), k.float(), v.float(), fm)
    assert calls["n"] == 2 and low.dtype == dtype
    assert torch.equal(low, ref.to(dtype))


@needs_kernel
def test_streaming_safe_and_large_norms():
    """Earlier outputs are bit-identical whatever later tokens are, even keys with huge norms
    (log scales jumping by hundreds)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=gen) for _ in range(3))
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=16)
    with torch.no_grad():
        p1, _ = causal_feature_attention(fm, q, k, v, (None, None, None), ScanRun(16))
        for t in (0, 5, 29, 40):
            q2, k2, v2 = q.clone(), k.clone(), v.clone()
            q2[:, :, t + 1 :] *= 30
            k2[:, :, t + 1 :] = 30 * torch.randn(1, 2, 70 - t - 1, 16, generator=gen)
            v2[:, :, t + 1 :] = torch.randn(1, 2, 70 - t - 1, 16, generator=gen)
            p2, _ = causal_feature_attention(fm, q2, k2, v2, (None, None, None), ScanRun(16))
            assert torch.isfinite(finalize(p2, fm.eps)).all()
            for a, c in ((p1.num, p2.num), (p1.den, p2.den), (p1.log_scale, p2.log_scale)):
                assert torch.equal(a[:, :, :, : t + 1], c[:, :, :, : t + 1])


@needs_kernel
def test_kernel_only_where_it_applies(calls):
    """Not under autograd, not for other maps, not when disabled or when compiled kernels are
    on; the same numbers either way."""
    q, k, v, _ = _inputs(1, 2, 2, 40, 8, seed=5)
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)
    qg = q.clone().requires_grad_()
    hf_rfa.random_feature_attention(qg, k, v, fm).sum().backward()
    assert calls["n"] == 0 and qg.grad is not None
    with torch.no_grad():
        hf_rfa.random_feature_attention(q, k, v, hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8))
        hf_rfa.random_feature_attention(q, k, v, fm, causal=False)
        hf_rfa.random_feature_attention(q.double(), k.double(), v.double(), fm)
        assert calls["n"] == 0
        native.set_native(False)
        try:
            off = hf_rfa.random_feature_attention(q, k, v, fm)
        finally:
            native.set_native(True)
        assert calls["n"] == 0
        on = hf_rfa.random_feature_attention(q, k, v, fm)
        assert calls["n"] == 1
    assert rel(on, off) <= ORACLE_FP32


def test_set_native_validates():
    with pytest.raises(ValueError, match="enabled"):
        native.set_native("yes")


@needs_kernel
def test_prefill_then_decode_with_kernel(pytorch_path):
    """State after a prefill by the kernel continues decoding exactly like the PyTorch path's."""
    q, k, v, _ = _inputs(1, 4, 2, 90, 16, seed=8)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=32)
    with torch.no_grad():
        _, st = causal_feature_attention(fm, q, k, v, (None, None, None), ScanRun(16, x_scale=0.5))
    _, st_ref = pytorch_path(lambda: causal_feature_attention(fm, q, k, v, (None, None, None), ScanRun(16, x_scale=0.5)))
    assert isinstance(st, LinearState)
    w = torch.exp(st.ref - st_ref.ref)
    assert rel(st.S * w[..., None, None], st_ref.S) <= ORACLE_FP32
    assert rel(st.z * w[..., None], st_ref.z) <= ORACLE_FP32


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog, tmp_path):
    """A kernel that cannot be built (here: ninja missing) is reported once as a warning
    and the PyTorch path answers, with the same numbers as ever."""
    q, k, v, _ = _inputs(1, 2, 2, 40, 8, seed=10)
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)
    with torch.no_grad():
        native.set_native(False)
        try:
            want = hf_rfa.random_feature_attention(q, k, v, fm)
        finally:
            native.set_native(True)
    monkeypatch.setattr(native, "_ninja_on_path", lambda: False)  # a build that cannot run
    monkeypatch.setitem(native._STATE, "module", None)
    monkeypatch.setitem(native._STATE, "failed", None)
    with caplog.at_level("WARNING", logger="hf_rfa.ops.backends.native"), torch.no_grad():
        got = hf_rfa.random_feature_attention(q, k, v, fm)
        again = hf_rfa.random_feature_attention(q, k, v, fm)
    assert native.load() is None and "ninja" in native._STATE["failed"]
    assert len([r for r in caplog.records if "native CPU kernel unavailable" in r.getMessage()]) == 1
    assert torch.equal(got, want) and torch.equal(again, want)


def test_missing_source_is_silent(monkeypatch, caplog, tmp_path):
    """Without the C++ source (the remote code of an export ships none) the PyTorch path runs
    and nothing is logged at warning level."""
    q, k, v, _ = _inputs(1, 2, 2, 40, 8, seed=10)
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)
    monkeypatch.setattr(native, "_SOURCE", tmp_path / "missing.cpp")
    monkeypatch.setitem(native._STATE, "module", None)
    monkeypatch.setitem(native._STATE, "failed", None)
    with caplog.at_level("WARNING", logger="hf_rfa.ops.native"), torch.no_grad():
        hf_rfa.random_feature_attention(q, k, v, fm)
    assert native.load() is None and "missing.cpp" in native._STATE["failed"]
    assert not [r for r in caplog.records if r.levelno >= 30]


def test_build_key_covers_source_torch_and_flags(monkeypatch, tmp_path):
    """Same source text from another checkout → same build name; other flags or source → another."""
    base = native._build_name()
    copy = tmp_path / "causal_cpu.cpp"
    copy.write_bytes(native._SOURCE.read_bytes())
    monkeypatch.setattr(native, "_SOURCE", copy)
    assert native._build_name() == base
    monkeypatch.setattr(native, "CFLAGS", native.CFLAGS + ("-DX",))
    assert native._build_name() != base
    monkeypatch.setattr(native, "CFLAGS", native.CFLAGS[:-1])
    copy.write_bytes(copy.read_bytes() + b"\n// changed\n")
    assert native._build_name() != base


def test_build_key_covers_the_torch_installation(monkeypatch):
    """Two virtual environments (same torch version, other folders, so other include paths) get
    two builds instead of rebuilding one in turn."""
    base = native._build_name()
    monkeypatch.setattr(native, "_torch_dir", lambda: "/another/venv/lib/python3.11/site-packages/torch")
    assert native._build_name() != base


def test_staged_source_path_is_shared(monkeypatch, tmp_path):
    """The build compiles a copy inside its build folder: one path for every checkout."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    name = native._build_name()
    staged = native._staged_source(name)
    assert staged.read_bytes() == native._SOURCE.read_bytes() and str(tmp_path / "ext") in str(staged)
    copy = tmp_path / "other_checkout" / "causal_cpu.cpp"
    copy.parent.mkdir()
    copy.write_bytes(native._SOURCE.read_bytes())
    monkeypatch.setattr(native, "_SOURCE", copy)
    assert native._staged_source(native._build_name()) == staged


# ---- exact part of a causal hybrid (window + sinks) -------------------------------------------
@needs_kernel
@pytest.mark.parametrize("window,sinks", [(1, 0), (5, 0), (64, 4), (0, 3), (500, 2), (37, 1)])
@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_band_kernel_matches_exact_local(window, sinks, h, hkv, chunk):
    """Partial (num, den, log scale) of the window/sink part = ``hybrid.exact_local`` (padding at
    the front and holes, GQA, sinks inside and outside the window, W ≥ N)."""
    from hf_rfa.ops.band.exact import exact_local
    from hf_rfa.ops.band.plan import Band
    from hf_rfa.ops.masks import exp_floor, sink_positions

    b, n, d = 2, 150, 16
    q, k, v, mask = _inputs(b, h, hkv, n, d, seed=11, scale=1.5)
    scale = d**-0.5
    root = scale**0.5
    spos, sok = sink_positions(mask, b, n, sinks, q.device) if sinks else (None, None)
    num, den, ls = native.causal_band(q, k, v, scale, mask, window, (spos, sok), native.KernelRun(chunk, exp_floor(torch.float32)))
    twin = exact_local((q * root).reshape(b, hkv, h // hkv, n, d), k * root, v, mask, Band(window, sinks, True, chunk))
    g = h // hkv
    ls, den, num = ls.view(b, hkv, g, n), den.view(b, hkv, g, n), num.view(b, hkv, g, n, d)
    seen = twin.den > 0
    assert torch.equal(den > 0, seen)  # the same rows see something
    assert (ls[~seen] == -1e30).all() and (num[~seen] == 0).all()
    assert (ls[seen] - twin.log_scale[seen]).abs().max() <= 1e-4
    w = torch.exp(ls - twin.log_scale)  # (≈ 1) rescale to the twin's log scale
    assert rel((den * w)[seen], twin.den[seen]) <= ORACLE_FP32
    assert rel((num * w.unsqueeze(-1))[seen], twin.num[seen]) <= ORACLE_FP32


@needs_kernel
@pytest.mark.parametrize("name", ["favor+", "hedgehog"])
def test_hybrid_with_band_kernel_matches_pytorch_path_and_softmax(name, pytorch_path, calls):
    """The public op with a window: the band kernel (any feature map) + the feature kernel
    (positive maps) = the PyTorch path; W ≥ N = exact softmax; bf16 inputs as their float32 copies."""
    q, k, v, mask = _inputs(2, 6, 2, 200, 16, seed=12)
    fm = hf_rfa.build_feature_map(name, head_dim=16, num_features=32)
    with torch.no_grad():
        fast = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=48, sinks=4)
        full = hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=200)
        low = hf_rfa.random_feature_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), fm, attention_mask=mask, window=48, sinks=4)
        ref_low = hf_rfa.random_feature_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), fm, attention_mask=mask, window=48, sinks=4)
    assert calls["n"] == (3 if name == "favor+" else 0)  # feature kernel: positive maps, calls with W < N
    ref = pytorch_path(lambda: hf_rfa.random_feature_attention(q, k, v, fm, attention_mask=mask, window=48, sinks=4))
    sel = mask.view(2, 1, 200, 1).expand(fast.shape)
    assert rel(fast[sel], ref[sel]) <= ORACLE_FP32
    soft = hf_rfa.softmax_attention(q, k, v, causal=True, attention_mask=mask)
    assert rel(full[sel], soft[sel]) <= ORACLE_FP32
    assert torch.equal(low, ref_low.bfloat16())


class _FakeBuild:
    """Stands in for torch's ``cpp_extension.load``: writes ``<name>.so`` when it is missing
    (a "build") and records what it saw."""

    def __init__(self):
        self.builds, self.saw = 0, []

    def __call__(self, name, sources, build_directory, **kw):
        lib = Path(build_directory) / f"{name}.so"
        self.saw.append(lib.exists())
        if not lib.exists():
            self.builds += 1
            lib.write_bytes(b"\x7fELF fresh build")
        return types.SimpleNamespace(__file__=str(lib), available=lambda: True)


@pytest.fixture
def fake_build(monkeypatch, tmp_path):
    import torch.utils.cpp_extension as cpp

    fake = _FakeBuild()
    monkeypatch.setattr(cpp, "load", fake)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    (tmp_path / "ext").mkdir(mode=0o755)
    monkeypatch.setitem(native._STATE, "module", None)
    monkeypatch.setitem(native._STATE, "failed", None)
    return fake


def _reset():
    native._STATE["module"] = native._STATE["failed"] = None


def test_build_is_verified_before_loading(fake_build, tmp_path):
    """A library the marker does not vouch for (truncated, corrupted, left by a killed build) is
    deleted and rebuilt, never loaded; a stale torch lock is removed."""
    assert native.load() is not None and fake_build.builds == 1
    folder = tmp_path / "ext" / native._build_name()
    lib = folder / f"{native._build_name()}.so"
    _reset()
    assert native.load() is not None and fake_build.builds == 1  # verified: loaded as is
    lib.write_bytes(b"\x7fELF trunc")  # corrupted after the build
    (folder / "lock").write_text("")  # torch's lock of a killed build
    _reset()
    assert native.load() is not None and fake_build.builds == 2 and fake_build.saw[-1] is False
    assert not (folder / "lock").exists()


def test_build_lock_wait_times_out_to_the_pytorch_path(fake_build, tmp_path, monkeypatch, caplog):
    import subprocess
    import sys

    folder = tmp_path / "ext" / native._build_name()
    folder.mkdir(parents=True, mode=0o755)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"), str(folder / "hf_rfa.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setenv("HF_RFA_NATIVE_LOCK_TIMEOUT", "0.5")
        with caplog.at_level("WARNING", logger="hf_rfa.ops.backends.native"):
            assert native.load() is None
        assert "waited" in native._STATE["failed"] and fake_build.builds == 0
        assert not native.usable(torch.device("cpu"), torch.float32)  # callers take the PyTorch path
    finally:
        holder.kill()
        holder.wait()
    _reset()
    assert native.load() is not None  # the holder died: its lock went with it


def test_build_folder_writable_by_others_is_refused(fake_build, tmp_path):
    folder = tmp_path / "ext" / native._build_name()
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    assert native.load() is None and "writable by other users" in native._STATE["failed"] and fake_build.builds == 0
    folder.chmod(0o755)
    _reset()
    (tmp_path / "ext").chmod(0o777)  # a parent others can write (and not sticky)
    assert native.load() is None and "writable by other users" in native._STATE["failed"]


@needs_kernel
def test_integer_key_mask_is_read_as_bool():
    q, k, v, mask = _inputs(2, 4, 2, 70, 8, seed=13)
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)
    with torch.no_grad():
        a, _ = causal_feature_attention(fm, q, k, v, (mask, None, None), ScanRun(16))
        b, _ = causal_feature_attention(fm, q, k, v, (mask.to(torch.uint8), None, None), ScanRun(16))
    assert torch.equal(a.num, b.num) and torch.equal(a.den, b.den)


@needs_kernel
@pytest.mark.parametrize("segments", [1, 2, 3, 7])
def test_segmented_scan_matches_one_pass(segments, pytorch_path):
    """A scan split into segments (increments in parallel, combined in order, then each segment
    from its incoming state) = the one-pass scan and the PyTorch form: outputs, Partial log
    scales and final state, with padding, an incoming state and log-scale offsets."""
    from hf_rfa.ops.masks import exp_floor

    q, k, v, mask = _inputs(2, 4, 2, 300, 16, seed=15, scale=1.3)
    gen = torch.Generator().manual_seed(16)
    lk_add = 2 * torch.randn(2, 2, 300, generator=gen)
    fm = hf_rfa.build_feature_map("favor+", head_dim=16, num_features=32)
    _, st0 = pytorch_path(lambda: causal_feature_attention(fm, q[:, :, :40], k[:, :, :40], v[:, :, :40], (mask[:, :40], None, None), ScanRun(16)))
    outs = []
    for p in (1, segments):
        S = torch.cat([st0.S, st0.z.unsqueeze(-1)], dim=-1).contiguous()
        ref = st0.ref.clone()
        o, mt, lq = native.causal_positive(q, k, v, fm.native_params(0.5), (mask, lk_add), (S, ref), native.KernelRun(16, exp_floor(torch.float32), None, segments=p))
        outs.append((o, mt, lq, S, ref))
    (o1, mt1, lq1, S1, r1), (o2, mt2, lq2, S2, r2) = outs
    assert torch.equal(mt1, mt2) and torch.equal(lq1, lq2) and torch.equal(r1, r2)
    sel = mask.view(2, 1, 300, 1).expand(o1.shape)
    assert rel(o2[sel], o1[sel]) <= ORACLE_FP32
    assert rel(S2, S1) <= ORACLE_FP32
    ref_part, _ = pytorch_path(lambda: causal_feature_attention(fm, q, k, v, (mask, None, lk_add), ScanRun(16, x_scale=0.5), state=st0))
    got = (o2[..., :16] / o2[..., 16:]).view(2, 2, 2, 300, 16)
    ok = mask.view(2, 1, 1, 300, 1).expand(got.shape)
    assert rel(got[ok], finalize(ref_part, 1e-30)[ok]) <= ORACLE_FP32


@needs_kernel
def test_few_kv_heads_use_every_thread(calls):
    """One kv head and 4 threads: the automatic split gives the same numbers as 1 thread."""
    q, k, v, _ = _inputs(1, 4, 1, 300, 8, seed=14)
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)
    old = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            a = hf_rfa.random_feature_attention(q, k, v, fm)
            torch.set_num_threads(4)
            b = hf_rfa.random_feature_attention(q, k, v, fm)
    finally:
        torch.set_num_threads(old)
    assert calls["n"] == 2
    assert rel(a, b) <= ORACLE_FP32
