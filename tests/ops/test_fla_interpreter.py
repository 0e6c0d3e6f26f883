"""The ``fla`` backend on a CPU through Triton's interpreter: fla-core's real ``chunk_simple_gla``
(forward and backward) against its plain-PyTorch twin, and ``backend="fla"`` against the
``torch`` backend with a window, sinks, decay, RFA's gate and padding — test_cuda.py's fla cases
at small sizes. Float32 throughout; the interpreter multiplies in float32 (no TF32), so the
tolerances are the float32 ones (ORACLE_FP32, GRAD_FP32), not TF32_KERNEL.

Skipped unless fla-core (with Triton) is installed and ``TRITON_INTERPRET=1`` was set before
Triton was imported (it decides at a kernel's definition whether it is interpreted)::

    TRITON_INTERPRET=1 python -m pytest tests/ops/test_fla_interpreter.py

Two adjustments to Triton's interpreter (Triton 3.9; neither has a setting) are made for this
module and undone after it: the autotuner gets a benchmark that picks each kernel's first config
without timing it (with no GPU driver Triton has none to offer), and the interpreter's rewrite of a
kernel makes each ``for`` loop counter a Triton scalar, as the compiler does (fla-core calls
``i_t.to(tl.int64)`` on its loop counters; the interpreter otherwise passes Python ints).
Gradients are checked on calls without a band: FlexAttention has no CPU backward."""

import ast
import copy
import logging

import pytest
import torch

import hf_rfa
from hf_rfa.ops import random_feature_attention
from hf_rfa.ops.backends import fla
from conftest import rel
from tolerances import GRAD_FP32, ORACLE_FP32

pytestmark = pytest.mark.skipif(
    not (fla.importable() and fla.interpreted()),
    reason="needs fla-core and Triton installed and TRITON_INTERPRET=1 set before Triton is imported",
)

B, H, HKV, N, D = 2, 2, 1, 72, 16
CPU = torch.device("cpu")
#: (window, sinks, decay half-life)
PATHS = {"causal": (0, 0, 0.0), "W16-S2": (16, 2, 0.0), "decay-W16-S2": (16, 2, 30.0), "decay": (0, 0, 30.0)}
MAPS = [m for m in hf_rfa.available_feature_maps() if m != "none"]


@pytest.fixture(scope="module", autouse=True)
def interpreter_adjustments():
    """The two adjustments of the module docstring, undone after the module."""
    import triton
    from triton.runtime import driver, interpreter

    missing = [name for name, ok in (
        ("triton.runtime.interpreter.ASTTransformer", hasattr(interpreter, "ASTTransformer")),
        ("triton.runtime.interpreter.FunctionRewriter.ast_transformer", hasattr(getattr(interpreter, "FunctionRewriter", None), "ast_transformer")),
        ("triton.runtime.driver._active", hasattr(driver, "_active")),
    ) if not ok]
    if missing:
        pytest.fail(f"Triton {triton.__version__}'s interpreter lacks {', '.join(missing)}; the adjustments here target Triton 3.9")

    class FirstConfig:
        """A driver with only a benchmarker: every config 'takes' the same time, so the first wins."""

        def get_benchmarker(self):
            return lambda kernel_call, quantiles=None, **_: [0.0, 0.0, 0.0]

    class LoopCountersAsScalars(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor", ctx=ast.Load())
                wrap = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                  value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)], keywords=[]))
                node.body.insert(0, ast.copy_location(wrap, node))
            return node

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(driver, "_active", FirstConfig())
        mp.setattr(interpreter.FunctionRewriter, "ast_transformer", LoopCountersAsScalars())
        yield


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of fla-core's kernel that the backend makes (a fallback makes none)."""
    calls = []
    real = fla._kernel()

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(fla, "_kernel", lambda: counted)
    return calls


def _fm(name, decay=0.0):
    kw = {"gate": True} if name == "rfa" else {}
    if name in ("hedgehog", "t2r"):
        kw = dict(num_heads=H, num_kv_heads=HKV)
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=16, seed=0, **kw)
    if decay and name != "rfa":
        fm.enable_decay(decay)
    return fm


