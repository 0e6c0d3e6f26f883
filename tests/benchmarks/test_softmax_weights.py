"""benchmarks/softmax_weights.py: a converted checkpoint's weights in its original architecture run
exact softmax with those weights (the LoRA-merged projections kept, the rfa tensors left out)."""

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers as tf

import hf_rfa
from tiny_models import VOCAB, tiny_model

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("softmax_weights_bench", ROOT / "benchmarks" / "softmax_weights.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(path)


def test_the_weights_run_softmax_in_the_original_architecture(tmp_path):
    original = tiny_model("llama")
    converted = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    with torch.no_grad():  # a trained projection (as a merged LoRA leaves it), in both
        for m in (original, converted):
            m.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
    converted.save_pretrained(tmp_path / "converted")
    _tokenizer(tmp_path / "converted")
    got = bench.softmax_weights(str(tmp_path / "converted"), str(tmp_path / "softmax"))
    assert got["left_out"] > 0 and got["copied"] == len(original.state_dict())
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "softmax")
    assert type(plain) is type(original) and hf_rfa.rfa_config_of(plain) is None
    ids = torch.randint(2, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, original.eval()(ids).logits)
        assert not torch.allclose(converted.eval()(ids).logits, original(ids).logits, atol=1e-4)  # (the converted one does not run softmax)


def test_a_folder_never_converted_is_refused(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "plain")
    _tokenizer(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a converted hf_rfa checkpoint"):
        bench.softmax_weights(str(tmp_path / "plain"), str(tmp_path / "out"))
