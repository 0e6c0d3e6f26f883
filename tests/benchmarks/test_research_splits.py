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


def test_induction_split_sizes_and_table(tmp_path):
    """research/window_vs_memory/induction_split.py: sizes keep 320 exact keys per kv head on
    average with the floor in every layer; the table pairs each row with the grid's W320."""
    split = _module(ROOT / "research" / "window_vs_memory" / "induction_split.py")
    model = tmp_path / "model"
    model.mkdir()
    shares = [[0.0, 0.0, 0.0]] * 3 + [[0.3, 0.0, 0.0]]
    (model / "report.json").write_text(__import__("json").dumps({"memory_split": {"induction": shares}}))
    sizes = split.sizes(model, 192, 0.625)
    assert sum(sizes) == 128 * 4 and sizes[:3] == [80, 80, 80] and sizes[3] == 512 - 240
    assert split.sizes(model, 320, 0.625) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="--window must be in"):
        split.sizes(model, 321, 0.625)
    with pytest.raises(ValueError, match="has no report.json"):
        split.sizes(tmp_path, 192, 0.625)
    grid = __import__("json").loads(split.GRID.read_text())
    w320 = grid["models"]["window-only W320"]["result"]["texts"]["wikipedia:eval"]["perplexity"]["4096"]
    run = tmp_path / "run.json"
    run.write_text(__import__("json").dumps({"task": "perplexity", **w320}))
    rows = split.collect([f"same as W320@wikipedia:eval={run}"], tmp_path / "kept.json")
    table = split.render(rows, grid).splitlines()
    assert table[0] == "wikipedia:eval:" and not any(line.startswith("bbc_news") for line in table)  # only the measured texts
    assert table[4].startswith("| W64 + memory 256 (the grid's recipe row) |")
    assert "| same as W320 | " in table[5] and "| 1.000 [1.000, 1.000] |" in table[5]
    with pytest.raises(ValueError, match="LABEL@TEXT=FILE.json"):
        split.collect([f"nolabel={run}"], tmp_path / "kept.json")
