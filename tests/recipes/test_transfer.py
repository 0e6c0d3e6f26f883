"""Attention transfer and capture (hf_rfa.recipes.conversion.calibration, hf_rfa.recipes.conversion.transfer) on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

import hf_rfa
import hf_rfa.hf.attention as hf_attention
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import calibration, transfer
from hf_rfa.ops import quadratic_kernel_attention, softmax_attention
from tiny_models import VOCAB, tiny_model
from conftest import rel
from tolerances import GRAD_FP32, ORACLE_FP32

HYBRID = dict(feature_map="hedgehog", num_features=16, window=4, sinks=1, feature_map_options={"hybrid_mix": True})


def _ids(n=64 * 12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (24,), generator=g)
    return base.repeat(n // 24 + 1)[:n] + torch.randint(0, 2, (n,), generator=g)  # structured, not uniform


def _batches(ids, n=2):
    return [(w.unsqueeze(0), None) for w in evaluation.token_windows(ids, 64, n)]


@pytest.mark.parametrize("fam", ["llama", "gpt2", "bert"])
def test_capture_is_softmax_and_restores_implementation(fam):
    m = tiny_model(fam)
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    ids, mask = torch.randint(2, VOCAB, (2, 20)), torch.ones(2, 20, dtype=torch.long)
    mask[1, :5 if fam != "bert" else 15] = 0 if fam != "bert" else 1
    if fam == "bert":
        mask[1, 15:] = 0
    caps = calibration.capture(m, ids, mask)
    assert m.config._attn_implementation == "rfa"
    assert sorted(caps) == [0, 1]
    c = caps[0]
    ref = softmax_attention(c.q, c.k, c.v, causal=c.causal, attention_mask=c.mask, scale=c.scale)
    real = c.mask[:, None, :, None]
    assert torch.allclose(c.out * real, ref * real, atol=1e-5)
    assert c.causal == (fam != "bert")


@pytest.mark.parametrize("checkpoint", [None, False], ids=["layer-setting", "no-recompute"])
@pytest.mark.parametrize("queries", [None, 9], ids=["all-queries", "last-9"])
def test_production_path_equals_twin_values_and_grads(checkpoint, queries):
    """``rfa_output`` (what transfer, LoRA and layer errors run: the op's autograd form) = the
    quadratic twin on captured inputs of a hybrid GQA layer with padding: outputs on real rows and
    the gradients of q, k, v and of the map's parameters (W, mix) under a random upstream gradient;
    also on the last queries only (transfer's ``queries``) and without autograd (layer errors)."""
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    gen = torch.Generator().manual_seed(3)
    ids, mask = torch.randint(2, VOCAB, (2, 40), generator=gen), torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    cap = calibration.capture(m, ids, mask)[1]
    rfa = calibration.rfa_layers(m)[1]
    fm = rfa.feature_map
    params = [p for p in fm.parameters()]
    assert params and rfa.checkpoint_blocks  # a trained map; the layer's default recomputes blocks
    q = cap.q if queries is None else cap.q[:, :, -queries:]
    real = cap.mask[:, None, -q.shape[2]:, None].to(q.dtype)  # [B,1,Nq,1]
    up = torch.randn(q.shape[:-1] + (cap.v.shape[-1],), generator=gen) * real

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (q, cap.k, cap.v)]
        for p in params:
            p.grad = None
        out = fn(calibration.Captured(*leaves, None, cap.mask, cap.causal, cap.scale))
        out.backward(up)
        return out.detach() * real, [x.grad for x in leaves] + [p.grad.clone() for p in params]

    op, op_grads = run(lambda c: calibration.rfa_output(rfa, c, checkpoint_blocks=checkpoint))
    twin, twin_grads = run(lambda c: quadratic_kernel_attention(
        c.q, c.k, c.v, fm, causal=c.causal, attention_mask=c.mask, window=rfa.window, sinks=rfa.sinks, scale=c.scale))
    assert rel(op, twin) <= ORACLE_FP32
    for a, b in zip(op_grads, twin_grads):
        assert float(b.norm()) > 0 and rel(a, b) <= GRAD_FP32
    with torch.no_grad():
        infer = calibration.rfa_output(rfa, calibration.Captured(q, cap.k, cap.v, None, cap.mask, cap.causal, cap.scale))
    assert rel(infer * real, twin) <= ORACLE_FP32


def test_recipes_run_the_op_and_transfer_follows_its_twin_rule(monkeypatch):
    """LoRA and layer errors run the op (``random_feature_attention``), never the quadratic twin;
    attention transfer runs the twin up to ``twin_max_keys`` keys and the op (without block
    recomputation) above — the one visible rule (``transfer.TWIN_MAX_KEYS``)."""
    calls, twins = [], []
    real_op, real_twin = calibration.random_feature_attention, transfer.quadratic_kernel_attention
    monkeypatch.setattr(calibration, "random_feature_attention", lambda *a, **k: calls.append(k["checkpoint_blocks"]) or real_op(*a, **k))
    # LoRA trains through the "rfa" attention itself (RFAAttention.forward), what a user's Trainer runs
    real_attend = hf_attention.attend  # the op on the layer's AttentionSpec (5th argument)
    monkeypatch.setattr(hf_attention, "attend", lambda *a, **k: calls.append(a[4].checkpoint_blocks) or real_attend(*a, **k))
    monkeypatch.setattr(transfer, "quadratic_kernel_attention", lambda *a, **k: twins.append(1) or real_twin(*a, **k))
    assert 64 <= transfer.TWIN_MAX_KEYS < 1024  # tiny contexts: the twin; the pipeline's 1024: the op
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=0), tokens=64, progress=False, twin_max_keys=63)
    assert calls == [False, False] and not twins  # 64 keys > 63: the op, one layer's graph at a time
    calls.clear()
    transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=0), tokens=64, progress=False, twin_max_keys=64)
    assert not calls and len(twins) == 2
    twins.clear()
    calibration.layer_errors(m, _batches(_ids(seed=1), 1), progress=False)
    assert len(calls) == 2 and not twins
    calls.clear()
    transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, progress=False)
    assert calls and set(calls) == {True} and not twins  # LoRA: the layer's checkpoint_blocks


