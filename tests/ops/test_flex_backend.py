"""The GPU backends' parts that run on a CPU: the FlexAttention band (its eager forward) against the
PyTorch band and the whole op, the block mask against ``create_block_mask``, the fla wrapper's math
with a plain-PyTorch kernel in place of the Triton one, and the registry's rule (``auto`` never takes
a GPU backend on CPU; on CUDA it takes ``fla``/``flex`` only for calls they answer). fp32, seeded;
the tolerance is ORACLE_FP32 (the same sums in another order)."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import random_feature_attention
from hf_rfa.ops.backends import BACKENDS, fla, flex, gpu, resolve
from hf_rfa.ops.band.exact import exact_local
from hf_rfa.ops.band.plan import Band
from hf_rfa.ops.partial import finalize
from hf_rfa.ops.rotary import unrotate
from hf_rfa.ops.spec import AttentionSpec, CallPlan
from conftest import rel
from tiny_models import batch, tiny_model
from tolerances import ORACLE_FP32, PLUMBING_LOGITS

B, H, HKV, D = 2, 4, 2, 16
CPU, CUDA, F32 = torch.device("cpu"), torch.device("cuda"), torch.float32
BANDS = {"W24-S3": (24, 3), "S4": (0, 4), "W1": (1, 0), "W50": (50, 0), "W>=N": (400, 0)}


def _qkv(n, seed=0, pad=7):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h in (H, HKV, HKV))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :pad] = False
    return q, k, v, mask


def _fm(name, decay=0.0):
    kw = {"gate": True} if name == "rfa" else {}
    if name == "hedgehog":
        kw = dict(num_heads=H, num_kv_heads=HKV)
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=32, seed=0, **kw)
    if decay:
        fm.enable_decay(decay)
    return fm


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("band", list(BANDS))
def test_flex_band_equals_pytorch_band(band, block):
    window, sinks = BANDS[band]
    n = 257
    q, k, v, mask = _qkv(n)
    scale = D**-0.5
    got = flex.band_partial(q, k, v, mask, min(window, n), sinks, scale, block=block)
    ref = exact_local(q.reshape(B, HKV, H // HKV, n, D) * scale**0.5, k * scale**0.5, v, mask, Band(min(window, n), sinks, True, 16))
    seen = ref.den > 0
    assert torch.equal(got.den > 0, seen)
    assert rel(finalize(got, 1e-6)[seen], finalize(ref, 1e-6)[seen]) <= ORACLE_FP32
    # the same normaliser in log space: log den + log scale
    assert rel((got.den.log() + got.log_scale)[seen], (ref.den.log() + ref.log_scale)[seen]) <= ORACLE_FP32


@pytest.mark.parametrize("band", ["W24-S3", "S4", "W50"])
def test_band_tiles_cover_create_block_mask(band):
    from torch.nn.attention.flex_attention import create_block_mask

    window, sinks = BANDS[band]
    n, block = 300, 32
    _, _, _, mask = _qkv(n, pad=40)
    sink = hf_rfa.ops.masks.sink_mask(mask, B, n, sinks, CPU) if sinks else None
    mm = flex.band_mask_mod(mask, sink, window)
    dense = create_block_mask(mm, B, None, n, n, device="cpu", BLOCK_SIZE=block).to_dense()[:, 0].bool()  # [B,Lq,Lk]
    ours = flex.band_blocks(sink, B, n, window, block)
    assert not (dense & ~ours).any(), "a tile with a visible entry is missing"
    assert ours.sum() <= dense.sum() + 2 * B * ours.shape[1], "far more tiles than the band touches"


@pytest.mark.parametrize("band", ["W24-S3", "S4", "W50", "W>=N"])
@pytest.mark.parametrize("name", hf_rfa.available_feature_maps())
def test_flex_backend_equals_torch_backend(name, band):
    window, sinks = BANDS[band]
    q, k, v, mask = _qkv(150)
    fm = _fm(name)
    kw = dict(attention_mask=mask, window=window, sinks=sinks, chunk_size=16)
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, backend="torch", **kw)
        out = random_feature_attention(q, k, v, fm, backend="flex", **kw)
        other = random_feature_attention(q, k, v, fm, backend="flex", **{**kw, "window": window + 5})
    assert rel(out, ref) <= ORACLE_FP32
    if window < 150 and name != "none":
        assert not torch.allclose(out, other), "the window has no effect"


def test_flex_backend_with_decay_and_feature_inputs():
    q, k, v, mask = _qkv(150)
    fm = _fm("favor+", decay=30.0)
    n = q.shape[2]
    ang = torch.arange(n, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2) / D))[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[None], torch.cat([ang, ang], -1).sin()[None]
    kw = dict(attention_mask=mask, window=12, sinks=2, chunk_size=16)
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, backend="torch", feature_q=unrotate(q, cos, sin), feature_k=unrotate(k, cos, sin), **kw)
        out = random_feature_attention(q, k, v, fm, backend="flex", feature_rope=(cos, sin), **kw)
    assert rel(out, ref) <= ORACLE_FP32


def _fla_call(window, sinks):
    """The call plan gpu.attention reads: backend fla, chunk 16, no checkpointing, scale D^-0.5."""
    return CallPlan(AttentionSpec(window=window, sinks=sinks, chunk_size=16, checkpoint_blocks=False, backend="fla"), True, D**-0.5, "fla")


@pytest.fixture
def reference_fla(monkeypatch):
    """fla's Triton kernel replaced by its plain-PyTorch twin (``fla.reference_kernel``)."""
    monkeypatch.setattr(fla, "_kernel", lambda: fla.reference_kernel)


