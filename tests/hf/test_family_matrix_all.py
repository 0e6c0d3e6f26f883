"""The family matrix over every causal-LM config class transformers ships: each one that can be
built tiny either converts and reproduces its logits at ``window >= N`` (exact softmax) or is
refused by ``convert`` with a ValueError — never converted into a different attention.

Slow (every architecture is built); ``tests/hf/test_families.py`` is the fast subset.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import hf_rfa
from tolerances import PLUMBING_LOGITS

V, N = 64, 12
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, d_model=32, num_layers=2,
             num_heads=4, ffn_dim=64, moe_intermediate_size=16, num_experts=2, num_local_experts=2, num_experts_per_tok=1,
             n_routed_experts=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MAX_PARAMS = 3_000_000


def _causal_lm_classes() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny(model_type: str):
    """A tiny model of ``model_type`` (None when its config cannot be made tiny this generic way)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(tf, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    cfg_cls = tf.CONFIG_MAPPING[model_type] if model_type in tf.CONFIG_MAPPING else None
    if cls is None or cfg_cls is None:
        return None
    try:
        cfg = cfg_cls(**SIZES)
        with torch.device("meta"):
            if sum(p.numel() for p in cls(cfg).parameters()) > MAX_PARAMS:
                return None
        torch.manual_seed(0)
        return cls(cfg).eval()
    except Exception:  # noqa: BLE001 - not buildable from these generic sizes
        return None


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.slow
def test_every_tiny_causal_lm_is_exact_at_full_window_or_refused():
    built, exact, refused, wrong, crashed = [], [], [], [], []
    for model_type in _causal_lm_classes():
        model = _tiny(model_type)
        if model is None:
            continue
        ids = torch.randint(3, V, (2, N), generator=torch.Generator().manual_seed(1))
        try:
            model.set_attn_implementation("eager")
            ref = _logits(model, ids)
        except Exception:  # noqa: BLE001 - the model itself does not run tiny: not counted
            continue
        built.append(model_type)
        try:
            hf_rfa.convert(model, hf_rfa.RFAConfig(num_features=8, window=10**6))
        except ValueError:
            refused.append(model_type)
            continue
        try:
            got = _logits(model, ids)
        except Exception as e:  # noqa: BLE001 - converted, then broke: a failure
            crashed.append(f"{model_type}: {type(e).__name__}: {str(e)[:80]}")
            continue
        err = float((got - ref).abs().max())
        (exact if err <= PLUMBING_LOGITS else wrong).append(model_type if err <= PLUMBING_LOGITS else f"{model_type}: {err:.2g}")
    print(f"{len(built)} tiny causal LMs: {len(exact)} exact, {len(refused)} refused; wrong {wrong}; crashed {crashed}")
    assert len(built) >= 50
    assert not wrong and not crashed, (wrong, crashed)
