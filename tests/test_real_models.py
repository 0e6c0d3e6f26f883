"""Real checkpoints that ship offline (hf_rfa.assets): SmolLM2-135M (Llama, GQA) and
all-MiniLM-L6-v2 (BERT). Slow: they install/prepare the assets on first use."""

import pytest
import torch

import hf_rfa
from tolerances import PLUMBING_LOGITS

pytestmark = pytest.mark.slow

TEXTS = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris.",
    "Photosynthesis converts light energy into chemical energy stored in sugars.",
]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rfa.assets import smollm2_path

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return path, tok, AutoModelForCausalLM


def test_smollm2_window_reproduces_original_logits_and_greedy_tokens(smollm2):
    path, tok, cls = smollm2
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    pos = (enc.attention_mask.cumsum(-1) - 1).clamp_min(0)
    gen = dict(max_new_tokens=6, do_sample=False, use_cache=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ref = model(**enc, position_ids=pos).logits
    ref_tokens = model.generate(**enc, **gen)
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=64, window=4096, sinks=4))
    with torch.no_grad():
        out = model(**enc, position_ids=pos).logits
    m = enc.attention_mask.bool()
    assert (out[m] - ref[m]).abs().max() <= PLUMBING_LOGITS * 10  # 30 layers, logits ~±30: 1e-3 abs
    assert torch.equal(model.generate(**enc, **gen), ref_tokens)
    # random features without a window: different, finite
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=64))
    with torch.no_grad():
        rf = model(**enc, position_ids=pos).logits
    assert torch.isfinite(rf[m]).all() and (rf[m] - ref[m]).abs().max() > 0.1


def test_minilm_window_reproduces_original_embeddings():
    from transformers import AutoModel, AutoTokenizer

    from hf_rfa.assets import minilm_path

    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        ref = model(**enc).last_hidden_state
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=64, window=512))
    with torch.no_grad():
        out = model(**enc).last_hidden_state
    m = enc.attention_mask.bool()
    assert (out[m] - ref[m]).abs().max() <= PLUMBING_LOGITS
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=64))
    with torch.no_grad():
        rf = model(**enc).last_hidden_state
    assert torch.isfinite(rf[m]).all() and (rf[m] - ref[m]).abs().max() > 1e-3
