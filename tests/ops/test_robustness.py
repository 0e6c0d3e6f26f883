"""Robustness of ``random_feature_attention``: bad arguments are refused with
``ValueError`` before any kernel runs, empty inputs give empty results, no output depends on a
later (causal) or padded position, and finite inputs give finite outputs — checked case by case
and by one seeded fuzz run over every map, dtype, mask, window/sinks and both backends."""

from __future__ import annotations

import math
import random

import pytest
import torch

import hf_rfa
from conftest import rel
from hf_rfa.ops.backends import native
from hf_rfa.ops.decode import DecodeCall, DecodeState, continue_attention
from tolerances import ORACLE_FP32

A = hf_rfa.random_feature_attention
MAPS = [n for n in hf_rfa.available_feature_maps() if n != "none"]  # "none" needs a window or sinks: tests/ops/test_window_only.py
#: the fuzz draws every map; "none" (window-only) with window = sinks = 0 must be refused
FUZZ_MAPS = hf_rfa.available_feature_maps()


def _qkv(b=1, h=2, n=8, d=8, hkv=None, dv=None, dtype=torch.float32, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    hkv = hkv or h
    q = torch.randn(b, h, n, d, generator=g) * std
    k = torch.randn(b, hkv, n, d, generator=g) * std
    v = torch.randn(b, hkv, n, dv or d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.fixture(params=[False, True], ids=["torch", "native"])
def backend(request):
    if request.param and not native.usable(torch.device("cpu"), torch.float32):
        pytest.skip("native kernel unavailable")
    before = native.native_enabled()
    native.set_native(request.param)
    yield request.param
    native.set_native(before)


# ---- bad arguments: ValueError naming the field ------------------------------------------------
BAD_CALLS = {
    "H=0": (lambda fm: A(*_qkv(h=0, hkv=0), fm), "at least one head"),
    "int tensors": (lambda fm: A(*(x.long() for x in _qkv()), fm), "floating-point"),
    "negative scale": (lambda fm: A(*_qkv(), fm, scale=-1.0), "scale"),
    "nan scale": (lambda fm: A(*_qkv(), fm, scale=float("nan")), "scale"),
    "inf scale": (lambda fm: A(*_qkv(), fm, scale=float("inf")), "scale"),
    "zero scale": (lambda fm: A(*_qkv(), fm, scale=0.0), "scale"),
    "feature_map=None": (lambda fm: A(*_qkv(), None), "feature_map"),
    "chunk_size=2**31": (lambda fm: A(*_qkv(), fm, chunk_size=2**31), r"chunk_size must be an int in \[1, 4096\]"),
    "chunk_size=2**32": (lambda fm: A(*_qkv(), fm, chunk_size=2**32), "chunk_size"),
    "chunk_size=0": (lambda fm: A(*_qkv(), fm, chunk_size=0), "chunk_size"),
    "sinks=10**9": (lambda fm: A(*_qkv(), fm, sinks=10**9), r"sinks must be an int in \[0, 4096\]"),
    "window=-1": (lambda fm: A(*_qkv(), fm, window=-1), "window"),
    "causal=None": (lambda fm: A(*_qkv(), fm, causal=None), "causal"),
    "3-D q": (lambda fm: A(torch.zeros(2, 8, 8), *_qkv()[1:], fm), "4-D"),
    "mask shape": (lambda fm: A(*_qkv(), fm, attention_mask=torch.ones(1, 7)), "attention_mask"),
    "Nq > Nk causal": (lambda fm: A(_qkv(n=9)[0], *_qkv(n=8)[1:], fm), "Nq <= Nk"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS), ids=list(BAD_CALLS))
def test_bad_arguments_raise_value_error(case, backend):
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8, seed=0)
    call, match = BAD_CALLS[case]
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        call(fm)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk_size=2**31), "chunk_size"),
        (dict(chunk_size=10**6), "chunk_size"),
        (dict(sinks=10**7), "sinks"),
        (dict(num_features=10**7), "num_features"),
        (dict(window=2**40), "window"),
        (dict(redraw_interval=2**40), "redraw_interval"),
        (dict(seed=2**70), "seed"),
        (dict(layers=[True]), "layers"),
        (dict(layers=[2**30]), "layers"),
        (dict(layers="0"), "layers"),
    ],
    ids=lambda x: str(x)[:30],
)
def test_config_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        hf_rfa.RFAConfig(**kwargs)
    assert hf_rfa.RFAConfig(chunk_size=4096, sinks=4096, window=10**6).chunk_size == 4096  # the bounds themselves are fine


