"""The family matrix: for every family transformers can build, a conversion with
``window >= N`` either reproduces the original model's logits or is refused at ``convert`` with
the reason — never a silently different attention. Cross-attention (T5, BART) stays exact."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from tolerances import PLUMBING_LOGITS

import hf_rfa
from hf_rfa.hf.convert import find_attention_modules

V, N = 64, 16
_C = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

#: family -> (builder, None if it must be reproduced, else a fragment of the refusal reason)
FAMILIES = {
    "llama": (lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_C)), None),
    "gpt2": (lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)), None),
    "bert": (lambda: tf.BertModel(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)), None),
    "qwen2": (lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**_C)), None),
    "qwen2-sliding": (lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(sliding_window=4, use_sliding_window=True, max_window_layers=0, **_C)), "sliding-window"),
    "mistral": (lambda: tf.MistralForCausalLM(tf.MistralConfig(**{**_C}, sliding_window=None)), None),
    "mistral-sliding": (lambda: tf.MistralForCausalLM(tf.MistralConfig(sliding_window=4, **_C)), "sliding-window"),
    "gemma": (lambda: tf.GemmaForCausalLM(tf.GemmaConfig(head_dim=8, **_C)), None),
    "gemma2": (lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(sliding_window=4, head_dim=8, **_C)), "sliding-window"),
    "gemma2-no-window": (lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(sliding_window=4, head_dim=8, layer_types=["full_attention"] * 2, **_C)), "soft-capping"),
    "gemma3": (lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(sliding_window=4, head_dim=8, **_C)), "sliding-window"),
    "gpt-oss": (lambda: tf.GptOssForCausalLM(tf.GptOssConfig(sliding_window=4, head_dim=8, num_local_experts=2, num_experts_per_tok=1, **_C)), "sliding-window"),
    "gpt-oss-no-window": (lambda: tf.GptOssForCausalLM(tf.GptOssConfig(head_dim=8, num_local_experts=2, num_experts_per_tok=1, layer_types=["full_attention"] * 2, **_C)), "learned attention sinks"),
    "phi3": (lambda: tf.Phi3ForCausalLM(tf.Phi3Config(pad_token_id=0, **_C)), None),
    "gpt-neox": (lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)), None),
    "bart": (lambda: tf.BartForConditionalGeneration(tf.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)), None),
    "llama4-chunked": (lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(head_dim=8, num_local_experts=1, intermediate_size_mlp=64, attention_chunk_size=4, **_C)), "chunked"),
    "doge": (lambda: tf.DogeForCausalLM(tf.DogeConfig(**_C)), "dynamic mask"),
    "t5": (lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)), "relative position bias"),
}


def _logits(model, ids):
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=ids, decoder_input_ids=ids).logits
        out = model(input_ids=ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_at_least_n_is_exact_or_refused(family):
    build, expect = FAMILIES[family]
    torch.manual_seed(0)
    model = build().eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(1, V, (2, N), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    cfg = hf_rfa.RFAConfig(num_features=8, window=10**6)
    if expect is not None:
        with pytest.raises(ValueError, match=expect):
            hf_rfa.convert(model, cfg)
        assert not any(hasattr(m, "rfa") for _, m, _ in find_attention_modules(model))  # nothing half-converted
        return
    hf_rfa.convert(model, cfg)
    got = _logits(model, ids)
    assert (got - ref).abs().max().item() <= PLUMBING_LOGITS


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_cross_attention_is_never_converted(family):
    model = FAMILIES[family][0]()
    names = [name for name, _, _ in find_attention_modules(model)]
    assert names and not any("EncDecAttention" in n or "encoder_attn" in n for n in names)


def test_a_refused_layer_refuses_the_model_even_when_not_selected():
    """Unconverted layers run hf_rfa's plain softmax too, so a Qwen2 whose layer 1 slides is
    refused even with layers=[0]."""
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(sliding_window=4, use_sliding_window=True, max_window_layers=1, **_C)).eval()
    assert [m.sliding_window for _, m, _ in find_attention_modules(model)] == [None, 4]
    with pytest.raises(ValueError, match=r"layer 1 .*sliding-window"):
        hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=8, window=10**6, layers=[0]))
