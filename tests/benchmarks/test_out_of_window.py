"""benchmarks/out_of_window.py: the masks and per-layer figures it reports are right."""

import importlib.util
from pathlib import Path

import torch

from hf_rfa.recipes.conversion.calibration import Captured

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "out_of_window.py"
_spec = importlib.util.spec_from_file_location("out_of_window_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_out_of_window_mask_is_causal_minus_window_minus_sinks():
    m = bench.out_of_window_mask(6, window=2, sinks=1)
    for i in range(6):
        for j in range(6):
            assert bool(m[i, j]) == (j <= i - 2 and j >= 1), (i, j)


def _capture(n=48, h=4, hk=2, d=8, std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, n, d, generator=g) * std
    k = torch.randn(1, hk, n, d, generator=g) * std
    v = torch.randn(1, hk, n, d, generator=g)
    s = d**-0.5
    kk, vv = k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1)
    logits = (q @ kk.transpose(-1, -2)) * s
    logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(logits, -1) @ vv
    return Captured(q, k, v, out, None, True, s), torch.softmax(logits.double(), -1)


def test_layer_figures_match_a_direct_computation():
    cap, p = _capture()
    f = bench.layer_figures(cap, ["favor+"], num_features=64, window=8, sinks=2, seed=0, layer=0)
    mask = bench.out_of_window_mask(48, 8, 2)
    rows = mask.any(-1)
    assert abs(f["mass_out"] - float((p[0] * mask).sum(-1)[:, rows].mean())) < 1e-6
    # window-only error: its output is the softmax restricted to window + sinks
    keep = torch.ones(48, 48, dtype=torch.bool).tril() & ~mask
    q, k, v = cap.q.double(), cap.k.double().repeat_interleave(2, 1), cap.v.double().repeat_interleave(2, 1)
    lo = ((q @ k.transpose(-1, -2)) * cap.scale).masked_fill(~keep, float("-inf"))
    o_none = torch.softmax(lo, -1) @ v
    ref = cap.out.double()[0]
    err = ((o_none[0] - ref).norm(dim=-1) / ref.norm(dim=-1))[:, rows].median()
    assert abs(f["err_none"] - float(err)) < 1e-5
    assert 0 < f["err_none"] and 0 <= f["zrel_favor+"]


def test_favor_beats_dropping_on_diffuse_attention_but_not_its_normaliser_on_peaked():
    # diffuse attention (small logits): the feature estimate of the out-of-window part is good
    cap, _ = _capture(n=96, std=0.3, seed=1)
    f = bench.layer_figures(cap, ["favor+"], num_features=256, window=8, sinks=1, seed=0, layer=0)
    assert f["err_favor+"] < 0.5 * f["err_none"]
    assert f["zrel_favor+"] < 0.2
    # peaked attention (large ‖x‖² + ‖y‖²): the normaliser estimate is far off
    cap, _ = _capture(n=96, std=3.0, seed=1)
    f = bench.layer_figures(cap, ["favor+"], num_features=256, window=8, sinks=1, seed=0, layer=0)
    assert f["exponent"] > 50 and f["zrel_favor+"] > 0.5
