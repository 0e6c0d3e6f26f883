"""Constant-memory decoding: ``ops.decode.continue_attention`` and ``hf_rfa.RFACache`` in generate().

Reference twins: the op against ``random_feature_attention`` over the whole sequence; a model
decoding with the state cache (prefill, a multi-token chunk, single tokens) against one full
forward; generate() with the cache against ``use_cache=False`` (full recomputation).
"""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.configuration_utils import GenerationMode

import hf_rfa
from hf_rfa.recipes.training.peft_utils import lora_config
from hf_rfa.hf.cache import RFACacheLayer
from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention
from conftest import rel
from tiny_models import CAUSAL, tiny_model
from tiny_models import batch as tiny_batch
from tolerances import DECODE_LOGITS, ORACLE_FP32

V = 97  # vocabulary of the tiny models


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread is faster and steadier on a shared CPU than several."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

SETTINGS = {
    "favor+": dict(feature_map="favor+", num_features=32),
    "hybrid": dict(feature_map="favor+", num_features=32, window=4, sinks=2),
    "gated-rfa": dict(feature_map="rfa", gate=True, num_features=32, window=3),
}


# --- the op ----------------------------------------------------------------------------------
def _fm(name, gate, h, hkv, d):
    kw = dict(gate=True, num_heads=h, num_kv_heads=hkv) if gate else {}
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=32, seed=1, **kw)
    if gate:  # an input-dependent gate that really decays (the init is a constant ~0.98)
        with torch.no_grad():
            fm.gate_weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
            fm.gate_bias.fill_(1.0)
    return fm


@pytest.mark.parametrize(
    "name,window,sinks,gate",
    [("favor+", 0, 0, False), ("favor+", 4, 2, False), ("favor+", 0, 2, False), ("elu", 3, 1, False),
     ("rfa", 0, 0, True), ("rfa", 5, 2, True)],
    ids=["favor+", "favor+-W4-S2", "favor+-S2", "elu-W3-S1", "rfa-gate", "rfa-gate-W5-S2"],
)
@pytest.mark.parametrize("splits", [[37], [10], [3, 9], [1]], ids=["one-shot", "prefill10", "3+9", "token-by-token"])
def test_continue_attention_matches_full_sequence(name, window, sinks, gate, splits):
    b, h, hkv, n, d = 2, 4, 2, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :5] = False  # left padding: sinks are the first real tokens, padding never decays
    fm = _fm(name, gate, h, hkv, d)
    ref = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks, chunk_size=8)
    state = DecodeState.empty((b, hkv, d, d, fm.feature_dim), sinks, torch.float32)
    outs, i = [], 0
    for s in splits + [1] * (n - sum(splits)):
        o, state = continue_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, mask[:, i:i + s], DecodeCall(window=window, sinks=sinks, chunk_size=8))
        outs.append(o)
        i += s
    assert state.seen == n and state.win_k.shape[2] == min(window, n)
    assert rel(torch.cat(outs, 2), ref) <= ORACLE_FP32


def test_decode_state_bytes_do_not_grow():
    b, h, d = 1, 2, 8
    fm = hf_rfa.build_feature_map("favor+", head_dim=d, num_features=16, seed=0)
    state = DecodeState.empty((b, h, d, d, fm.feature_dim), 2, torch.float32)
    sizes = []
    for step in range(12):
        x = torch.randn(b, h, 1, d)
        _, state = continue_attention(state, x, x, x, fm, None, DecodeCall(window=4, sinks=2))
        sizes.append(state.nbytes())
    assert sizes[4:] == [sizes[4]] * 8  # once the window is full, nothing grows


def test_continue_attention_rejects_bad_input():
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0)
    state = DecodeState.empty((1, 2, 8, 8, fm.feature_dim), 0, torch.float32)
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="attention_mask"):
        continue_attention(state, x, x, x, fm, torch.ones(1, 5))
    with pytest.raises(ValueError, match="sinks"):
        continue_attention(state, x, x, x, fm, None, DecodeCall(sinks=2))


