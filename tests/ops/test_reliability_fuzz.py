"""A seeded fuzz run over what transformers really passes and what users get wrong: non-contiguous
layouts, float masks (0/1 accepted, additive refused), huge finite values, rotary inputs
(``feature_rope``), Nq < Nk in both modes with sinks beyond Nq.

For >= 3,000 cases: 0 exceptions other than the ValueError of an additive mask; 0 non-finite
outputs from finite inputs; 0 changes of earlier rows (causal) when later keys turn non-finite,
in the same (non-contiguous) layout; the same output bit for bit from fresh contiguous copies of
q, k, v; a float 0/1 mask gives the bool mask's output bit for bit;
and the op equals its quadratic twin (float64, ``tolerances.ORACLE_FP32``) — 0 wrong answers.
"""

from __future__ import annotations

import copy
import os
import random

import torch

import hf_rfa
from conftest import rel
from hf_rfa.ops.backends import native
from hf_rfa.ops.rotary import unrotate
from tolerances import ORACLE_FP32

A, TWIN = hf_rfa.random_feature_attention, hf_rfa.quadratic_kernel_attention
CASES = int(os.environ.get("HF_RFA_FUZZ_CASES", "3000"))


def _layout(kind: int, base: torch.Tensor) -> torch.Tensor:
    """``base [B, N, H, D]`` as the op's ``[B, H, N, D]``: a transposed view (transformers' layout,
    ``kind`` 0), a slice of a wider tensor (1), or contiguous (2)."""
    if kind == 0:
        return base.transpose(1, 2)
    if kind == 1:
        wide = torch.cat([base, base], dim=-1)
        return wide[..., : base.shape[-1]].transpose(1, 2)
    return base.transpose(1, 2).contiguous()


def _rope(n: int, d: int, gen: torch.Generator):
    dr = d if torch.rand(1, generator=gen).item() < 0.5 else d // 2
    dr -= dr % 2
    ang = torch.rand(1, n, dr // 2, generator=gen) * 8
    scale = 1.0 + torch.rand(1, generator=gen).item() * 0.3  # YaRN-style scaled rotations too
    return torch.cat([ang.cos(), ang.cos()], -1) * scale, torch.cat([ang.sin(), ang.sin()], -1) * scale


def _case(rng: random.Random, maps: dict, case: int) -> dict[str, int]:
    """One case; returns the failure counts (each 0 or 1)."""
    name = rng.choice([n for n in hf_rfa.available_feature_maps() if n != "none"])
    d = rng.choice([4, 8])
    fm = maps.setdefault((name, d), hf_rfa.build_feature_map(name, head_dim=d, num_features=rng.choice([1, 4]), seed=case % 5))
    b, hkv, g = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2])
    nk = rng.choice([1, 2, 3, 5, 8, 13])
    causal = rng.random() < 0.5
    nq = rng.randint(1, nk) if rng.random() < 0.4 else nk
    window = rng.choice([0, 1, 3]) if nq == nk else 0
    sinks = rng.choice([0, 1, 3, 7])
    dtype = rng.choice([torch.float32, torch.float32, torch.float16])
    gen = torch.Generator().manual_seed(case)
    qb = torch.randn(b, nq, hkv * g, d, generator=gen)
    kb = torch.randn(b, nk, hkv, d, generator=gen)
    vb = torch.randn(b, nk, hkv, d, generator=gen)
    huge = rng.random() < 0.2
    if huge:  # one huge finite entry (inside the dtype's range)
        big = rng.choice([3e19, 1e30]) if dtype == torch.float32 else 3e4
        kb[rng.randrange(b), rng.randrange(nk), rng.randrange(hkv), rng.randrange(d)] = rng.choice([big, -big])
    qb, kb, vb = qb.to(dtype), kb.to(dtype), vb.to(dtype)
    kinds = [rng.randrange(3) for _ in range(3)]
    q, k, v = (_layout(kind, x) for kind, x in zip(kinds, (qb, kb, vb)))
    mask = None
    if rng.random() < 0.5:
        mask = torch.rand(b, nk, generator=gen) < 0.75
        mask[:, -1] = True
    rope = _rope(nk, d, gen) if nq == nk and rng.random() < 0.3 else None
    if rope is not None and dtype == torch.float16:
        rope = tuple(t.half() for t in rope)
    kw = dict(causal=causal, window=window, sinks=sinks, feature_rope=rope)
    native.set_native(rng.random() < 0.5)
    fails = dict.fromkeys(("raised", "nonfinite", "layout", "earlier_rows", "float_mask", "additive_accepted", "wrong"), 0)
    try:
        with torch.no_grad():
            out = A(q, k, v, fm, attention_mask=mask, **kw)
            fails["nonfinite"] = int(not bool(torch.isfinite(out).all()))
            fresh = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))  # the canonical strides
            fails["layout"] = int(not torch.equal(A(*fresh, fm, attention_mask=mask, **kw), out))
            if mask is not None:
                fails["float_mask"] = int(not torch.equal(A(q, k, v, fm, attention_mask=mask.to(dtype), **kw), out))
                if rng.random() < 0.3:
                    try:
                        A(q, k, v, fm, attention_mask=torch.zeros(b, nk).masked_fill(~mask, float("-inf")), **kw)
                        fails["additive_accepted"] = 1
                    except ValueError:
                        pass
            if causal:  # later keys turn NaN, in the same layout: earlier rows bit-identical
                p = rng.randrange(nk)
                k2b, v2b = kb.clone(), vb.clone()
                k2b[:, p:], v2b[:, p:] = float("nan"), float("inf")
                k2, v2 = _layout(kinds[1], k2b), _layout(kinds[2], v2b)  # the same strides as k, v
                out2 = A(q, k2, v2, fm, attention_mask=mask, **kw)
                rows = max(0, p - (nk - nq))
                fails["earlier_rows"] = int(not torch.equal(out[:, :, :rows], out2[:, :, :rows]))
            if dtype == torch.float32 and not huge and rng.random() < 0.5:
                x64 = [t.double() for t in (q, k, v)]
                fm64 = maps.setdefault(("f64", name, d, id(fm)), copy.deepcopy(fm).double())
                got = A(*x64, fm64, attention_mask=mask, **kw)
                extra = {}
                if rope is not None:
                    cos, sin = (t.double() for t in rope)
                    extra = dict(feature_q=unrotate(x64[0], cos, sin), feature_k=unrotate(x64[1], cos, sin))
                ref = TWIN(*x64, fm64, causal=causal, attention_mask=mask, window=window, sinks=sinks, **extra)
                fails["wrong"] = int(rel(got, ref) > ORACLE_FP32 * 10)
    except Exception:  # noqa: BLE001 - counted: valid arguments must not raise
        fails["raised"] = 1
    return fails


def test_reliability_fuzz_counts_are_zero():
    rng, maps = random.Random(40), {}
    before, threads = native.native_enabled(), torch.get_num_threads()
    torch.set_num_threads(1)
    totals: dict[str, int] = {}
    first: dict[str, int] = {}
    try:
        for case in range(CASES):
            for key, bad in _case(rng, maps, case).items():
                totals[key] = totals.get(key, 0) + bad
                if bad and key not in first:
                    first[key] = case
    finally:
        native.set_native(before)
        torch.set_num_threads(threads)
    print(f"reliability fuzz {CASES} cases: {totals} (first failing case of each: {first})")
    assert all(v == 0 for v in totals.values()), (totals, first)

