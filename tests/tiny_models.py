"""Tiny configs of every supported family, built in code (no downloads)."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 128


def tiny_config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    if family == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **common)
    if family == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, **common)
    if family == "mistral":
        return tf.MistralConfig(num_key_value_heads=1, sliding_window=None, **common)
    if family == "gemma":
        return tf.GemmaConfig(num_key_value_heads=2, head_dim=16, **common)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=1)
    if family == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=512)
    raise ValueError(family)


CAUSAL = ["llama", "gpt2", "qwen2", "mistral", "gemma"]


def tiny_model(family: str, head: str = "lm", seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    if family == "bert":
        cls = {"lm": tf.BertModel, "base": tf.BertModel, "cls": tf.BertForSequenceClassification}[head]
        if head == "cls":
            cfg.num_labels = 2
    else:
        cls = tf.AutoModelForCausalLM if head == "lm" else tf.AutoModel
        return cls.from_config(cfg).eval()
    return cls(cfg).eval()


def batch(family: str, n: int = 24, b: int = 3, seed: int = 0):
    """Token ids and a padding mask: left padding for decoders, right padding for BERT."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    pads = [0, 5, 11][:b]
    for i, p in enumerate(pads):
        if p:
            if family == "bert":
                mask[i, n - p :] = 0
            else:
                mask[i, :p] = 0
    return ids, mask


def output_of(family: str, out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") and out.last_hidden_state is not None else out.logits