def _decode(fm, q, k, v, mask, window, sinks, splits, state=None):
    """``continue_attention`` over ``splits`` (then single tokens): ``(out [B, H, N, Dv], state)``."""
    b, h, n, d = q.shape
    state = state or DecodeState.empty((b, k.shape[1], d, v.shape[-1], fm.feature_dim), sinks, q.dtype)
    outs, i = [], 0
    for s in splits + [1] * (n - sum(splits)):
        o, state = continue_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, None if mask is None else mask[:, i:i + s], DecodeCall(window=window, sinks=sinks, chunk_size=8))
        outs.append(o)
        i += s
    return torch.cat(outs, 2), state


GUARD_MAPS = [(m, 0, 0) for m in ("favor+", "elu", "rfa", "hedgehog")] + [(m, 4, 1) for m in ("favor+", "elu", "none")]


@pytest.mark.parametrize("name,window,sinks", GUARD_MAPS, ids=[f"{m}-W{w}-S{s}" for m, w, s in GUARD_MAPS])
@pytest.mark.parametrize("splits", [[40], [10, 15], [1]], ids=["one-shot", "10+15", "token-by-token"])
def test_decode_nonfinite_key_poisons_only_the_rows_softmax_would(name, window, sinks, splits):
    """One inf/nan key (or value) at position 20 of batch row 0, kv head 0: exactly the rows >= 20
    of that row's query heads 0-1 are NaN (as in ``random_feature_attention``); every other row
    equals the clean decode, also in later calls (the state is not poisoned)."""
    b, h, hkv, n, d = 2, 4, 2, 40, 8
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=8, seed=0)
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    clean, _ = _decode(fm, q, k, v, None, window, sinks, splits)
    expect = torch.zeros(b, h, n, dtype=torch.bool)
    expect[0, :2, 20:] = True
    for which, bad in (("k", float("inf")), ("k", float("nan")), ("v", float("-inf"))):
        k2, v2 = k.clone(), v.clone()
        (k2 if which == "k" else v2)[0, 0, 20, 3] = bad
        out, state = _decode(fm, q, k2, v2, None, window, sinks, splits)
        full = hf_rfa.random_feature_attention(q, k2, v2, fm, causal=True, window=window, sinks=sinks, chunk_size=8)
        assert torch.equal(~torch.isfinite(out).all(-1), expect)
        assert torch.equal(~torch.isfinite(full).all(-1), expect)  # the full op's semantics
        assert rel(out[~expect], clean[~expect]) <= ORACLE_FP32
        assert all(torch.isfinite(t).all() for t in state.tensors().values() if t.is_floating_point())


@pytest.mark.parametrize("name,window,sinks", GUARD_MAPS, ids=[f"{m}-W{w}-S{s}" for m, w, s in GUARD_MAPS])
@pytest.mark.parametrize("splits", [[40], [10, 15], [1]], ids=["one-shot", "10+15", "token-by-token"])
def test_decode_nonfinite_padded_key_or_query_row(name, window, sinks, splits):
    """Non-finite padded keys/values change nothing; a non-finite query makes only its own row NaN."""
    b, h, hkv, n, d = 2, 4, 2, 40, 8
    fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=8, seed=0)
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(b, h, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, 30:] = False  # right padding
    ref, _ = _decode(fm, q, k, v, mask, window, sinks, splits)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[0, :, 3], v2[0, :, 1], k2[1, :, 35], v2[1, :, 39] = float("inf"), float("nan"), float("-inf"), float("nan")
    out, _ = _decode(fm, q, k2, v2, mask, window, sinks, splits)
    assert torch.isfinite(out).all() and torch.equal(out, ref)
    q2[1, 3, 12, 0] = float("nan")
    out, _ = _decode(fm, q2, k, v, mask, window, sinks, splits)
    bad = ~torch.isfinite(out).all(-1)
    assert bad[1, 3, 12] and bad.sum() == 1
    assert torch.equal(out[~bad], ref[~bad])


