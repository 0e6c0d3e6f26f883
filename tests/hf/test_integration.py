"""transformers integration: convert(), padding, families, dtypes, checkpoints, PEFT, compile."""

import copy

import pytest
import torch
import transformers as tf

import hf_rfa
from hf_rfa.recipes.training.callbacks import RedrawCallback
from hf_rfa.recipes.training.peft_utils import lora_config
from tiny_models import CAUSAL, VOCAB, batch, output_of, tiny_model
from tolerances import PLUMBING_LOGITS

FAMILIES = CAUSAL + ["bert"]


def run(model, ids, mask, positions=False):
    kw = {}
    if positions and mask is not None:  # as generate() does for left padding
        kw["position_ids"] = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return output_of(None, model(input_ids=ids, attention_mask=mask, **kw))


def real(x, mask):
    return x[mask.bool()]


# --- plumbing: window >= N reproduces the original -------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fm", ["favor+", "hedgehog"])
def test_window_covering_sequence_reproduces_original(family, fm):
    model = tiny_model(family)
    ids, mask = batch(family)
    ref = run(model, ids, mask)
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map=fm, num_features=16, window=ids.shape[1], sinks=2))
    assert model.config._attn_implementation == "rfa"
    out = run(model, ids, mask)
    assert (real(out, mask) - real(ref, mask)).abs().max() <= PLUMBING_LOGITS


@pytest.mark.parametrize("family", CAUSAL)
def test_window_covering_sequence_reproduces_greedy_tokens(family):
    model = tiny_model(family)
    ids, mask = batch(family, n=12)
    kw = dict(max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
    hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=16, window=64))
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_features_change_outputs_and_stay_finite(family):
    model = tiny_model(family)
    ids, mask = batch(family)
    ref = run(model, ids, mask)
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=16))
    out = run(model, ids, mask)
    assert torch.isfinite(out).all()
    assert (real(out, mask) - real(ref, mask)).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cfg", [dict(feature_map="favor+"), dict(feature_map="hedgehog", window=4, sinks=1), dict(feature_map="rfa", gate=True)])
def test_padding_gives_same_outputs_as_unpadded(family, cfg):
    if family == "bert" and cfg.get("gate"):
        pytest.skip("gate is causal-only")
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(num_features=16, **cfg))
    ids, mask = batch(family, n=20)
    # random features are not invariant to a shift of absolute (RoPE) positions: give the real
    # tokens the same positions as unpadded, as generate() does
    out = run(model, ids, mask, positions=family != "bert")
    for i in range(ids.shape[0]):
        keep = mask[i].bool()
        alone = run(model, ids[i : i + 1, keep], None)[0]
        assert (out[i][keep] - alone).abs().max() <= 1e-4, i


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_bf16_model(family):
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(num_features=16, window=4))
    ids, mask = batch(family)
    ref = run(model, ids, mask)
    model = model.to(torch.bfloat16)
    out = run(model, ids, mask)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (real(out.float(), mask) - real(ref, mask)).norm() / real(ref, mask).norm() < 0.05


def test_bert_heads_and_cross_attention_stays_exact():
    model = tiny_model("bert", head="cls")
    ids, mask = batch("bert")
    hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=16))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (3, 2) and torch.isfinite(logits).all()
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, is_decoder=True, add_cross_attention=True)
    dec = tf.BertModel(cfg).eval()
    hf_rfa.convert(dec, hf_rfa.RFAConfig(num_features=16))
    names = [n for n, m in dec.named_modules() if isinstance(m, hf_rfa.hf.attention.RFAAttention)]
    assert names and not any("crossattention" in n for n in names)
    enc = torch.randn(3, 7, 64)
    with torch.no_grad():
        out = dec(input_ids=ids, attention_mask=mask, encoder_hidden_states=enc).last_hidden_state
    assert torch.isfinite(out).all()


def test_selected_layers_only():
    model = tiny_model("llama")
    ids, mask = batch("llama")
    ref = run(model, ids, mask)
    hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=16, layers=[1]))
    assert not hasattr(model.model.layers[0].self_attn, "rfa")
    assert hasattr(model.model.layers[1].self_attn, "rfa")
    out = run(model, ids, mask)
    assert (real(out, mask) - real(ref, mask)).abs().max() > 1e-3
    # layer 0 exact: converting nothing (window covers all in layer 1) reproduces the original
    hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=16, layers=[1], window=1000))
    assert (real(run(model, ids, mask), mask) - real(ref, mask)).abs().max() <= PLUMBING_LOGITS
    with pytest.raises(ValueError, match=r"layers \[7\] not in the model"):
        hf_rfa.convert(model, hf_rfa.RFAConfig(layers=[7]))


