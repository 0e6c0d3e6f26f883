"""research/window_vs_memory/splits.py: its paired ratios are grid_table's on the same kept file."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEPT = ROOT / "research" / "long_range_recall" / "grid_memory1024_w1088.json"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


def test_split_rows_carry_the_ratios_grid_table_computes():
    splits = _module(ROOT / "research" / "window_vs_memory" / "splits.py")
    grid = _module(ROOT / "benchmarks" / "grid_table.py")
    rows = [splits.load(f"mem={KEPT}#recipe, memory 1024"), splits.load(f"win={KEPT}#window-only W1088")]
    table = splits.render(rows, "win").splitlines()
    assert len(table) == 4 and table[3].startswith("| win | 16.96 | 17.51 | 23.97 | 24.03 |")
    mem, win = rows[0][1], rows[1][1]
    for text in ("wikipedia:eval", "bbc_news:test"):
        for ctx in ("4096", "8192"):
            ratio, ci = grid._ratio(mem["texts"][text]["perplexity"][ctx], win["texts"][text]["perplexity"][ctx])
            assert f"({ratio:.3f} [{ci[0]:.3f}, {ci[1]:.3f}])" in table[2]
    assert "100 / 80 / 10 / 0 %" in table[2] and "9.14 [5.73, 13.60]" in table[2]
    with pytest.raises(ValueError, match="no model"):
        splits.load(f"x={KEPT}#nobody")
    with pytest.raises(ValueError, match="none of the labels"):
        splits.render(rows, "other")
