"""benchmarks/lora_stage_memory.py: bad arguments are refused before anything loads."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_stage_memory.py"
_spec = importlib.util.spec_from_file_location("lora_stage_memory_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_src_without_hf_rfa_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="--src must be a checkout with hf_rfa/__init__.py"):
        bench.main(["--src", str(tmp_path)])


@pytest.mark.parametrize("args", [["--steps", "0"], ["--context", "1"]])
def test_non_positive_sizes_are_value_errors(args):
    with pytest.raises(ValueError, match="steps must be >= 1 and context >= 2"):
        bench.main(args)
