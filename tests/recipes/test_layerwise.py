"""Layer-by-layer attention transfer equals the all-layers form (hf_rfa.recipes.conversion.layerwise)."""

from __future__ import annotations

import copy

import torch

import hf_rfa
from hf_rfa.recipes.conversion import calibration, layerwise, transfer
from tiny_models import VOCAB, tiny_model


def _stream(seed: int = 0, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(2, VOCAB, (2, 40), generator=g), None) for _ in range(n)]
    return lambda: iter(batches)


def test_layerwise_equals_all_layers():
    fm, extra = "hedgehog", {"decay": 16, "feature_input": "unrotated"}
    torch.manual_seed(0)
    base = tiny_model("llama")
    hf_rfa.convert(base, hf_rfa.RFAConfig(feature_map=fm, num_features=8, window=4, sinks=1, **extra))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    make = _stream()
    kw = dict(lr=1e-2, init_mix=False, progress=False, queries=16, schedule="cosine", query_blocks=2)
    ra = transfer.attention_transfer(a, make(), 3 * 80, **kw)
    rb = layerwise.attention_transfer_layerwise(b, make, 3 * 80, **kw)
    assert ra.tokens == rb.tokens == 240 and rb.steps == 2 * ra.steps
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    moved = 0
    for name, p in pa.items():
        if ".rfa." in name:
            torch.testing.assert_close(pb[name], p, rtol=1e-5, atol=1e-6)
            moved += int(not torch.equal(p, dict(base.named_parameters())[name]))
        else:
            assert torch.equal(pb[name], p)
    assert moved > 0  # the maps did train
    torch.testing.assert_close(torch.tensor(rb.losses), torch.tensor(ra.losses), rtol=1e-5, atol=1e-7)


def test_capture_of_one_layer_stops_after_it():
    model = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    full = calibration.capture(model, ids)
    one = calibration.capture(model, ids, layers={0})
    assert set(one) == {0} and set(full) == {0, 1}
    torch.testing.assert_close(one[0].out, full[0].out, rtol=0, atol=0)
    calls = []
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        calibration.capture(model, ids, layers={0})
    finally:
        hook.remove()
    assert calls == []  # the forward stopped after layer 0
