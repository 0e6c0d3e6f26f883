"""An RFACache of a rotary model with an exact memory and ``feature_input="unrotated"`` keeps the
rotated keys only: the memory's keys are un-rotated where a call reads them, with rotations
recomputed from the model's rotary embedding (``hf_rfa.hf.rotations.RopeTable``), checked against
every forward's. Cached decoding, left-padded ``generate()``, beam search and the clamp at
``memory_distance`` give what the cache with copies gives, bit for bit, in fewer bytes; where the
check fails the cache falls back to copies and stays right."""

import pytest
import torch

import hf_rfa
from hf_rfa.hf.rotations import RopeTable
from tiny_models import VOCAB, tiny_model
from tolerances import DECODE_LOGITS

SETTING = dict(feature_map="hedgehog", num_features=16, window=3, sinks=1, decay=5.0, chunk_size=4, memory=2, memory_every=4,
               feature_map_options={"hybrid_mix": True}, feature_input="unrotated", memory_score="feature_error")


def _model(**over):
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**SETTING, **over})).eval()
    with torch.no_grad():  # as if transferred: the feature part carries real weight
        for layer in model.model.layers:
            layer.self_attn.rfa.feature_map.mix.fill_(2.0)
    return model


def _ids(n=40, rows=2):
    return torch.randint(2, VOCAB, (rows, n), generator=torch.Generator().manual_seed(5))


def _decode(model, ids, copies: bool, steps=(7, 5, 3)):
    cache = hf_rfa.RFACache(model)
    if copies:
        cache.rope_table.ok = False  # as if the check had failed from the start
    outs, t = [], 0
    with torch.no_grad():
        for step in list(steps) + [1] * (ids.shape[1] - sum(steps)):
            outs.append(model(ids[:, t:t + step], cache=cache, use_cache=True).logits)
            t += step
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("over", [{}, {"memory_distance": 9}, {"memory_score": "value_norm", "decay": 0}], ids=["recipe", "clamped", "value_norm"])
def test_decoding_without_copies_equals_decoding_with_them(over):
    model = _model(**over)
    ids = _ids()
    derived, cache = _decode(model, ids, copies=False)
    kept, ref = _decode(model, ids, copies=True)
    assert torch.equal(derived, kept)
    with torch.no_grad():
        full = model(ids).logits
    assert (derived - full).abs().max().item() <= DECODE_LOGITS
    assert cache.rope_table.ok and not ref.rope_table.ok
    for layer, other in zip(cache.layers, ref.layers):
        st, ot = layer.state, other.state
        assert st.mem_kf is None and st.base.win_kf is None and ot.mem_kf is not None
        assert layer.nbytes() == other.nbytes() - (ot.mem_kf.numel() + ot.base.win_kf.numel()) * ot.mem_kf.element_size()
        assert st.base.win_k.shape[2] <= 3 + 4  # the ring (W + memory_every positions) covers the buffer
    assert len(cache.rope_ring) == 3 + 4


def test_left_padded_generate_and_beam_search_keep_no_copies():
    model = _model()
    ids = _ids(n=14)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        for beams in (1, 2):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=beams, do_sample=False, return_dict_in_generate=True)
            assert out.cache.rope_table.ok and all(layer.state.mem_kf is None for layer in out.cache.layers)
            plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, num_beams=beams, do_sample=False, use_cache=False)
            assert torch.equal(out.sequences, plain)
    assert out.cache.rope_table.offsets.tolist() in ([0, 0, 3, 3], [0, 3, 0, 3], [3, 3, 0, 0], [3, 0, 3, 0])  # beams of the two rows


def test_a_failed_check_falls_back_to_copies_mid_stream():
    """Positions the table cannot reproduce (here: the model's positions jump) switch every layer to
    copies, derived from the rotations checked so far: the logits stay those of copies throughout."""
    model = _model()
    ids = _ids(n=30)
    outs = {}
    for copies in (False, True):
        cache = hf_rfa.RFACache(model)
        cache.rope_table.ok = not copies
        got, t = [], 0
        with torch.no_grad():
            for step in (9, 1, 1, 1, 4, 1, 1):
                pos = torch.arange(t, t + step)[None] + (5 if t >= 12 else 0)  # from the 5th call on: shifted
                got.append(model(ids[:, t:t + step], position_ids=pos.expand(2, -1), cache=cache, use_cache=True).logits)
                t += step
        outs[copies] = torch.cat(got, 1)
        if not copies:
            assert not cache.rope_table.ok and all(layer.state.mem_kf is not None for layer in cache.layers)
    assert torch.equal(outs[False], outs[True])


def test_the_table_refuses_what_it_cannot_reproduce():
    rot = tiny_model("llama").model.rotary_emb
    cos, sin = rot(torch.zeros(1), torch.arange(6)[None])
    table = RopeTable()
    assert table.observe(0, 6, None, cos, sin, (rot,))
    assert table.observe(0, 6, None, cos, sin, (rot,))  # a later layer of the same forward
    c, s = table.rotations(torch.tensor([[4, 0, 2]]), cos.dtype)
    assert torch.equal(c[0], cos[0, [4, 0, 2]]) and torch.equal(s[0], sin[0, [4, 0, 2]])
    nxt = rot(torch.zeros(1), torch.tensor([[7]]))
    assert not table.observe(6, 1, None, *nxt, (rot,))  # position 7 given for cache position 6
    assert not table.observe(7, 1, None, *nxt, (rot,))  # and it stays off
    padded = RopeTable()
    mask = torch.tensor([[True, True, False]])
    assert not padded.observe(0, 3, mask, *rot(torch.zeros(1), torch.arange(3)[None]), (rot,))  # padding after a real token
    assert not RopeTable().observe(0, 6, None, cos, sin, (rot, rot))  # several rotary modules

    class Dynamic(torch.nn.Module):
        rope_type = "dynamic"

        def forward(self, x, position_ids):
            return rot(x, position_ids)

    assert not RopeTable().observe(0, 6, None, cos, sin, (Dynamic(),))


def test_bfloat16_weights_decode_without_copies_as_with_them():
    """bf16 weights: the rotations are bf16 and the kept keys too; the derived keys are rounded
    as the copies were."""
    model = _model().to(torch.bfloat16)
    ids = _ids(n=30)
    derived, cache = _decode(model, ids, copies=False)
    kept, _ = _decode(model, ids, copies=True)
    assert cache.rope_table.ok and cache.layers[0].state.mem_kf is None
    assert torch.equal(derived, kept)


def test_a_table_of_one_row_continues_with_a_padded_batch():
    rot = tiny_model("llama").model.rotary_emb
    table = RopeTable()
    cos, sin = rot(torch.zeros(1), torch.arange(4)[None])
    assert table.observe(0, 4, None, cos, sin, (rot,))  # no mask: one row of positions for all
    nxt = rot(torch.zeros(1), torch.tensor([[4, 5]]))
    assert table.observe(4, 2, torch.ones(3, 2, dtype=torch.bool), *nxt, (rot,))
    assert table.offsets.tolist() == [0, 0, 0]