@pytest.mark.parametrize("band", ["none", "W24-S3", "S4", "W1"])
@pytest.mark.parametrize("name,decay", [("favor+", 0.0), ("favor+", 20.0), ("hedgehog", 0.0), ("rfa", 0.0), ("rff", 0.0)], ids=["favor+", "favor+-decay", "hedgehog", "rfa-gate", "rff"])
def test_fla_wrapper_equals_torch_backend(reference_fla, name, decay, band):
    window, sinks = BANDS.get(band, (0, 0))
    q, k, v, mask = _qkv(150)
    fm = _fm(name, decay)
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=16, backend="torch")
        part = fla.scan_partial(fm, q, k, v, mask, mask, window, D**-0.25)
        out = gpu.attention(q, k, v, fm, mask, _fla_call(window, sinks), grad=False)
    assert part is not None, "the kernel path must answer these inputs (no fallback)"
    assert rel(out, ref) <= ORACLE_FP32


def test_fla_wrapper_falls_back_when_key_scales_spread(reference_fla):
    q, k, v, mask = _qkv(120)
    k = k.clone()
    k[:, :, :60] *= 12.0  # early keys: log scales (−‖x‖²/2 + …) far below the later keys'
    fm = _fm("favor+")
    assert fla.scan_partial(fm, q, k, v, mask, mask, 0, D**-0.25) is None
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, attention_mask=mask, chunk_size=16, backend="torch")
        out = gpu.attention(q, k, v, fm, mask, _fla_call(0, 0), grad=False)
    assert rel(out, ref) <= ORACLE_FP32


def _settle(requested, device, **over):
    call = dict(grad=False, causal=True, window=16, sinks=2, memory=0, nq=64, nk=64, feature_map=_fm("favor+"), device=device, dtype=F32)
    call.update(over)
    be = resolve(requested, grad=call["grad"], causal=call["causal"], device=CPU, dtype=F32, whole_call=True)
    return gpu.settle(be, requested, **call)


