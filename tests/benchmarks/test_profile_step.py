"""benchmarks/profile_step.py: bad arguments fail before loading anything; a real (short) profile
of the converted SmolLM2 under bf16 autocast (in float32 on a CPU without bf16 matrix units, where
bf16 is emulated and the bf16 step takes minutes) names the hybrid's autograd function."""

import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_step.py"


def test_bad_arguments_are_value_errors():
    out = subprocess.run([sys.executable, str(_PATH), "--n", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ValueError: need n >= 2" in out.stderr
    out = subprocess.run([sys.executable, str(_PATH), "--recipe", "nope"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "recipe must be one of" in out.stderr


@pytest.mark.slow
def test_profile_of_the_converted_step_shows_the_hybrid():
    from hf_rfa.recipes.conversion.precision import cpu_has_fast_bf16

    dtype = "bf16" if cpu_has_fast_bf16() else "fp32"
    out = subprocess.run([sys.executable, str(_PATH), "--n", "128", "--top", "40", "--dtype", dtype], capture_output=True, text=True, timeout=600, check=True)
    assert f"{dtype}, N=128" in out.stdout and "tok/s" in out.stdout and "HybridFunction" in out.stdout