@pytest.mark.parametrize("seed", range(20))
def test_decode_fp16_signed_rfa_does_not_overflow(seed):
    """As the full op (tests/ops/test_robustness.py): float16 output clamped to its finite range."""
    fm = hf_rfa.build_feature_map("rfa", head_dim=8, num_features=1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, 64, 8, generator=g) * 10**0.5 for _ in range(2))
    v = torch.randn(1, 2, 64, 8, generator=g)
    for splits in ([64], [20], [1]):
        out, _ = _decode(fm, q.half(), k.half(), v.half(), None, 1, 1, splits)
        assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_decode_empty_inputs():
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0)
    state = DecodeState.empty((1, 2, 8, 8, fm.feature_dim), 1, torch.float32)
    x = torch.randn(1, 2, 3, 8)
    _, state = continue_attention(state, x, x, x, fm, None, DecodeCall(window=2, sinks=1))
    out, same = continue_attention(state, x[:, :, :0], x[:, :, :0], x[:, :, :0], fm, None, DecodeCall(window=2, sinks=1))
    assert out.shape == (1, 2, 0, 8) and same.seen == 3
    empty = DecodeState.empty((0, 2, 8, 8, fm.feature_dim), 1, torch.float32)
    out, after = continue_attention(empty, x[:0], x[:0], x[:0], fm, None, DecodeCall(window=2, sinks=1))
    assert out.shape == (0, 2, 3, 8) and after.seen == 3


BAD_DECODE = {
    "window=-1": (dict(window=-1), "window"),
    "window below the kept window": (dict(window=1), "window"),
    "sinks=10**9": (dict(sinks=10**9), "sinks"),
    "chunk_size=0": (dict(chunk_size=0), "chunk_size"),
    "chunk_size=2**31": (dict(chunk_size=2**31), r"chunk_size must be an int in \[1, 4096\]"),
    "nan scale": (dict(scale=float("nan")), "scale"),
    "negative scale": (dict(scale=-1.0), "scale"),
    "feature_map=None": (dict(feature_map=None), "feature_map"),
    "head_dim of the map": (dict(feature_map=hf_rfa.build_feature_map("favor+", head_dim=4, num_features=16)), "head_dim"),
    "feature_dim of the state": (dict(feature_map=hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8)), "feature"),
    "'none' without window or sinks": (dict(feature_map=hf_rfa.build_feature_map("none", head_dim=8), window=0, sinks=0), "window > 0 or sinks > 0"),
    "int tensors": (dict(q=torch.ones(1, 2, 1, 8, dtype=torch.long)), "floating-point"),
    "3-D q": (dict(q=torch.ones(2, 1, 8)), "4-D"),
    "k/v token count": (dict(k=torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 2, 8)), "new tokens"),
    "head dim vs state": (dict(q=torch.randn(1, 2, 1, 4), k=torch.randn(1, 2, 1, 4), v=torch.randn(1, 2, 1, 8)), "D"),
    "value dim vs state": (dict(v=torch.randn(1, 2, 1, 5)), "Dv"),
    "batch vs state": (dict(q=torch.randn(2, 2, 1, 8), k=torch.randn(2, 2, 1, 8), v=torch.randn(2, 2, 1, 8)), "batch"),
    "state": (dict(state=None), "state"),
    "mask shape": (dict(attention_mask=torch.ones(1, 5)), "attention_mask"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE), ids=list(BAD_DECODE))
