"""benchmarks/saved_activations.py: bad arguments are refused before anything loads (what the
model keeps under autocast is tested on a tiny model in tests/ops/test_autocast.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(_DIR))
_spec = importlib.util.spec_from_file_location("saved_activations_bench", _DIR / "saved_activations.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("args, field", [(["--autocast", "fp16"], "autocast"), (["--recipe", "nope"], "recipe")])
def test_bad_arguments_are_value_errors_naming_the_field(args, field):
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        bench.main(args)
