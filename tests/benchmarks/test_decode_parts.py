"""benchmarks/decode.py: the cache bytes by part add up to the cache's bytes; the recipe keeps no
un-rotated copies of its keys, only the rotations of its buffer's positions, once."""

import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _decode():
    spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "benchmarks" / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["decode_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_state_parts_add_up_to_the_cache_bytes():
    d = _decode()
    names = ["rfa hedgehog m=64 W=64 S=4 decay=128 unrotated memory=128 feature_error", "window-only W=64 S=4 memory=128"]
    models = d.build_models(1, names)
    ids = torch.randint(0, 49152, (1, 300), generator=torch.Generator().manual_seed(0))
    parts = {}
    with torch.inference_mode():
        for name in names:
            cache, _, _ = d.prefill(models[name], ids, 128)
            parts[name] = d.state_parts(cache)
            assert sum(parts[name].values()) == cache.nbytes()
        assert d.state_parts(d.prefill(models["softmax sdpa + DynamicCache"], ids, 128)[0]) == {}
    recipe, window = parts[names[0]], parts[names[1]]
    # 128 memory keys + the buffer, each key and value 64 float32 per kv head (3)
    assert recipe["exact keys and values"] == window["exact keys and values"] >= 2 * 3 * 128 * 64 * 4
    assert recipe["un-rotated key copies"] == window["un-rotated key copies"] == 0  # derived from the rotated keys
    assert recipe["rotary ring"] == 2 * (64 + 64) * 64 * 4 and window["rotary ring"] == 0  # cos, sin of W + memory_every positions, once
    assert recipe["feature state"] >= 3 * 128 * 64 * 4 and window["feature state"] == 0
