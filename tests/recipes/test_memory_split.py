"""``memory_split``: the exact memory switched on after training, split over the layers by the
original's induction share — the split itself, the share against eager attention's probabilities,
the config's checks."""

import pytest
import torch

from hf_rfa.recipes import long_range
from hf_rfa.recipes.conversion.config import ConversionConfig
from hf_rfa.recipes.conversion.memory_split import MEMORY_SPLITS, floor_keys, induction_shares, split_budget
from tiny_models import tiny_model


def test_split_budget_keeps_the_total_and_the_floor():
    # 18 keys beyond the floor: 0 / 9 / 4.5 / 4.5, the one left over to the first largest remainder
    assert split_budget(30, [0.0, 0.5, 0.25, 0.25], floor=3) == [3, 12, 8, 7]
    assert split_budget(10, [1.0, 1.0, 1.0]) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert floor_keys(0.625, 256) == 160 and floor_keys(0.625, 3) == 2 and floor_keys(0.0, 256) == 0
    assert split_budget(9, [0.0, 0.0, 0.0], floor=1) == [3, 3, 3]  # no share anywhere: evenly
    assert split_budget(12, [0.7, 0.2, 0.1], floor=4) == [4, 4, 4]  # the floor takes everything
    with pytest.raises(ValueError, match="memory_floor=5 x 3 layers exceeds the total of 12"):
        split_budget(12, [1.0, 1.0, 1.0], floor=5)
    with pytest.raises(ValueError, match="scores must be >= 0"):
        split_budget(12, [1.0, -1.0, 1.0])


def _eager_shares(model, ids, gaps, passage, draws, skip, seed):
    """The same share from eager attention's probabilities (output_attentions)."""
    model.set_attn_implementation("eager")
    cfg = model.config
    hkv, h = cfg.num_key_value_heads, cfg.num_attention_heads
    sums = torch.zeros(cfg.num_hidden_layers, hkv, dtype=torch.float64)
    with torch.no_grad():
        for gap in gaps:
            period = passage + gap
            t = torch.arange(period + skip - 1, period + passage - 1)
            for row in long_range.copy_sequences(ids, passage, gap, draws, seed=seed):
                att = model(input_ids=row[None], output_attentions=True, use_cache=False).attentions
                for i, a in enumerate(att):  # [1, H, N, N]
                    src = torch.stack([a[0, :, q, q - period + 1] for q in t.tolist()], dim=-1)  # [H, Q]: each query's source key
                    sums[i] += src.mean(-1).view(hkv, h // hkv).mean(-1).double()
    model.set_attn_implementation("sdpa")
    return (sums / (len(gaps) * draws)).tolist()


def test_induction_shares_equal_eager_attention_probabilities():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    ids = torch.randint(2, 128, (600,), generator=torch.Generator().manual_seed(0))
    x = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    before = model(x).logits
    got = induction_shares(model, ids, [20, 60], passage=24, draws=2, skip=4, seed=3)
    assert model.config._attn_implementation == "sdpa"  # put back
    assert torch.equal(model(x).logits, before)
    want = _eager_shares(model, ids, [20, 60], passage=24, draws=2, skip=4, seed=3)
    assert len(got) == 2 and all(len(row) == 2 for row in got)
    assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-7)
    assert all(0 < x < 1 for row in got for x in row)


def test_config_checks_name_the_bad_value():
    with pytest.raises(ValueError, match=r"memory_split must be one of \['uniform', 'induction'\], got 'copy'"):
        ConversionConfig(model="x", memory_split="copy", memory_after_training=8)
    with pytest.raises(ValueError, match=r"memory_floor must be a share of memory_after_training in \[0, 1\] \(0.625: 160 of 256 keys\), got 1.5"):
        ConversionConfig(model="x", memory_split="induction", memory_after_training=8, memory_floor=1.5)
    with pytest.raises(ValueError, match="memory_floor"):
        ConversionConfig(model="x", memory_floor=-1)
    ConversionConfig(model="x", memory_split="induction", memory_after_training=0)  # no memory: nothing to split
    from dataclasses import fields

    assert next(f for f in fields(ConversionConfig) if f.name == "memory_split").metadata["choices"] == list(MEMORY_SPLITS)
    assert ConversionConfig.from_preset("recall", model="x").memory_split == "induction"
