"""benchmarks/layer_train_cost.py: an N inside the window is a ValueError; a small real run times
the recipe's op, its band alone and SDPA, forward and backward, with ratios to SDPA."""

import json
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "layer_train_cost.py"


def test_n_inside_the_window_is_a_value_error():
    out = subprocess.run([sys.executable, str(_PATH), "--n", "64"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "ValueError: --n must be > the recipe's window 64" in out.stderr


def test_small_run_prints_every_case(capsys):
    sys.path.insert(0, str(_PATH.parent))
    try:
        import layer_train_cost
    finally:
        sys.path.pop(0)
    layer_train_cost.main(["--n", "160", "--rounds", "1", "--threads", "1", "--dtype", "fp32", "--pytorch-band"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["n"] == 160 and row["dtype"] == "fp32"
    assert set(row["ms"]) == {"recipe", "recipe, PyTorch band", "band only", "sdpa"}
    for case in row["ms"].values():
        assert case["fwd"] > 0 and case["bwd"] > 0
    assert row["fwd_bwd_vs_sdpa"]["sdpa"] == 1.0 and row["fwd_bwd_vs_sdpa"]["recipe"] > 0