def test_auto_rule_on_cpu_and_cuda(monkeypatch):
    assert _settle("auto", CPU) not in gpu.GPU_ORDER
    assert _settle("auto", CPU, grad=True) == "torch"
    monkeypatch.setattr(fla, "importable", lambda: False)
    assert _settle("auto", CUDA) == "flex"
    assert _settle("auto", CUDA, grad=True) == "flex"
    assert _settle("auto", CUDA, window=0, sinks=0) not in gpu.GPU_ORDER  # no band, no fla
    monkeypatch.setattr(fla, "importable", lambda: True)
    assert _settle("auto", CUDA) == "fla"
    assert _settle("auto", CUDA, window=0, sinks=0) == "fla"
    assert _settle("auto", CUDA, dtype=torch.float64) == "flex"
    assert _settle("auto", CUDA, feature_map=_fm("none")) == "flex"
    for over in (dict(causal=False), dict(memory=8), dict(nq=1)):
        assert _settle("auto", CUDA, **over) not in gpu.GPU_ORDER, over
    # where only a feature scan is chosen (decoding, a bare scan) a GPU backend is the PyTorch form
    assert resolve("flex", grad=True, causal=True, device=CPU, dtype=F32) == "torch"
    assert resolve("flex", grad=False, causal=True, device=CPU, dtype=F32) == "inference"


def test_auto_leaves_gated_training_to_flex_where_fla_refuses_its_backward(monkeypatch):
    """fla-core raises in the backward of a gated scan on Hopper with Triton >= 3.4, < 3.7.1 (seen on
    an H200, Triton 3.6.0): a decaying or gated map's training call goes to flex there; inference,
    and maps without decay or gate, keep fla."""
    monkeypatch.setattr(fla, "importable", lambda: True)
    decaying = _fm("favor+", 20.0)
    monkeypatch.setattr(fla, "gated_backward_refused", lambda device: True)
    assert _settle("auto", CUDA, grad=True, feature_map=decaying) == "flex"
    assert _settle("auto", CUDA, grad=True, feature_map=_fm("rfa")) == "flex"
    assert _settle("auto", CUDA, grad=False, feature_map=decaying) == "fla"
    assert _settle("auto", CUDA, grad=True) == "fla"  # no decay, no gate: the ungated kernel
    call = gpu.CallFacts(grad=True, causal=True, window=16, sinks=2, memory=0, nq=64, nk=64, feature_map=decaying, device=CUDA)
    assert "fla-core refuses its gated backward on Hopper" in gpu.unsupported("fla", call)
    assert gpu.unsupported("flex", call) is None
    monkeypatch.setattr(fla, "gated_backward_refused", lambda device: False)
    assert _settle("auto", CUDA, grad=True, feature_map=decaying) == "fla"


@pytest.mark.parametrize("capability,triton,tilelang,refused", [
    ((9, 0), "3.6.0", False, True), ((9, 0), "3.4.0", False, True), ((9, 0), "3.7.1", False, False), ((9, 0), "3.3.1", False, False),
    ((8, 0), "3.6.0", False, False), ((10, 0), "3.6.0", False, False), ((9, 0), "3.6.0", True, False)])
def test_fla_gated_backward_rule(monkeypatch, capability, triton, tilelang, refused):
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: triton if name == "triton" else "0")
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if tilelang else None) if name == "tilelang" else find(name, *a))
    fla._triton_gated_backward_bug.cache_clear()  # the packages are looked up once per process
    assert fla.gated_backward_refused(CUDA) is refused
    assert fla.gated_backward_refused(CPU) is False
    fla._triton_gated_backward_bug.cache_clear()


