"""``--help`` of every script in conversion/, training/, benchmarks/ and research/<question>/ exits 0 and prints usage.

Run in-process (``runpy`` as ``__main__``) so the heavy imports are paid once for all scripts.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("conversion", "training", "benchmarks", "research/*") for p in ROOT.glob(f"{d}/*.py"))


def test_scripts_found():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None), out
    assert "usage" in out.lower(), out[:500]