def test_hybrid_mix_default_off_and_pure_linear_unchanged():
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    plain = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=4, num_heads=4, num_kv_heads=2)
    mixed = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=4, num_heads=4, num_kv_heads=2, hybrid_mix=True, mix_init=2.0)
    assert not hasattr(plain, "mix") and plain.forward_queries(q).log_scale is None
    torch.testing.assert_close(hf_rfa.random_feature_attention(q, k, v, plain), hf_rfa.random_feature_attention(q, k, v, mixed))
    hp = hf_rfa.random_feature_attention(q, k, v, plain, window=3, sinks=1)
    hm = hf_rfa.random_feature_attention(q, k, v, mixed, window=3, sinks=1)
    assert not torch.allclose(hp, hm)  # the mix weighs features against the exact part
    torch.testing.assert_close(hm, quadratic_kernel_attention(q, k, v, mixed, window=3, sinks=1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hybrid_mix"):
        hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=4, hybrid_mix="yes")


def test_init_mixing_reduces_error():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    b = _batches(_ids())
    before = calibration.layer_errors(m, b, progress=False)
    assert transfer.init_mixing(m, calibration.capture(m, *b[0])) == 2
    after = calibration.layer_errors(m, b, progress=False)
    assert all(a.relative_error < 0.8 * x.relative_error for a, x in zip(after, before))


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_transfer_reduces_per_layer_mse_and_trains_only_feature_maps(fam):
    m = tiny_model(fam)
    with torch.no_grad():  # peaked attention, as in real models (random tiny ones are near-uniform)
        for n, p in m.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj", "c_attn")):
                p.mul_(4)
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16))  # pure linear: W alone
    ids = _ids()
    held = _batches(_ids(seed=1))
    base = {k: v.clone() for k, v in m.state_dict().items() if ".rfa." not in k}
    before = calibration.layer_errors(m, held, progress=False)
    res = transfer.attention_transfer(m, evaluation.shuffled_batches(ids, 64, 2, seed=0), tokens=64 * 2 * 40, lr=3e-2, progress=False)
    after = calibration.layer_errors(m, held, progress=False)
    assert res.steps == 40 and res.tokens == 64 * 2 * 40
    assert all(a.relative_error < 0.85 * x.relative_error for a, x in zip(after, before))
    for k, v in m.state_dict().items():
        if k in base:
            assert torch.equal(v, base[k]), k


