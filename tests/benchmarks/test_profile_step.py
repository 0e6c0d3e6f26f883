"""benchmarks/profile_step.py: bad arguments fail before loading anything; a real (short) profile
of the converted SmolLM2 under bf16 autocast names the hybrid's autograd function."""

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
def test_profile_of_the_converted_bf16_step_shows_the_hybrid():
    out = subprocess.run([sys.executable, str(_PATH), "--n", "128", "--top", "40", "--dtype", "bf16"], capture_output=True, text=True, timeout=600, check=True)
    assert "bf16, N=128" in out.stdout and "tok/s" in out.stdout and "HybridFunction" in out.stdout