def test_per_layer_projections_differ_and_are_seeded():
    a = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=16, seed=3))
    b = hf_rfa.convert(tiny_model("llama", seed=1), hf_rfa.RFAConfig(num_features=16, seed=3))
    fa, fb = list(hf_rfa.model_feature_maps(a)), list(hf_rfa.model_feature_maps(b))
    assert torch.equal(fa[0].omega, fb[0].omega) and torch.equal(fa[1].omega, fb[1].omega)
    assert not torch.equal(fa[0].omega, fa[1].omega)


def test_model_without_attention_interface_is_rejected():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tf.PretrainedConfig()
            self.attn = torch.nn.MultiheadAttention(8, 2)

    with pytest.raises(ValueError, match="Plain: no self-attention module goes through"):
        hf_rfa.convert(Plain())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(feature_map="nope"), "feature_map must be one of"),
        (dict(num_features=0), r"num_features must be an int in \[1, 65536\]"),
        (dict(window=-1), r"window must be an int in \[0, "),
        (dict(sinks=1.5), r"sinks must be an int in \[0, 4096\]"),
        (dict(gate=True), "gate=True needs feature_map='rfa'"),
        (dict(layers=[-1]), "layers must be None or a list"),
        (dict(feature_map_options={"seed": 1}), "feature_map_options may not set"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_rfa.RFAConfig(**kwargs)


def test_config_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown RFAConfig fields"):
        hf_rfa.RFAConfig.from_dict({"num_feature": 3})


# --- checkpoints --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "qwen2"])
@pytest.mark.parametrize("fm", ["favor+", "hedgehog", "rfa"])
def test_save_and_load_round_trip(tmp_path, family, fm):
    cfg = hf_rfa.RFAConfig(feature_map=fm, num_features=16, window=3, sinks=1, gate=(fm == "rfa" and family != "bert"))
    model = hf_rfa.convert(tiny_model(family), cfg)
    hf_rfa.redraw(model, 4)
    with torch.no_grad():  # move learned parameters away from their init
        for p in model.parameters():
            if ".rfa." in "".join(n for n, q in model.named_parameters() if q is p):
                p.add_(0.01 * torch.randn_like(p))
    ids, mask = batch(family)
    ref = run(model, ids, mask)
    model.save_pretrained(tmp_path)
    loaded = hf_rfa.from_pretrained(str(tmp_path))
    assert type(loaded) is type(model)
    assert hf_rfa.rfa_config_of(loaded) == cfg
    assert torch.equal(run(loaded, ids, mask), ref)
    fm0 = next(hf_rfa.model_feature_maps(loaded))
    assert int(fm0.step) == 4


def test_learnable_projections_round_trip(tmp_path):
    """Trained favor+ projections (learnable=True) are saved and restored exactly."""
    cfg = hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=3, sinks=1, feature_map_options={"learnable": True})
    model = hf_rfa.convert(tiny_model("llama"), cfg)
    with torch.no_grad():
        for fm in hf_rfa.model_feature_maps(model):
            fm.omega.add_(0.05 * torch.randn_like(fm.omega))
    ids, mask = batch("llama")
    ref = run(model, ids, mask)
    model.save_pretrained(tmp_path)
    loaded = hf_rfa.from_pretrained(str(tmp_path))
    assert all(isinstance(fm.omega, torch.nn.Parameter) for fm in hf_rfa.model_feature_maps(loaded))
    assert torch.equal(run(loaded, ids, mask), ref)