def test_transfer_is_deterministic():
    outs = []
    for _ in range(2):
        m = tiny_model("llama")
        hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
        r = transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64 * 5, progress=False)
        outs.append((r.losses, [p.detach().clone() for p in transfer.rfa_parameters(m)]))
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))


def test_transfer_needs_trainable_map():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="favor+", num_features=16))
    with pytest.raises(ValueError, match="no trainable parameters"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, progress=False)


def test_lora_finetune_returns_merged_converted_model():
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    w0 = m.model.layers[0].self_attn.q_proj.weight.clone()
    merged, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2 * 3, lr=1e-2, progress=False)
    assert res.steps == 3 and type(merged).__name__ == "LlamaForCausalLM"
    assert merged.config._attn_implementation == "rfa" and hasattr(merged.model.layers[0].self_attn, "rfa")
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, w0)


def test_lora_finetune_on_an_unconverted_model_keeps_its_attention():
    """The reference row (the original with the same LoRA budget) trains with the model's own
    attention: no rfa layer is needed, the attention implementation is left as it was."""
    m = tiny_model("llama")
    impl = m.config._attn_implementation
    w0 = m.model.layers[0].self_attn.q_proj.weight.clone()
    merged, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2 * 2, lr=1e-2, progress=False)
    assert res.steps == 2 and res.losses[-1] < res.losses[0] + 1.0
    assert merged.config._attn_implementation == impl and not hasattr(merged.model.layers[0].self_attn, "rfa")
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, w0)


def test_transfer_on_last_queries_only():
    m = tiny_model("llama")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if any(s in n for s in ("q_proj", "k_proj")):
                p.mul_(4)
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16))
    held = _batches(_ids(seed=1))
    before = calibration.layer_errors(m, held, progress=False)
    transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 2, seed=0), tokens=64 * 2 * 40, lr=3e-2, queries=16, progress=False)
    after = calibration.layer_errors(m, held, progress=False)
    assert all(a.relative_error < 0.9 * x.relative_error for a, x in zip(after, before))


def test_wall_clock_limit_fails_loudly_instead_of_shortening_the_budget():
    """Budgets are tokens: a stage that hits its safety limit first raises (figures never depend on
    machine speed); with a generous limit the full budget is trained."""
    m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, seed=0))
    with pytest.raises(transfer.BudgetNotReached, match="64 of 6400 tokens"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=6400, max_seconds=0.0, progress=False)
    res = transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=128, max_seconds=3600.0, progress=False)
    assert res.tokens == 128
    m2 = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="none", window=8, sinks=1))
    with pytest.raises(transfer.BudgetNotReached, match="lora"):
        transfer.lora_finetune(m2, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=6400, max_seconds=0.0, progress=False)