def test_feature_map_arguments():
    with pytest.raises(ValueError, match="num_kv_heads"):
        hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8, num_heads=2, num_kv_heads=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8, num_heads=3, num_kv_heads=2)
    for rho in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="rho"):
            hf_rfa.build_feature_map("favor++", head_dim=8, num_features=8, rho=rho)
    fm = hf_rfa.build_feature_map("favor++", head_dim=8, num_features=8)
    with pytest.raises(ValueError, match="finite"):
        fm.calibrate(torch.full((4, 8), float("nan")), torch.randn(4, 8))


@pytest.mark.parametrize("shape", [dict(b=0), dict(n=0), dict(dv=0)], ids=["B=0", "N=0", "Dv=0"])
def test_empty_inputs_give_empty_outputs(shape, backend):
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8, seed=0)
    q, k, v = _qkv(**shape)
    for causal in (True, False):
        with torch.no_grad():
            out = A(q, k, v, fm, causal=causal, window=2, sinks=1)
        assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def test_no_keys_bidirectional_gives_zeros():
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8, seed=0)
    q = torch.randn(1, 2, 3, 8)
    out = A(q, torch.zeros(1, 2, 0, 8), torch.zeros(1, 2, 0, 5), fm, causal=False)
    assert out.shape == (1, 2, 3, 5) and torch.equal(out, torch.zeros_like(out))


def test_native_kernel_refuses_bad_sizes_instead_of_crashing(backend):
    """Called directly, the C++ kernel raises (no SIGFPE / bad_alloc) for an empty batch, zero kv
    heads or an absurd chunk."""
    if not backend:
        pytest.skip("native only")
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=8, seed=0)
    params = fm.native_params(8**-0.25)
    for b, hkv, chunk in ((0, 2, 64), (1, 2, 2**31), (1, 2, 2**32), (1, 2, 10**6)):
        q, k, v = _qkv(b=b, hkv=hkv)
        S, ref = torch.zeros(b, hkv, 8, 9), torch.zeros(b, hkv)
        try:
            native.causal_positive(q, k, v, params, (None, None), (S, ref), native.KernelRun(chunk, -80.0, 1e-20))
        except RuntimeError as e:
            assert "chunk" in str(e)
        else:
            assert b == 0


# ---- poisoning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MAPS)
def test_nonfinite_key_poisons_only_rows_that_see_it(name, backend):
    """softmax: one inf/nan key at position 200 makes rows >= 200 NaN and nothing else."""
    fm = hf_rfa.build_feature_map(name, head_dim=16, num_features=16, seed=0)
    q, k, v = _qkv(n=256, d=16, seed=1)
    for bad in (float("inf"), float("nan")):
        k2 = k.clone()
        k2[:, :, 200] = bad
        for window, sinks in ((0, 0), (8, 2)):
            with torch.no_grad():
                out = A(q, k2, v, fm, causal=True, window=window, sinks=sinks)
                ref = A(q, k, v, fm, causal=True, window=window, sinks=sinks)
            rows_bad = ~torch.isfinite(out).all(-1)  # [B,H,N]
            assert not rows_bad[..., :200].any() and rows_bad[..., 200:].all()
            assert torch.equal(out[..., :200, :], ref[..., :200, :])


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_nonfinite_padded_key_changes_nothing(name, causal, backend):
    fm = hf_rfa.build_feature_map(name, head_dim=8, num_features=8, seed=0)
    q, k, v = _qkv(b=2, n=40, seed=2)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, 30:] = False  # right padding
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 3], v2[0, :, 1], k2[1, :, 35], v2[1, :, 39] = float("inf"), float("nan"), float("-inf"), 1e30
    for window, sinks in ((0, 0), (4, 1)):
        with torch.no_grad():
            out = A(q, k2, v2, fm, causal=causal, attention_mask=mask, window=window, sinks=sinks)
            ref = A(q, k, v, fm, causal=causal, attention_mask=mask, window=window, sinks=sinks)
        assert torch.isfinite(out).all()
        assert torch.equal(out, ref)


