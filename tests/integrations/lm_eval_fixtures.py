"""A tiny converted Llama, a character-level tokenizer and its saved / exported folders (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as tf

from tiny_models import tiny_config

RFA_KWARGS = dict(feature_map="favor+", num_features=16, window=4, sinks=2)
TASK = "rfa_wiki_next_sentence"


def char_tokenizer():
    """One token per printable ASCII character (and newline): 99 ids, within the tiny vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    t.decoder = decoders.Fuse()
    return tf.PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]", model_max_length=1024)


def tiny_converted_llama():
    import hf_rfa

    cfg = tiny_config("llama")
    cfg.max_position_embeddings = 1024
    cfg.pad_token_id, cfg.eos_token_id = 0, 2
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return hf_rfa.convert(model, hf_rfa.RFAConfig(**RFA_KWARGS))


def build(root: Path) -> dict[str, Path]:
    """``saved`` (save_pretrained), ``exported`` (hf_rfa.export), ``tasks`` (the offline task folder)."""
    import hf_rfa
    from hf_rfa.integrations.lm_eval_tasks import prepare_tasks

    model, tok = tiny_converted_llama(), char_tokenizer()
    saved, exported = root / "saved", root / "exported"
    model.save_pretrained(saved)
    tok.save_pretrained(saved)
    hf_rfa.export(model, exported, tokenizer=tok)
    tasks = prepare_tasks(root / "tasks", [TASK])
    return {"saved": saved, "exported": exported, "tasks": tasks}


def task_docs(tasks: Path, limit: int) -> list[dict]:
    with open(tasks / "wiki_next_sentence" / "test.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f][:limit]