# --------------------------------------------------------------------------- schedule and query blocks
def test_queries_ending_at_is_the_shorter_sequences_capture():
    """A block of queries cut from a capture = the last queries of the capture of the sequence cut
    at the block's end (causal: positions before ``end`` do not see what follows)."""
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID, feature_input="unrotated"))
    ids = torch.randint(2, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    full = calibration.capture(m, ids)[1]
    short = calibration.capture(m, ids[:, :28])[1].last_queries(12)
    cut = full.queries_ending_at(28, 12)
    for name in ("q", "k", "v", "out", "fq", "fk"):
        assert torch.allclose(getattr(cut, name), getattr(short, name), atol=1e-5), name
    assert cut.q.shape[2] == 12 and cut.k.shape[2] == 28
    with pytest.raises(ValueError, match="n <= end"):
        full.queries_ending_at(41, 12)


def _record_lrs(monkeypatch):
    lrs = []

    class Adam(torch.optim.Adam):
        def step(self, closure=None):
            lrs.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(transfer.torch.optim, "Adam", Adam)
    return lrs


def test_query_blocks_share_one_capture_and_count_tokens_once(monkeypatch):
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    calls = []
    real = transfer.capture
    monkeypatch.setattr(transfer, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    fitted = []
    real_out = transfer.transfer_output
    monkeypatch.setattr(transfer, "transfer_output", lambda rfa, cap, t: fitted.append((cap.q.shape[2], cap.k.shape[2])) or real_out(rfa, cap, t))
    r = transfer.attention_transfer(
        m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64 * 3, queries=16, query_blocks=3, init_mix=False, progress=False
    )
    assert len(calls) == 3 and r.tokens == 64 * 3 and r.steps == 9 and len(r.losses) == 9
    n_layers = len(calibration.rfa_layers(m))
    assert fitted[: 3 * n_layers : n_layers] == [(16, 64), (16, 48), (16, 32)]
    with pytest.raises(ValueError, match="exceeds the sequence length"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, queries=16, query_blocks=5, progress=False)
    with pytest.raises(ValueError, match="needs queries"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, query_blocks=2, progress=False)
    with pytest.raises(ValueError, match="query_blocks must be an int >= 1"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, queries=16, query_blocks=0, progress=False)


def test_query_blocks_one_equals_last_queries():
    outs = []
    for blocks in (None, 1):
        m = tiny_model("llama")
        hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
        kw = {} if blocks is None else {"query_blocks": blocks}
        r = transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64 * 3, queries=16, progress=False, **kw)
        outs.append(r.losses)
    assert outs[0] == outs[1]


def test_cosine_schedule_decays_the_learning_rate_over_the_token_budget(monkeypatch):
    assert transfer.SCHEDULES["cosine"](0.0) == 1.0 and transfer.SCHEDULES["cosine"](0.5) == pytest.approx(0.5)
    assert transfer.SCHEDULES["cosine"](1.0) == pytest.approx(0.0) and transfer.SCHEDULES["constant"](0.7) == 1.0
    lrs = _record_lrs(monkeypatch)
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    transfer.attention_transfer(
        m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64 * 4, lr=0.02, queries=16, query_blocks=2, schedule="cosine", progress=False
    )
    # progress before each step: 0, 1/8, 2/8, ... 7/8 of the budget
    assert lrs == pytest.approx([0.02 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in range(8)])
    lrs.clear()
    transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64 * 2, lr=0.02, progress=False)
    assert lrs == [0.02, 0.02]
    with pytest.raises(ValueError, match=r"schedule must be one of \['constant', 'cosine'\]"):
        transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=64, schedule="linear", progress=False)


def test_conversion_config_checks_schedule_and_blocks():
    from hf_rfa.recipes.conversion.config import ConversionConfig

    base = dict(model="x", output="o", calibration_text="c", eval_text="e", context=1024, transfer_queries=256)
    ConversionConfig(**base, transfer_schedule="cosine", transfer_query_blocks=4)
    with pytest.raises(ValueError, match="transfer_schedule must be one of"):
        ConversionConfig(**base, transfer_schedule="step")
    with pytest.raises(ValueError, match="transfer_query_blocks"):
        ConversionConfig(**base, transfer_query_blocks=5)
    with pytest.raises(ValueError, match="transfer_query_blocks must be an int >= 1"):
        ConversionConfig(**base, transfer_query_blocks=0)