def test_continue_attention_bad_arguments(case):
    """Every bad argument is a ValueError naming it (as for ``random_feature_attention``)."""
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0)
    state = DecodeState.empty((1, 2, 8, 8, fm.feature_dim), 1, torch.float32)
    x = torch.randn(1, 2, 3, 8)
    _, state = continue_attention(state, x, x, x, fm, None, DecodeCall(window=2, sinks=1))  # keeps 2 keys
    y = torch.randn(1, 2, 1, 8)
    kw = dict(state=state, q=y, k=y, v=y, feature_map=fm, window=2, sinks=1)
    change, match = BAD_DECODE[case]
    kw.update(change)
    settings = DecodeCall(**{key: kw.pop(key) for key in ("window", "sinks", "scale", "chunk_size") if key in kw})
    with pytest.raises(ValueError, match=match):
        continue_attention(**kw, settings=settings)


def test_cache_layer_attend_refuses_bad_shapes():
    """The cache layer checks its inputs before building a state from them."""
    from hf_rfa.hf.attention import RFAAttention

    rfa = RFAAttention(hf_rfa.build_feature_map("favor+", head_dim=8, num_features=16, seed=0), window=2, sinks=1)
    layer, x = RFACacheLayer(), torch.randn(1, 2, 1, 8)
    layer.update(x, x, kwargs={})
    with pytest.raises(ValueError, match="4-D"):
        layer.attend(rfa, x, torch.randn(2, 1, 8), torch.randn(2, 1, 8), None, True, None)
    assert layer.state is None
    with pytest.raises(ValueError, match="floating-point"):
        layer.attend(rfa, x, x.long(), x, None, True, None)
    assert layer.state is None
    out = layer.attend(rfa, x, x, x, None, True, None)
    assert out.shape == (1, 2, 1, 8) and layer.state.seen == 1


# --- models ----------------------------------------------------------------------------------
def _llama(layers=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _gpt2():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _converted(make, setting, **overrides):
    model = hf_rfa.convert(make(), hf_rfa.RFAConfig(**{**SETTINGS[setting], **overrides}))
    for fm in hf_rfa.model_feature_maps(model):
        if getattr(fm, "has_gate", False):
            with torch.no_grad():
                fm.gate_weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
                fm.gate_bias.fill_(1.0)
    return model


def _batch(n=12, pad=4):
    ids = torch.randint(2, V, (2, n), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


def _generated_cache(model, ids, mask, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True, **kw)
    return out.sequences, out.cache


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", list(MODELS))
def test_incremental_logits_match_full_forward(arch, setting):
    """Prefill 5, a chunk of 4, then single tokens (left-padded batch) == one full forward."""
    model = _converted(MODELS[arch], setting)
    ids, mask = _batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = hf_rfa.RFACache(model)
        outs, t = [], 0
        for step in (5, 4, 1, 1, 1):
            outs.append(model(ids[:, t:t + step], attention_mask=mask[:, :t + step], cache=cache, use_cache=True).logits)
            t += step
    assert cache.get_seq_length() == ids.shape[1]
    inc = torch.cat(outs, 1)
    assert (inc - full)[mask.bool()].abs().max().item() <= DECODE_LOGITS


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_generate_uses_state_cache_and_matches_recompute(arch, setting):
    model = _converted(MODELS[arch], setting)
    ids, mask = _batch()
    with torch.no_grad():
        seq, cache = _generated_cache(model, ids, mask, do_sample=False)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    assert isinstance(cache, hf_rfa.RFACache)  # picked without the user asking
    assert all(isinstance(layer, RFACacheLayer) and layer.keys is None for layer in cache.layers)
    assert torch.equal(seq, ref)


def test_sampling_and_beam_search_match_recompute():
    model = _converted(_llama, "hybrid")
    ids, mask = _batch()
    with torch.no_grad():
        torch.manual_seed(11)
        s1 = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20)
        torch.manual_seed(11)
        s0 = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=20, use_cache=False)
        b1, cache = _generated_cache(model, ids, mask, num_beams=3, num_return_sequences=2, do_sample=False)
        b0 = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2,
                            do_sample=False, use_cache=False)
    assert torch.equal(s1, s0)
    assert isinstance(cache, hf_rfa.RFACache)
    assert torch.equal(b1, b0)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_explicit_cache_and_opt_outs():
    model = _converted(_gpt2, "favor+")
    ids, mask = _batch()
    mine = hf_rfa.RFACache(model)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=mine,
                             return_dict_in_generate=True)
        _, stock = _generated_cache(model, ids, mask, do_sample=False, cache_implementation="dynamic")
    assert out.cache is mine and mine.get_seq_length() == ids.shape[1] + 3
    assert type(stock) is DynamicCache  # explicit opt-out keeps the full K/V cache
    kwargs = {}  # modes that roll the cache back (assisted decoding) keep the stock cache too
    model._prepare_cache_for_generation(GenerationConfig(), kwargs, GenerationMode.ASSISTED_GENERATION, 2, 20)
    assert type(kwargs["cache"]) is DynamicCache
    with pytest.raises(ValueError, match="rfa_config"):
        hf_rfa.RFACache(_llama())
    with pytest.raises(ValueError, match="tokens_to_remove"):
        mine.crop(-1)


