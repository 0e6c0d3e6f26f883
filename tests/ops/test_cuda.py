"""The op and a converted model on a CUDA GPU (``cuda`` marker: skipped without one).

Every backend that runs on CUDA — the PyTorch forms (``torch``, ``inference``), ``flex``
(FlexAttention band) and ``fla`` (fla-core scan, where installed) — forward and backward with a
random upstream gradient, in fp32 and under bf16 autocast, against the CPU ``torch`` backend in
fp32 on the same (rounded) inputs; fla's kernel against its plain-PyTorch twin; a converted tiny
model's greedy generate on CUDA against the CPU's, with the constant-memory cache."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops import random_feature_attention
from hf_rfa.ops.backends import fla
from conftest import rel
from tiny_models import VOCAB, tiny_model
from tolerances import GPU_BF16, GRAD_FP32, LOW_PRECISION, ORACLE_FP32, TF32_KERNEL

pytestmark = pytest.mark.cuda

B, H, HKV, N, D = 2, 4, 2, 200, 16
#: (window, sinks, decay half-life)
PATHS = {"causal": (0, 0, 0.0), "W16-S2": (16, 2, 0.0), "decay-W16-S2": (16, 2, 30.0), "decay": (0, 0, 30.0)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _fm(name, decay):
    kw = {"gate": True} if name == "rfa" else {}
    if name == "hedgehog":
        kw = dict(num_heads=H, num_kv_heads=HKV)
    fm = hf_rfa.build_feature_map(name, head_dim=D, num_features=32, seed=0, **kw)
    if decay and name not in ("rfa", "none"):
        fm.enable_decay(decay)
    return fm


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(B, h, N, D, generator=g) for h in (H, HKV, HKV))
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, :9] = False
    up = torch.randn(B, H, N, D, generator=g) * mask[:, None, :, None]
    return [x.to(dtype) for x in (q, k, v)], mask, up


def _run(fm, q, k, v, mask, up, device, backend, window, sinks, autocast):
    fm = fm.to(device)
    fm.zero_grad()
    q, k, v = (x.detach().to(device).requires_grad_() for x in (q, k, v))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        out = random_feature_attention(q, k, v, fm, attention_mask=mask.to(device), window=window, sinks=sinks, chunk_size=16, backend=backend)
    (out.float() * up.to(device)).sum().backward()
    grads = [q.grad, k.grad, v.grad] + [p.grad for p in fm.parameters() if p.grad is not None]
    return out.float().cpu(), [x.float().cpu() for x in grads]


def _backends(window, sinks, name):
    out = ["torch"]
    if window > 0 or sinks > 0:
        out.append("flex")
    if fla.importable() and name != "none" and window < N:
        out.append("fla")
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", hf_rfa.available_feature_maps())
def test_every_cuda_backend_equals_the_cpu_reference(name, path, dtype):
    window, sinks, decay = PATHS[path]
    if name == "none" and window == 0:
        pytest.skip("feature_map='none' needs a window or sinks")
    fm = _fm(name, decay)
    (q, k, v), mask, up = _inputs(DTYPES[dtype])
    ref_out, ref_grads = _run(fm, q.float(), k.float(), v.float(), mask, up, torch.device("cpu"), "torch", window, sinks, False)
    for backend in _backends(window, sinks, name) + ["auto"]:
        out, grads = _run(fm, q, k, v, mask, up, torch.device("cuda"), backend, window, sinks, dtype == "bf16")
        tol_out = GPU_BF16 if dtype == "bf16" else (TF32_KERNEL if backend == "fla" else ORACLE_FP32)
        tol_grad = LOW_PRECISION if dtype == "bf16" else (TF32_KERNEL if backend == "fla" else GRAD_FP32)
        assert rel(out, ref_out) <= tol_out, backend
        assert len(grads) == len(ref_grads), backend
        for a, b in zip(grads, ref_grads):
            assert torch.isfinite(a).all(), backend
            assert rel(a, b) <= tol_grad, backend


@pytest.mark.parametrize("path", ["causal", "W16-S2"])
def test_inference_backend_on_cuda(path):
    window, sinks, _ = PATHS[path]
    fm = _fm("favor+", 0.0)
    (q, k, v), mask, _ = _inputs(torch.float32)
    with torch.no_grad():
        ref = random_feature_attention(q, k, v, fm, attention_mask=mask, window=window, sinks=sinks, chunk_size=16, backend="torch")
        dev = [x.cuda() for x in (q, k, v)]
        out = random_feature_attention(*dev, fm.cuda(), attention_mask=mask.cuda(), window=window, sinks=sinks, chunk_size=16, backend="inference")
    assert rel(out.cpu(), ref) <= ORACLE_FP32


@pytest.mark.skipif(not fla.importable(), reason="fla-core is not installed (pip install hf_rfa[gpu])")
@pytest.mark.parametrize("decay", [False, True], ids=["no-decay", "decay"])
def test_fla_kernel_equals_its_pytorch_twin(decay):
    g = torch.Generator().manual_seed(0)
    n, h, f, dv = 300, 4, 32, 17
    q, k = (torch.rand(B, n, h, f, generator=g) for _ in range(2))
    v = torch.randn(B, n, h, dv, generator=g)
    gg = -torch.rand(B, n, h, generator=g) * 0.1 if decay else None
    ref, _ = fla.reference_kernel(q, k, v, g=gg, scale=1.0)
    cuda = [x.cuda() for x in (q, k, v)]
    out, _ = fla._kernel()(*cuda, g=gg.cuda() if decay else None, scale=1.0)
    assert rel(out.float().cpu(), ref) <= TF32_KERNEL


def _model(device):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=4, sinks=1))
    return model.to(device)


def test_converted_model_generates_on_cuda_as_on_cpu():
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        ref = _model("cpu").generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        model = _model("cuda")
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            low = model(ids.cuda(), attention_mask=mask.cuda()).logits.float().cpu()
        full = _model("cpu")(ids, attention_mask=mask).logits
    assert isinstance(out.cache, hf_rfa.RFACache)
    assert torch.equal(out.sequences.cpu(), ref)
    assert rel(low[mask.bool()], full[mask.bool()]) <= LOW_PRECISION
