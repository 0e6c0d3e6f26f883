"""benchmarks/transfer_step.py: a bad block layout fails before loading anything; a short real run
on SmolLM2 prints one JSON line per repeat with the capture and one fit time per query block."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "transfer_step.py"


def test_context_not_a_multiple_of_queries_is_a_value_error():
    out = subprocess.run([sys.executable, str(_PATH), "--context", "300", "--queries", "256"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ValueError: --context (300) must be a multiple of --queries (256)" in out.stderr


@pytest.mark.slow
def test_short_run_reports_every_block():
    out = subprocess.run([sys.executable, str(_PATH), "--context", "256", "--queries", "128", "--repeats", "1"], capture_output=True, text=True, timeout=600, check=True)
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert len(rows) == 1 and len(rows[0]["fit_s"]) == 2 and rows[0]["capture_s"] > 0
    assert rows[0]["seconds_per_sequence_by_blocks"]["2"] > rows[0]["seconds_per_sequence_by_blocks"]["1"]