def test_from_pretrained_rejects_plain_checkpoint(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a converted hf_rfa checkpoint"):
        hf_rfa.from_pretrained(str(tmp_path))


# --- training plumbing ------------------------------------------------------------------------------
@pytest.mark.parametrize("family,fm", [("llama", "hedgehog"), ("gpt2", "favor+"), ("bert", "t2r")])
def test_peft_lora_trains_feature_maps_and_round_trips(tmp_path, family, fm):
    import peft

    model = hf_rfa.convert(tiny_model(family, head="cls" if family == "bert" else "lm"), hf_rfa.RFAConfig(feature_map=fm, num_features=16, window=2))
    base = copy.deepcopy(model)
    lcfg = lora_config(model, r=4, task_type="SEQ_CLS" if family == "bert" else "CAUSAL_LM")
    pm = peft.get_peft_model(model, lcfg)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable)
    if fm != "favor+":
        assert any(".rfa." in n for n in trainable)
    ids, mask = batch(family)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
    pm.train()
    out = pm(input_ids=ids, attention_mask=mask)
    loss = out.logits.float().pow(2).mean()
    loss.backward()
    opt.step()
    pm.eval()
    hf_rfa.redraw(pm, 2)  # reaches the modules_to_save copies too
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask).logits
    pm.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        out2 = reloaded(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(out2, ref)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_checkpointing_gives_same_gradients(family):
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16, window=3, sinks=1))
    ids, mask = batch(family)
    grads = []
    for gc in (False, True):
        m = copy.deepcopy(model).train()
        if gc:
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)  # same dropout draws (checkpointing preserves the RNG state on recompute)
        m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_torch_compile_fullgraph(family):
    model = hf_rfa.convert(tiny_model(family), hf_rfa.RFAConfig(num_features=16, window=3, sinks=1))
    ids, mask = batch(family, n=16)
    ref = run(model, ids, mask)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out = output_of(None, compiled(input_ids=ids, attention_mask=mask))
    assert (real(out, mask) - real(ref, mask)).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    # the main job's recipe in small: learned map, decay, un-rotated feature inputs, hybrid mix
    dict(feature_map="hedgehog", num_features=8, window=4, sinks=1, decay=16.0, feature_input="unrotated", feature_map_options={"hybrid_mix": True}, chunk_size=8),
    dict(feature_map="favor+", num_features=16, window=5, sinks=2, chunk_size=8),
], ids=["hedgehog-decay-unrotated", "favor+"])
def test_compile_layers_training_step_matches_eager(cfg):
    """``hf_rfa.compile_layers`` (each decoder layer ``layer.compile(fullgraph=True)``, what
    ``benchmarks/train_step.py --dtypes fp32-compile`` measures) traces the recomputing hybrid
    Function whole — no graph break, one graph for all layers — and trains exactly as eager: loss
    and every gradient, over two compiled steps."""
    import torch._dynamo

    torch.manual_seed(0)
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(seed=0, **cfg))
    model.train()
    ids, _ = batch("llama", n=40)

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss0, g0 = grads()
    assert any("feature_map" in n for n in g0) == (cfg["feature_map"] == "hedgehog")
    torch._dynamo.reset()
    assert hf_rfa.compile_layers(model) is model
    from torch._dynamo.utils import counters

    counters.clear()
    loss1, g1 = grads()
    loss2, g2 = grads()  # a second compiled step (cached graphs) too
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.allclose(loss0, loss1, atol=1e-5) and torch.allclose(loss1, loss2, atol=1e-6)
    assert g0.keys() == g1.keys() == g2.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4), (n, (g0[n] - g1[n]).abs().max())
        assert torch.allclose(g1[n], g2[n], atol=1e-6), n


def test_compile_layers_needs_a_converted_model():
    with pytest.raises(ValueError, match="no decoder layer with a converted attention module"):
        hf_rfa.compile_layers(tiny_model("llama"))
    with pytest.raises(ValueError, match="fullgraph must be True or False"):
        hf_rfa.compile_layers(hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8)), fullgraph="yes")


def test_redraw_callback_with_trainer(tmp_path):
    from datasets import Dataset

    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=16, redraw_interval=2, seed=5))
    ids, _ = batch("llama", n=16, b=3)
    ds = Dataset.from_dict({"input_ids": ids.repeat(4, 1).tolist(), "labels": ids.repeat(4, 1).tolist()})
    args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=5, report_to=[], save_strategy="no", logging_steps=100, use_cpu=True)
    cb = RedrawCallback()
    trainer = tf.Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()
    assert cb.redraws == 2  # after optimizer steps 2 and 4
    fms = list(hf_rfa.model_feature_maps(model))
    assert all(int(f.step) == 2 for f in fms)
    fresh = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=16, seed=5))
    hf_rfa.redraw(fresh, 2)
    for a, b in zip(fms, hf_rfa.model_feature_maps(fresh)):
        assert torch.equal(a.omega, b.omega)


@pytest.mark.parametrize("config,hint", [("recall", r"hf_rfa\.RFAConfig\.from_preset\('recall'\)"), ({"window": 4}, r"hf_rfa\.RFAConfig\(\.\.\.\)")])
def test_convert_names_a_config_that_is_not_an_rfa_config(config, hint):
    """``hf_rfa.convert(model, "recall")`` (a preset name, as linearize takes) says what to pass;
    it raised ``AttributeError: 'str' object has no attribute 'layers'``."""
    model = tiny_model("llama")
    with pytest.raises(TypeError, match=f"config must be an RFAConfig, got {type(config).__name__} .*: pass {hint}$"):
        hf_rfa.convert(model, config)
    assert not hf_rfa.hf.cache.uses_rfa(model)