def test_lora_finetune_keeps_nothing_of_a_step_alive_into_the_next():
    """Each step's hidden states and logits (and the loss with its spent graph) are released
    before the next step's forward runs, so they do not add to the peak memory of a long-context
    run (the loss runs the head chunk by chunk: lm_loss)."""
    import gc
    import weakref

    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID))
    refs, alive, heads = [], [], []

    def pre(mod, args, kwargs):
        gc.collect()
        alive.append(sum(r() is not None for r in refs))

    def post(mod, args, kwargs, out):
        refs.append(weakref.ref(out.last_hidden_state))

    def head(mod, args, out):
        heads.append(out.shape[1])
        refs.append(weakref.ref(out))

    m.model.register_forward_pre_hook(pre, with_kwargs=True)
    m.model.register_forward_hook(post, with_kwargs=True)
    m.lm_head.register_forward_hook(head)
    _, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2 * 3, lr=1e-2, progress=False)
    assert res.steps == 3 and all(isinstance(x, float) for x in res.losses)
    assert alive == [0, 0, 0]  # no earlier step's hidden states or logits alive when a forward starts
    assert heads and max(heads) == 63  # the head saw the 63 predicting positions (one chunk here), twice per step with the recompute


def test_lora_trains_a_layer_set_to_an_inference_only_backend():
    """A layer converted with ``backend="inference"`` (no autograd form) refuses a training call
    from a user (ValueError naming the backend); the recipes' LoRA trains it with ``"auto"``, with
    the same loss as a layer set to ``"torch"``."""
    losses = []
    for backend in ("inference", "torch"):
        m = tiny_model("llama")
        hf_rfa.convert(m, hf_rfa.RFAConfig(**HYBRID, backend=backend))
        if backend == "inference":
            m.train()
            with pytest.raises(ValueError, match="backend='inference'"):
                m(input_ids=_ids()[None, :32], labels=_ids()[None, :32])
        _, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 32, 1, 0), tokens=64, progress=False)
        losses.append(res.losses)
    assert len(losses[0]) == 2
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_lora_under_autocast_keeps_q_k_in_the_autocast_dtype(monkeypatch):
    """The LoRA stage's attention is the user's ``"rfa"`` path: under bf16 autocast the op gets
    q/k/v in bf16 and the rotary embedding to undo block by block — what its backward keeps is
    bf16 q/k/v (the recipes' own attention once handed it float32 q/k plus float32 un-rotated copies
    of both, all kept for backward)."""
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1, decay=16.0, feature_input="unrotated", seed=0))
    seen = []
    real_op = hf_attention.attend

    def spy(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, kw.get("feature_q") is None, kw.get("feature_rope") is not None))
        return real_op(q, k, v, *a, **kw)

    monkeypatch.setattr(hf_attention, "attend", spy)
    transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 32, 1, 0), tokens=32, progress=False, autocast=torch.bfloat16)
    assert len(seen) == m.config.num_hidden_layers
    assert set(seen) == {(torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True)}


def test_a_lora_merged_into_the_model_is_put_back_bit_for_bit():
    """The window-only baseline's LoRA trains and merges into the model itself; restore_weights
    gives back the exact weights and requires_grad flags the recipe then trains from."""
    from hf_rfa.recipes.conversion.lora import restore_weights, target_weights

    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="none", window=4, sinks=1))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    flags = {n: p.requires_grad for n, p in m.named_parameters()}
    saved = target_weights(m)
    assert saved.values and all(".q_proj." in k or ".k_proj." in k or ".v_proj." in k or ".o_proj." in k for k in saved.values)
    merged, _ = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 1, 0), tokens=128, lr=1e-2, progress=False)
    assert merged is m
    changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and set(changed) <= set(saved.values)  # the merge changed the targets, nothing else
    restore_weights(m, saved)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert {n: p.requires_grad for n, p in m.named_parameters()} == flags
    with pytest.raises(ValueError, match="cannot restore"):
        restore_weights(torch.nn.Linear(2, 2), saved)