@pytest.mark.parametrize("seed", range(20))
def test_fp16_signed_rfa_does_not_overflow(seed, backend):
    fm = hf_rfa.build_feature_map("rfa", head_dim=8, num_features=1, seed=seed)
    q, k, v = _qkv(n=64, std=math.sqrt(10.0), dtype=torch.float16, seed=seed)
    with torch.no_grad():
        out = A(q, k, v, fm, causal=True, window=1, sinks=1)
    assert torch.isfinite(out).all()


def test_exact_rows_before_any_feature_key_are_not_floored():
    """elu, window 4: query 0 sees only key 0 (exact), so its output is v[0] whatever the logit."""
    fm = hf_rfa.build_feature_map("elu", head_dim=4, num_features=4, seed=0)
    q = torch.tensor([[[[6.0, 0.0, 0.0, 0.0]] * 8]])
    k = torch.tensor([[[[-6.0, 0.0, 0.0, 0.0]] * 8]])
    v = torch.randn(1, 1, 8, 4, generator=torch.Generator().manual_seed(0))
    state = DecodeState.empty((1, 1, 4, 4, fm.feature_dim), 0, torch.float32)
    dec, _ = continue_attention(state, q, k, v, fm, None, DecodeCall(window=4))
    assert torch.allclose(dec[0, 0, 0], v[0, 0, 0])  # cached decoding: right
    out = A(q, k, v, fm, causal=True, window=4)
    assert torch.allclose(out[0, 0, 0], v[0, 0, 0])


# ---- the fuzz run ----------------------------------------------------------------------------------
def _bad_argument(rng: random.Random, q, k, v):
    """One invalid call's keyword changes (or replaced tensors)."""
    choice = rng.randrange(8)
    if choice == 0:
        return {"chunk_size": rng.choice([0, -3, 2**31, 2**32, 10**6, 2.5, True])}
    if choice == 1:
        return {"scale": rng.choice([-1.0, 0.0, float("nan"), float("inf"), "x"])}
    if choice == 2:
        return {"window": rng.choice([-1, 1.5, None])}
    if choice == 3:
        return {"sinks": rng.choice([-1, 10**9, 4097])}
    if choice == 4:
        return {"q": q.to(torch.int32)}
    if choice == 5:
        return {"attention_mask": torch.ones(q.shape[0] + 1, k.shape[2])}
    if choice == 6:
        return {"feature_map": rng.choice([None, "favor+", 3])}
    return {"v": v.flatten(2)}  # 3-D


def _decode(q, k, v, fm, kw, splits: list[int]) -> torch.Tensor:
    """The causal op through cached decoding (``continue_attention``), the new tokens in ``splits``."""
    b, h, n, d = q.shape
    mask = kw["attention_mask"]
    state = DecodeState.empty((b, k.shape[1], d, v.shape[-1], getattr(fm, "feature_dim", 1)), kw["sinks"] if isinstance(kw["sinks"], int) and 0 <= kw["sinks"] <= 4096 else 0, q.dtype,
                              compute_dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)  # float64 sums for the float64 check, as RFACache
    outs, i = [], 0
    for s in splits:
        o, state = continue_attention(state, q[:, :, i:i + s], k[:, :, i:i + s], v[:, :, i:i + s], fm, None if mask is None else mask[:, i:i + s], DecodeCall(window=kw["window"], sinks=kw["sinks"], scale=kw.get("scale"), chunk_size=kw["chunk_size"]))
        outs.append(o)
        i += s
    return torch.cat(outs, 2)


