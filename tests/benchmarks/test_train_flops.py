"""benchmarks/train_flops.py: the CPU flash-attention ops are counted with torch's formulas (the
original's SDPA FLOPs equal 4·H·N²·D forward + torch's backward count), the converted model has no
SDPA, a layer's FLOPs extrapolate (1 layer + 29 × the per-layer difference), and the table renders."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_flops.py"


@pytest.fixture(scope="module")
def tf():
    sys.path.insert(0, str(_PATH.parent))
    spec = importlib.util.spec_from_file_location("train_flops", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_flash_attention_is_counted(tf):
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.randn(1, 9, 64, 32, requires_grad=True)
    k = torch.randn(1, 3, 64, 32, requires_grad=True)
    v = torch.randn(1, 3, 64, 32, requires_grad=True)
    counter = FlopCounterMode(display=False, custom_mapping=tf._sdpa_cpu_formulas())
    with counter:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        fwd = counter.get_total_flops()
        out.sum().backward()
    assert fwd == 4 * 9 * 64 * 64 * 32  # QKᵀ and PV, every score (the formula ignores causality)
    assert counter.get_total_flops() > 3 * fwd  # backward (with its recomputation) counted too
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    assert any("flash_attention_for_cpu" in op for op in ops), ops  # the formulas this script adds


@pytest.mark.slow
def test_small_model_counts(tf):
    n = 128
    one, two = tf.step_flops("original", n, 1, "main"), tf.step_flops("original", n, 2, "main")
    assert one["sdpa"] > 0 and two["sdpa"] == 2 * one["sdpa"]
    conv = tf.model_flops("converted", n, "main", layers=3)
    assert conv["sdpa"] == 0 and conv["causal"] == conv["total"]
    c1 = tf.step_flops("converted", n, 1, "main")
    assert math.isclose(conv["total"], c1["total"] + 2 * conv["per_layer"])
    orig = tf.model_flops("original", n, "main", layers=3)
    assert math.isclose(orig["causal"], orig["total"] - orig["sdpa"] / 2)
    row = {"n": n, "original": orig, "converted": conv, "ratio": orig["causal"] / conv["total"], "measured": None}
    md = tf.render([row], "main")
    assert f"| {n} |" in md and "FLOP ratio" in md