def test_lora_distillation_starts_at_zero_on_the_original_and_recovers_a_conversion():
    """objective="distill": the teacher is the model itself with its adapters off under exact
    softmax. On an unconverted model the student is its teacher (the first loss is 0); on a
    converted one the loss is the KL from the original's predictions, which LoRA lowers, and the
    merged model is closer to the original than before. An unknown objective is refused."""
    m = tiny_model("llama")
    _, res = transfer.lora_finetune(m, evaluation.shuffled_batches(_ids(), 64, 2, 0), tokens=64 * 2, lr=1e-2, progress=False, objective="distill")
    assert abs(res.losses[0]) < 1e-6 and res.as_dict()["objective"] == "distill"

    original = tiny_model("llama").eval()
    m = tiny_model("llama")
    m.load_state_dict(original.state_dict())
    hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    ids = _ids()[:128].unsqueeze(0)

    def kl_to_original(model):
        with torch.no_grad():
            s = torch.log_softmax(model.eval()(input_ids=ids).logits.float(), -1)
            t = torch.log_softmax(original(input_ids=ids).logits.float(), -1)
        return float((t.exp() * (t - s)).sum(-1).mean())

    before = kl_to_original(m)
    merged, res = transfer.lora_finetune(m, iter([(ids, None)] * 8), tokens=128 * 8, lr=3e-3, progress=False, objective="distill")
    assert res.steps == 8 and res.losses[0] > 1e-4 and res.losses[-1] < 0.8 * res.losses[0], res.losses
    assert merged.config._attn_implementation == "rfa"
    assert kl_to_original(merged) < before
    with pytest.raises(ValueError, match=r"objective must be one of \['next_token', 'distill'\], got 'kl'"):
        transfer.lora_finetune(tiny_model("llama"), iter([]), tokens=1, objective="kl")


@pytest.mark.parametrize("window, fits", [(14, True), (15, False), (20, False)])
def test_query_blocks_whose_earliest_sees_no_key_beyond_the_window_are_refused(window, fits):
    """64 tokens, 4 blocks of 16 queries: the earliest block's last query (position 15) sees a key
    beyond window W + 1 sink only while 15 >= W + 1; at the edge it still fits (a gradient flows),
    past it the run is refused up front with what would fit, not by autograd mid-run."""
    m = tiny_model("llama")
    hf_rfa.convert(m, hf_rfa.RFAConfig(**{**HYBRID, "window": window}))
    run = lambda: transfer.attention_transfer(m, evaluation.shuffled_batches(_ids(), 64, 1, seed=3), tokens=64, queries=16, query_blocks=4, init_mix=False, progress=False)
    if fits:
        r = run()
        assert r.steps == 4 and all(math.isfinite(x) for x in r.losses)
    else:
        most = (64 - 1 - window - 1) // 16 + 1
        with pytest.raises(ValueError, match=rf"earliest block \(queries 0–15\) has no key beyond window {window} \+ 1 sinks.*at most {most} blocks or a context of at least {48 + window + 2}"):
            run()


def test_conversion_config_refuses_query_blocks_inside_the_window():
    from hf_rfa.recipes.conversion.config import ConversionConfig
    from hf_rfa.presets import get_preset

    base = dict(model="x", output="o", calibration_text="c", eval_text="e", context=1024, transfer_queries=256)
    rfa = get_preset("recall").config(window=256, sinks=4)
    ConversionConfig(**base, rfa=rfa, transfer_query_blocks=3)
    with pytest.raises(ValueError, match=r"transfer_query_blocks=4 × transfer_queries=256 at context 1024: .*window 256 \+ 4 sinks.*at most 3 blocks or a context of at least 1029"):
        ConversionConfig(**base, rfa=rfa, transfer_query_blocks=4)
    # a context inside the window and sinks: no block count fits, only a longer context
    with pytest.raises(ValueError, match=r"at context 32: .*window 256 \+ 4 sinks, so nothing to fit; use a context of at least 285$"):
        ConversionConfig(**{**base, "context": 32, "transfer_queries": 8}, rfa=rfa, transfer_query_blocks=4)