def _splits(rng: random.Random, n: int) -> list[int]:
    """A prefill of random length, maybe a multi-token chunk, then single tokens (sum n)."""
    out = []
    while sum(out) < n:
        left = n - sum(out)
        out.append(rng.randint(1, left) if not out or rng.random() < 0.2 else 1)
    return out


def _decode_disagrees(q, k, v, fm, kw, out: torch.Tensor, splits: list[int]) -> int:
    """1 unless cached decoding gives the full op's NaN rows (in the case's dtype) and its values
    (both recomputed in float64, so that the comparison is of the algorithms, not of the
    rounding of an ill-conditioned signed-map normaliser)."""
    dec = _decode(q, k, v, fm, kw, splits)
    bad = ~torch.isfinite(out).all(-1)
    if not torch.equal(bad, ~torch.isfinite(dec).all(-1)):
        return 1
    x64 = [t.double() for t in (q, k, v)]
    o64, d64 = A(*x64, fm, **kw), _decode(*x64, fm, kw, splits)
    bad = ~torch.isfinite(o64).all(-1)
    if not torch.equal(bad, ~torch.isfinite(d64).all(-1)):
        return 1
    keep = ~bad
    return int(bool(keep.any()) and rel(d64[keep], o64[keep]) > ORACLE_FP32)


