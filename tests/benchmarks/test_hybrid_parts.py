"""benchmarks/hybrid_parts.py: a too-short N is a ValueError; a small real run times every piece
of the recomputing hybrid and leaves the module's helpers as they were."""

import json
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "hybrid_parts.py"


def test_short_n_is_a_value_error():
    out = subprocess.run([sys.executable, str(_PATH), "--n", "64"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ValueError: --n must be > 64" in out.stderr


def test_small_run_times_the_pieces():
    sys.path.insert(0, str(_PATH.parent))
    try:
        import hybrid_parts
    finally:
        sys.path.pop(0)
    from hf_rfa.ops.hybrid import function as hr

    before = {name: getattr(hr, name) for name in hybrid_parts.PARTS}
    row = hybrid_parts.measure(192, repeats=1)
    assert {name: getattr(hr, name) for name in hybrid_parts.PARTS} == before
    assert row["n"] == 192 and row["ms_per_call"] > row["backward_ms"] > 0
    for part in ("feature_unit", "band_unit", "autograd.grad", "scatter_band_grads"):
        assert row["parts_ms"][part] > 0
    json.dumps(row)