def _inputs(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (0.5 * torch.randn(B, h, n, D, generator=g) for h in (H, HKV, HKV))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[1, :9] = False
    return q, k, v, mask


@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
def test_fla_kernel_and_its_gradients_equal_its_pytorch_twin(decay):
    g = torch.Generator().manual_seed(0)
    n, h, f, dv = 100, 2, 16, 17  # two of the kernel's 64-token chunks, the second ragged
    q, k = (torch.rand(1, n, h, f, generator=g) for _ in range(2))
    v = torch.randn(1, n, h, dv, generator=g)
    gg = -torch.rand(1, n, h, generator=g) * 0.1 if decay else None
    up = torch.randn(1, n, h, dv, generator=g)
    outs, grads = [], []
    for fn in (fla._kernel(), fla.reference_kernel):
        xs = [x.clone().requires_grad_() for x in ((q, k, v, gg) if decay else (q, k, v))]
        out, _ = fn(*xs[:3], g=xs[3] if decay else None, scale=1.0)
        outs.append(out)
        grads.append(torch.autograd.grad((out * up).sum(), xs))
    assert rel(*outs) <= ORACLE_FP32
    assert len(grads[0]) == (4 if decay else 3)
    for a, b in zip(*grads):
        assert rel(a, b) <= GRAD_FP32


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", MAPS)
def test_fla_backend_on_cpu_equals_torch_backend(kernel_calls, name, path):
    window, sinks, decay = PATHS[path]
    fm = _fm(name, decay)
    q, k, v, mask = _inputs()
    kw = dict(attention_mask=mask, window=window, sinks=sinks, chunk_size=16)
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, backend="torch", **kw)
        out = random_feature_attention(q, k, v, fm, backend="fla", **kw)
    assert len(kernel_calls) == 1, "the kernel must answer (no fallback)"
    assert rel(out, ref) <= ORACLE_FP32


def _out_and_grads(fm, inputs, mask, backend):
    """The output and the gradients w.r.t. q, k, v and the map's trainable parameters under a
    seeded upstream gradient, zero at padded queries."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = random_feature_attention(*xs, fm, attention_mask=mask, chunk_size=16, backend=backend)
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad((out * up * mask[:, None, :, None]).sum(), xs + [p for p in fm.parameters() if p.requires_grad])
    return out, grads


@pytest.mark.parametrize("path", ["causal", "decay"])
@pytest.mark.parametrize("name", MAPS)
def test_fla_backend_gradients_on_cpu_equal_torch_backend(kernel_calls, name, path):
    """Input and feature-map parameter gradients (decay, gate, learned maps) through fla-core's
    backward against the torch backend in float64: a decay's gradient sums many terms of both
    signs, so the float32 torch backend is itself ~2e-5 from it (rff) — the float64 one measures
    fla's error alone."""
    _, _, decay = PATHS[path]
    fm = _fm(name, decay)
    q, k, v, mask = _inputs(seed=1)
    out, grads = _out_and_grads(fm, (q, k, v), mask, "fla")
    ref, ref_grads = _out_and_grads(copy.deepcopy(fm).double(), (q.double(), k.double(), v.double()), mask, "torch")
    assert len(kernel_calls) == 1, "the kernel must answer (no fallback)"
    assert rel(out, ref) <= ORACLE_FP32
    assert len(grads) == len(ref_grads) == 3 + sum(p.requires_grad for p in fm.parameters())
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        assert rel(a, b) <= GRAD_FP32


def test_fla_backend_falls_back_when_key_scales_spread(kernel_calls, caplog):
    """Keys whose log scales span more than SPREAD nats: the PyTorch scan answers (logged), the
    kernel is not called, and the output is the torch backend's."""
    q, k, v, mask = _inputs(n=120)
    k = k.clone()
    k[:, :, :60] *= 24.0  # early keys: log scales (−‖x‖²/2 + …) far below the later keys'
    fm = _fm("favor+")
    assert fla.scan_partial(fm, q, k, v, mask, mask, 0, D**-0.25) is None
    with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="hf_rfa.ops.backends.gpu"):
        ref = random_feature_attention(q, k, v, fm, attention_mask=mask, chunk_size=16, backend="torch")
        out = random_feature_attention(q, k, v, fm, attention_mask=mask, chunk_size=16, backend="fla")
    assert kernel_calls == []
    assert "the PyTorch scan answers" in caplog.text
    assert rel(out, ref) <= ORACLE_FP32


def test_fla_backend_on_cpu_refuses_gradients_through_a_band():
    q, k, v, mask = _inputs()
    with pytest.raises(ValueError, match="backend='fla' needs a CUDA device for gradients"):
        random_feature_attention(q.requires_grad_(), k, v, _fm("favor+"), attention_mask=mask, window=16, backend="fla")