def _fuzz_case(rng: random.Random, maps: dict, case: int) -> tuple[int, int, int, int, int]:
    """Run one random case; return (non-finite outputs from finite inputs, outputs influenced by
    later or padded positions, non-ValueError exceptions (or a bad argument accepted), cached
    decoding disagreeing with the full op, cases decoded) — each 0 or 1."""
    name = rng.choice(FUZZ_MAPS)
    d = rng.choice([4, 8])
    fm = maps.setdefault((name, d), hf_rfa.build_feature_map(name, head_dim=d, num_features=rng.choice([1, 4]), seed=case % 7))
    b, hkv, g = rng.choice([0, 1, 2]), rng.choice([1, 2]), rng.choice([1, 2])
    nk = rng.choice([0, 1, 2, 3, 5, 8, 13, 21])
    causal = rng.random() < 0.6
    nq = rng.randint(0, nk) if causal and rng.random() < 0.3 else nk
    dv = rng.choice([0, 1, 3, d]) if rng.random() < 0.2 else d
    dtype = rng.choice([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    std = math.sqrt(rng.choice([0.1, 1.0, 5.0, 10.0, 30.0]))
    gen = torch.Generator().manual_seed(case)
    q = (torch.randn(b, hkv * g, nq, d, generator=gen) * std).to(dtype)
    k = (torch.randn(b, hkv, nk, d, generator=gen) * std).to(dtype)
    v = torch.randn(b, hkv, nk, dv, generator=gen).to(dtype)
    mask = None
    if rng.random() < 0.4 and nk:
        mask = torch.rand(b, nk, generator=gen) < 0.7
        if b and rng.random() < 0.3:
            mask[0] = False  # a fully padded row
    window = rng.choice([0, 0, 1, 2, 5, 100]) if causal or nq == nk else 0
    kw = dict(causal=causal, attention_mask=mask, window=window, sinks=rng.choice([0, 0, 1, 3]), chunk_size=rng.choice([1, 2, 4, 64]))
    native.set_native(rng.random() < 0.5)
    # cached decoding: a third of the causal cases whose queries are all the keys
    decode = causal and nq == nk and rng.random() < 0.35
    args = {"q": q, "k": k, "v": v, "feature_map": fm}
    if rng.random() < 0.15:  # bad argument: must be a ValueError
        args.update(_bad_argument(rng, q, k, v))
        kw.update({key: val for key, val in args.items() if key not in ("q", "k", "v", "feature_map")})
        okw = {key: val for key, val in kw.items() if key in ("causal", "attention_mask", "window", "sinks", "chunk_size", "scale")}
        calls = [lambda: A(args["q"], args["k"], args["v"], args["feature_map"], **okw)]
        if decode and "attention_mask" not in args:  # (a mask of the wrong batch cannot be split into steps)
            calls.append(lambda: _decode(args["q"], args["k"], args["v"], args["feature_map"], kw, [nk] if nk else [0]))
        refused = 0
        for call in calls:
            try:
                with torch.no_grad():
                    call()
            except ValueError:
                refused += 1
            except Exception:  # noqa: BLE001 - counted
                pass
        return 0, 0, int(refused < len(calls)), 0, int(len(calls) > 1)
    if getattr(fm, "null", False) and window == 0 and kw["sinks"] == 0:  # window-only map with nothing to attend
        try:
            with torch.no_grad():
                A(q, k, v, fm, **kw)
        except ValueError as e:
            return 0, 0, int("window > 0 or sinks > 0" not in str(e)), 0, 0
        except Exception:  # noqa: BLE001 - counted
            return 0, 0, 1, 0, 0
        return 0, 0, 1, 0, 0
    injected = rng.random() < 0.3 and v.numel() > 0 and q.numel() > 0
    if injected:  # one non-finite entry in q, k or v
        x = args[rng.choice(["q", "k", "v"])]
        x[tuple(rng.randrange(s) for s in x.shape)] = rng.choice([float("inf"), float("-inf"), float("nan")])
    disagrees = 0
    try:
        with torch.no_grad():
            out = A(q, k, v, fm, **kw)
            nonfinite = int(not injected and not bool(torch.isfinite(out).all()))
            if decode:
                disagrees = _decode_disagrees(q, k, v, fm, kw, out, _splits(rng, nk) if nk else [0])
            influenced = 0
            # later positions (causal): change keys/values at key positions >= p
            if causal and nk:
                p = rng.randrange(nk)
                k2, v2 = k.clone(), v.clone()
                k2[:, :, p:], v2[:, :, p:] = rng.choice([float("nan"), float("inf"), 1e4]), float("nan")
                out2 = A(q, k2, v2, fm, **kw)
                rows = max(0, p - (nk - nq))  # queries at key positions < p
                influenced |= int(not torch.equal(out[:, :, :rows].nan_to_num(7.0), out2[:, :, :rows].nan_to_num(7.0)))
            if mask is not None and (~mask).any():
                k3, v3 = k.clone(), v.clone()
                pad = ~mask[:, None, :, None]
                k3, v3 = k3.masked_fill(pad, rng.choice([float("nan"), float("inf"), 1e4, -30.0])), v3.masked_fill(pad, rng.choice([float("-inf"), 1e4]))
                out3 = A(q, k3, v3, fm, **kw)
                influenced |= int(not torch.equal(out.nan_to_num(7.0), out3.nan_to_num(7.0)))
                if decode:  # the same padded garbage through cached decoding
                    disagrees |= _decode_disagrees(q, k3, v3, fm, kw, out3, _splits(rng, nk))
    except Exception:  # noqa: BLE001 - counted: valid arguments must not raise
        return 0, 0, 1, disagrees, int(decode)
    return nonfinite, influenced, 0, disagrees, int(decode)


def test_fuzz_counts_are_zero():
    """>= 2,000 seeded cases over every map (window-only "none" included): 0 non-finite outputs
    from finite inputs, 0 outputs influenced by later or padded positions, nothing but ValueError
    for bad arguments (and for "none" without window or sinks); a third of the causal cases also
    run through cached decoding (``continue_attention``, random prefill/chunk/token splits), which
    must give the full op's NaN rows and its values (float64, tolerances.py) and refuse the same bad arguments."""
    rng, maps = random.Random(17), {}
    before, threads = native.native_enabled(), torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: threads only add overhead
    totals = [0, 0, 0, 0, 0]
    try:
        for case in range(2000):
            for i, c in enumerate(_fuzz_case(rng, maps, case)):
                totals[i] += c
    finally:
        native.set_native(before)
        torch.set_num_threads(threads)
    print(f"fuzz 2000 cases: non-finite from finite inputs {totals[0]}, influenced by later/padded {totals[1]}, "
          f"non-ValueError {totals[2]}, decode disagreeing {totals[3]} of {totals[4]} decoded")
    assert totals[:4] == [0, 0, 0, 0] and totals[4] >= 300