def test_unconverted_model_keeps_dynamic_cache():
    model = _llama()
    ids, mask = _batch()
    with torch.no_grad():
        _, cache = _generated_cache(model, ids, mask, do_sample=False)
    assert type(cache) is DynamicCache


def test_cache_refuses_a_model_switched_back_to_softmax():
    model = _converted(_llama, "favor+")
    cache = hf_rfa.RFACache(model)
    model.set_attn_implementation("sdpa")
    ids, _ = _batch()
    with torch.no_grad(), pytest.raises(RuntimeError, match="never attended"):
        model(ids[:, :3], cache=cache, use_cache=True)
        model(ids[:, 3:4], cache=cache, use_cache=True)


def test_partially_converted_model_keeps_full_kv_in_exact_layers():
    model = _converted(_llama, "hybrid", layers=[1])
    ids, mask = _batch()
    with torch.no_grad():
        seq, cache = _generated_cache(model, ids, mask, do_sample=False)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    assert isinstance(cache.layers[0], DynamicLayer) and isinstance(cache.layers[1], RFACacheLayer)
    assert torch.equal(seq, ref)


def test_cache_bytes_independent_of_context():
    model = _converted(_llama, "hybrid")
    sizes = []
    for n in (16, 64):
        ids = torch.randint(2, V, (1, n), generator=torch.Generator().manual_seed(n))
        cache = hf_rfa.RFACache(model)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        sizes.append(cache.nbytes())
    assert sizes[0] == sizes[1] > 0


@pytest.mark.parametrize("family", CAUSAL)
def test_every_causal_family_decodes_with_state_cache(family):
    """The shared tiny models (Llama, GPT-2, Qwen2, Mistral, Gemma), 3 rows with left padding."""
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(**SETTINGS["hybrid"]))
    ids, mask = tiny_batch(family, n=12)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, return_dict_in_generate=True, **kw)
        ref = model.generate(input_ids=ids, use_cache=False, **kw)
    assert isinstance(out.cache, hf_rfa.RFACache) and torch.equal(out.sequences, ref)


def test_after_save_load(tmp_path):
    model = _converted(_llama, "gated-rfa")
    ids, mask = _batch()
    model.save_pretrained(tmp_path)
    loaded = hf_rfa.from_pretrained(str(tmp_path), LlamaForCausalLM).eval()
    with torch.no_grad():
        seq, cache = _generated_cache(loaded, ids, mask, do_sample=False)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    assert isinstance(cache, hf_rfa.RFACache) and torch.equal(seq, ref)


def test_under_peft_wrapper():
    peft = pytest.importorskip("peft")
    model = _converted(_llama, "gated-rfa")
    wrapped = peft.get_peft_model(model, lora_config(model, task_type="CAUSAL_LM")).eval()
    with torch.no_grad():  # make the adapter matter
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    ids, mask = _batch()
    with torch.no_grad():
        out = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        ref = wrapped.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=False)
    assert isinstance(out.cache, hf_rfa.RFACache)
    assert torch.equal(out.sequences, ref)
