"""Mixed precision: every path of the op and of a converted model under ``torch.autocast``
(bf16 and fp16), forward and backward, against the fp32 computation on the same (rounded)
inputs. Features, states and sums stay float32 inside the op; only the output is low precision."""

import pytest
import torch

import hf_rfa
from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention
from conftest import rel
from tiny_models import batch, tiny_model
from tolerances import LOW_PRECISION

ALL = hf_rfa.available_feature_maps()
DTYPES = [torch.bfloat16, torch.float16]
# (causal, window, sinks): pure causal, hybrid window + sinks, bidirectional, bidirectional hybrid
PATHS = {"causal": (True, 0, 0), "causal-W5-S2": (True, 5, 2), "bidir": (False, 0, 0), "bidir-W4-S1": (False, 4, 1)}


def _fm(name, d=16):
    kw = {"gate": True} if name == "rfa" else {}  # rfa with its gate: the gated causal path
    return hf_rfa.build_feature_map(name, head_dim=d, num_features=32, seed=0, **kw)


def _qkv(dtype, n=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h in (4, 2, 2))
    q, k = 0.5 * q, 0.5 * k  # tame logits (rff's normaliser crosses zero for peaked attention)
    return tuple(x.to(dtype) for x in (q, k, v))  # the low-precision inputs autocast would give


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", ALL)
def test_op_forward_backward_under_autocast(name, path, dtype):
    causal, window, sinks = PATHS[path]
    if name == "none" and window == 0:
        pytest.skip("feature_map='none' needs a window or sinks (refused with ValueError, tested in test_window_only)")
    fm = _fm(name)
    mask = torch.ones(2, 37, dtype=torch.bool)
    mask[1, :3] = False
    up = torch.randn(2, 4, 37, 16, generator=torch.Generator().manual_seed(1)) * mask[:, None, :, None]
    results = []
    for low in (True, False):
        fm.zero_grad()
        q, k, v = (x.float() if not low else x for x in _qkv(dtype))
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        with torch.autocast("cpu", dtype=dtype, enabled=low):
            out = hf_rfa.random_feature_attention(q, k, v, fm, causal=causal, attention_mask=mask, window=window, sinks=sinks, chunk_size=8)
        assert out.dtype == (dtype if low else torch.float32)
        (out.float() * up).sum().backward()
        grads = [q.grad, k.grad, v.grad] + [p.grad for p in fm.parameters() if p.grad is not None]
        results.append((out, grads))
    (out_lo, g_lo), (out_hi, g_hi) = results
    assert rel(out_lo.float(), out_hi) <= LOW_PRECISION
    assert len(g_lo) == len(g_hi)
    for a, b in zip(g_lo, g_hi):
        assert a.dtype == b.dtype or a.dtype == dtype
        assert torch.isfinite(a).all()
        assert rel(a.float(), b) <= LOW_PRECISION


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["favor+", "rfa", "hedgehog"])
def test_decode_under_autocast(name, dtype):
    """continue_attention (prefill, a chunk, single tokens) under autocast vs the same in fp32."""
    q, k, v = _qkv(dtype)
    fm = _fm(name)
    outs = []
    for low in (True, False):
        qq, kk, vv = (x if low else x.float() for x in (q, k, v))
        st = DecodeState.empty((2, 2, 16, 16, fm.feature_dim), 2, dtype=qq.dtype)
        parts = []
        with torch.autocast("cpu", dtype=dtype, enabled=low), torch.no_grad():
            for a, b in ((0, 20), (20, 30), (30, 31), (31, 37)):
                o, st = continue_attention(st, qq[:, :, a:b], kk[:, :, a:b], vv[:, :, a:b], fm, None, DecodeCall(window=5, sinks=2, chunk_size=8))
                parts.append(o)
        assert st.linear.S.dtype == torch.float32
        outs.append(torch.cat(parts, dim=2))
    assert outs[0].dtype == dtype
    assert rel(outs[0].float(), outs[1]) <= LOW_PRECISION


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("setting", ["favor+-W8-S2", "rfa-gate"])
def test_converted_model_trains_under_autocast(setting, dtype):
    """A converted Llama: loss and parameter gradients under autocast vs fp32 (what Trainer's
    --bf16 / --fp16 do), padded batch, all parameters trainable."""
    cfg = hf_rfa.RFAConfig(feature_map="favor+", num_features=32, window=8, sinks=2) if setting.startswith("favor") else hf_rfa.RFAConfig(feature_map="rfa", gate=True, num_features=32)
    model = hf_rfa.convert(tiny_model("llama"), cfg).train()
    ids, mask = batch("llama", n=40)
    res = []
    for low in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=low):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        res.append((loss.detach().float(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    assert torch.isfinite(res[0][1]).all()
    assert abs(res[0][0] - res[1][0]) <= LOW_PRECISION * res[1][0]
    # gradients of the whole model: low-precision matmuls everywhere, not only in attention
    assert rel(res[0][1], res[1][1]) <= 3 * LOW_PRECISION


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_converted_model_generates_under_autocast(dtype):
    """generate() with the recurrent state cache under autocast: same greedy tokens as fp32."""
    cfg = hf_rfa.RFAConfig(feature_map="favor+", num_features=32, window=4, sinks=2)
    model = hf_rfa.convert(tiny_model("llama"), cfg)
    ids = batch("llama", n=12, b=1)[0]
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=dtype):
            low = model(ids).logits
            gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert rel(low.float(), ref) <= LOW_PRECISION
    assert gen.shape == (1, 18)


# the recipe the main job trains: learned map, window + sinks, decay gate, feature part on un-rotated q/k
RECIPE = dict(feature_map="hedgehog", num_features=16, window=8, sinks=2, decay=16.0, feature_input="unrotated", seed=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", ["causal-W5-S2", "causal"])
@pytest.mark.parametrize("name", ["favor+", "rfa", "hedgehog"])
def test_backward_inside_autocast_equals_backward_outside(name, path, dtype):
    """``loss.backward()`` written inside the autocast block (common in user loops): the
    recomputing autograd Functions' backward runs with autocast off, so the gradients are those of
    a backward outside it — bit for bit (before: a dtype error in the recomputed scan)."""
    causal, window, sinks = PATHS[path]
    fm = _fm(name)
    up = torch.randn(2, 4, 37, 16, generator=torch.Generator().manual_seed(1))
    grads = []
    for inside in (True, False):
        fm.zero_grad()
        q, k, v = (x.detach().requires_grad_() for x in _qkv(dtype))
        with torch.autocast("cpu", dtype=dtype):
            out = hf_rfa.random_feature_attention(q, k, v, fm, causal=causal, window=window, sinks=sinks, chunk_size=8)
            loss = (out.float() * up).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([q.grad, k.grad, v.grad] + [p.grad for p in fm.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) >= 3
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_converted_model_backward_inside_autocast(dtype):
    """The main job's recipe on a tiny Llama, ``loss.backward()`` inside the autocast block: the
    same gradients as outside it."""
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**RECIPE)).train()
    ids, mask = batch("llama", n=40)
    res = []
    for inside in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        res.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.isfinite(res[0]).all()
    assert torch.equal(res[0], res[1])


def test_attention_inputs_saved_in_the_autocast_dtype():
    """Under autocast a converted Llama's attention takes q, k, v in the autocast dtype, as SDPA
    does: what backward keeps of q/k (float32 after the rotary embedding) is the bf16 copy, not the
    float32 tensor — half the bytes (before: every layer saved float32 q and k). The decay gate's
    un-rotation keeps the model's float32 cos/sin, not a per-layer low-precision copy."""
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**RECIPE)).train()
    cfg = model.config
    ids, mask = batch("llama", n=40)
    b, n, d = ids.shape[0], ids.shape[1], cfg.hidden_size // cfg.num_attention_heads
    qk_shapes = {(b, cfg.num_attention_heads, n, d), (b, cfg.num_key_value_heads, n, d)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    qk = [dt for shape, dt in saved if shape in qk_shapes]
    assert len(qk) >= 2 * cfg.num_hidden_layers  # q and k (and v) of every layer
    assert set(qk) == {torch.bfloat16}
    rope_low = [shape for shape, dt in saved if dt == torch.bfloat16 and len(shape) == 4 and shape[1] == 1 and shape[2] == n]
    assert rope_low == []


def test_autocast_inputs_follow_sdpa():
    """``autocast_inputs``: floating inputs other than float64 go to the autocast dtype under
    autocast; nothing changes outside it."""
    from hf_rfa.hf.attention import autocast_inputs

    x32, x16, x64, ints = torch.ones(2), torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.long)
    assert [t.dtype for t in autocast_inputs(x32, x16, x64, ints)] == [torch.float32, torch.float16, torch.float64, torch.long]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [t.dtype for t in autocast_inputs(x32, x16, x64, ints)] == [torch.bfloat16, torch.bfloat16, torch.float64, torch.long]


def test_gradient_checkpointing_under_autocast_equals_plain():
    """transformers' gradient checkpointing under bf16 autocast (Trainer ``--bf16
    --gradient_checkpointing``): the recomputed layers cast q/k/v as the forward did, so the
    gradients equal the run without checkpointing."""
    import copy

    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**RECIPE))
    ids, mask = batch("llama", n=40)
    grads = []
    for gc in (False, True):
        m = copy.deepcopy(model).train()
        if gc:
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n
