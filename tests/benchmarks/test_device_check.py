"""scripts/device_check.sh with ``--cpu-smoke``: the device check's whole Python part runs end to
end on tiny sizes on the CPU and writes its tables, with the rows a CPU cannot answer recorded as
failures rather than aborting the run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_writes_every_table(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path), "--cpu-smoke"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "- benchmarks: ok" in summary, summary + (tmp_path / "benchmarks.log").read_text()
    tables = {name: (tmp_path / name).read_text() for name in ("twins.md", "layer.md", "prefill.md", "decode.md", "profile.md")}
    for name, text in tables.items():
        assert "Device: CPU" in text and "|---|" in text, name
    twins = tables["twins.md"]
    assert "| torch | torch | float32 | 0 | 0 |" in twins  # the reference against itself
    assert "| flex |  | float32 | failed: ValueError: backend='flex' needs a CUDA device for gradients" in twins
    for n in ("128", "256"):
        row = next(line for line in tables["layer.md"].splitlines() if line.startswith(f"| {n} |"))
        assert "failed" not in row and "skipped" not in row, row
    row = next(line for line in tables["prefill.md"].splitlines() if line.startswith("| 128 |"))
    assert "failed" not in row and "skipped" not in row, row
    prof = tables["profile.md"].splitlines()
    assert any(line.startswith("| all ") for line in prof) and not any("failed" in line for line in prof), prof
    decode = [line for line in tables["decode.md"].splitlines() if "Cache |" in line]
    assert len(decode) == 4 and not any("failed" in line for line in decode), decode


def test_sections_pick_tables_and_bad_names_are_one_line_errors(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "benchmarks" / "device_check.py")
    run = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--cpu-smoke", "--sections", "layer"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer.md"]
    bad = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--cpu-smoke", "--sections", "layer,speed"], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "unknown section 'speed'; allowed: layer, prefill, decode, profile, twins" in bad.stderr