def test_named_gpu_backends_refuse_calls_they_cannot_answer(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # fla on CPU: refused outside the interpreter
    q, k, v, mask = _qkv(40)
    fm = _fm("favor+")
    with pytest.raises(ValueError, match=r"backend='flex' needs an exact band \(window > 0 or sinks > 0\)"):
        random_feature_attention(q, k, v, fm, backend="flex")
    with pytest.raises(ValueError, match="causal attention only"):
        random_feature_attention(q, k, v, fm, causal=False, window=4, backend="flex")
    with pytest.raises(ValueError, match="does not answer memory > 0"):
        random_feature_attention(q, k, v, fm, window=4, memory=4, memory_every=8, backend="flex")
    with pytest.raises(ValueError, match="Nq=10, Nk=40"):
        random_feature_attention(q[:, :, -10:], k, v, fm, window=4, backend="flex")
    with pytest.raises(ValueError, match="needs a CUDA device for gradients"):
        random_feature_attention(q.requires_grad_(), k, v, fm, window=4, backend="flex")
    with pytest.raises(ValueError, match=r"backend='fla' is not available for cpu .*pip install hf_rfa\[gpu\]"):
        random_feature_attention(q.detach(), k, v, fm, window=4, backend="fla")
    assert BACKENDS["flex"].whole_call and BACKENDS["fla"].whole_call


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("On", True), ("0", False), ("", False), (None, False)])
def test_fla_runs_on_cpu_only_under_tritons_interpreter(monkeypatch, value, on):
    """``fla`` is available on a CPU tensor only where ``TRITON_INTERPRET`` is on (read as Triton
    reads it) and fla-core is installed; ``auto`` never takes it there; CUDA is unchanged."""
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.setattr(fla, "importable", lambda: True)
    assert fla.interpreted() is on
    assert fla.available(CPU, F32) is on
    assert not fla.available(CPU, torch.float64)
    assert fla.available(CUDA, F32)
    assert not fla.available(torch.device("meta"), F32)
    assert _settle("auto", CPU) not in gpu.GPU_ORDER
    if on:
        assert _settle("fla", CPU) == "fla"
    else:
        with pytest.raises(ValueError, match=r"backend='fla' is not available for cpu torch.float32: .*TRITON_INTERPRET=1"):
            _settle("fla", CPU)
    monkeypatch.setattr(fla, "importable", lambda: False)
    assert not fla.available(CPU, F32)


def test_converted_model_with_flex_backend_matches_torch():
    ids, mask = batch("llama", n=20)
    logits = {}
    for name in ("flex", "torch"):
        model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=4, sinks=1, backend=name))
        with torch.no_grad():
            logits[name] = model(input_ids=ids, attention_mask=mask).logits
    assert (logits["flex"] - logits["torch"]).abs().max() <= PLUMBING_LOGITS


@pytest.mark.parametrize("name,decay", [("favor+", 20.0), ("hedgehog", 0.0), ("rfa", 0.0)], ids=["favor+-decay", "hedgehog", "rfa-gate"])
def test_fla_wrapper_gradients_equal_torch_backend(reference_fla, name, decay):
    """The wrapper's differentiable arithmetic (key scaling, references, the log scale it returns)
    in float64 with the PyTorch kernel twin: every input and feature-map gradient equals the
    ``torch`` backend's (no band: FlexAttention has no CPU backward)."""
    from tolerances import GRAD_FP64

    q, k, v, mask = (x.double() if x.is_floating_point() else x for x in _qkv(90))
    fm = _fm(name, decay).double()
    up = torch.randn(B, H, 90, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = []
    for run in ("torch", "fla"):
        fm.zero_grad()
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        if run == "torch":
            out = random_feature_attention(*xs, fm, attention_mask=mask, chunk_size=16, backend="torch")
        else:
            out = gpu.attention(*xs, fm, mask, _fla_call(0, 0), grad=True)
        (out * up).sum().backward()
        grads.append([x.grad for x in xs] + [p.grad for p in fm.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 3  # q, k, v and the map's parameters (decay, gate, learned)
    for a, b in zip(*grads):
        assert rel(a, b) <= GRAD_FP64


def test_fla_core_is_an_optional_extra_imported_only_when_used():
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("fla-core") for dep in extras["gpu"])
    code = "import sys, hf_rfa, torch; hf_rfa.random_feature_attention(*(torch.randn(1, 2, 8, 4) for _ in range(3)), hf_rfa.build_feature_map('favor+', head_dim=4, num_features=4, seed=0)); print('fla' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.stdout.strip() == "False", out.stderr
