"""benchmarks/train_step.py: a real training-step case runs (plain and with gradient checkpointing,
which must give the same loss) and the table pairs original and converted rows."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "train_step.py"
_spec = importlib.util.spec_from_file_location("train_step_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.slow
def test_child_case_with_and_without_gradient_checkpointing():
    rows = {}
    for dt in ("fp32", "fp32-ckpt"):
        out = subprocess.run([sys.executable, str(_PATH), "--child", "converted", "128", dt, "--threads", "1"], capture_output=True, text=True, timeout=600, check=True)
        rows[dt] = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert all(r["tok_s"] > 0 and r["peak_rss_gib"] > 0 for r in rows.values())
    assert abs(rows["fp32"]["loss"] - rows["fp32-ckpt"]["loss"]) < 1e-4  # recomputation changes nothing


@pytest.mark.slow
@pytest.mark.skipif(not __import__("hf_rfa.recipes.conversion.precision", fromlist=["x"]).cpu_has_fast_bf16(), reason="bf16 is emulated (slow) on CPUs without AVX-512 BF16 / AMX")
def test_child_case_under_bf16_autocast_with_and_without_gradient_checkpointing():
    rows = {}
    for dt in ("bf16", "bf16-ckpt"):
        out = subprocess.run([sys.executable, str(_PATH), "--child", "converted", "128", dt, "--threads", "1"], capture_output=True, text=True, timeout=600, check=True)
        rows[dt] = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert all(r["tok_s"] > 0 and r["dtype"] == dt for dt, r in rows.items())
    assert abs(rows["bf16"]["loss"] - rows["bf16-ckpt"]["loss"]) < 1e-4  # the same autocast forward either way


def test_render_pairs_original_and_converted_per_dtype():
    rows = [
        {"model": "original", "n": 4096, "dtype": "fp32-ckpt", "threads": 2, "tok_s": 40.0, "peak_rss_gib": 8.0, "load_avg_1m": 1.0, "tok_per_cpu_s": 20.0},
        {"model": "converted", "n": 4096, "dtype": "fp32-ckpt", "threads": 2, "tok_s": 60.0, "peak_rss_gib": 6.0, "load_avg_1m": 1.0, "tok_per_cpu_s": 30.0},
        {"model": "converted", "n": 16384, "dtype": "fp32-ckpt", "error": "killed (out of memory?)"},
    ]
    table = bench.render(rows)
    assert "| 4096 | fp32-ckpt | 2 | 40 | 60 | 1.50× | 8.0 | 6.0 | 0.75× |" in table
    assert "| 16384 | fp32-ckpt | — | — | killed (out of memory?) | — |" in table


def test_unknown_recipe_is_a_value_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"recipe must be one of \['favor256', 'main'\]"):
        bench.main(["--recipe", "favor", "--render-only"])


def test_recipes_build_valid_configs():
    import hf_rfa

    for name, kw in bench.RECIPES.items():
        cfg = hf_rfa.RFAConfig(**kw)
        assert cfg.feature_map == kw["feature_map"] and name in bench.RECIPE_NAMES and name in bench.DEFAULT_OUT
    assert bench.RECIPES["main"]["feature_input"] == "unrotated"


def test_mmap_threshold_rows_are_kept_apart_and_labelled():
    base = {"threads": 2, "load_avg_1m": 1.0, "tok_per_cpu_s": 20.0}
    rows = [
        {"model": "original", "n": 2048, "dtype": "fp32", "tok_s": 100.0, "peak_rss_gib": 5.0, **base},
        {"model": "converted", "n": 2048, "dtype": "fp32", "tok_s": 80.0, "peak_rss_gib": 6.0, **base},
        {"model": "original", "n": 2048, "dtype": "fp32", "mmap_threshold": 131072, "tok_s": 90.0, "peak_rss_gib": 4.0, **base},
        {"model": "converted", "n": 2048, "dtype": "fp32", "mmap_threshold": 131072, "tok_s": 45.0, "peak_rss_gib": 4.4, **base},
    ]
    table = bench.render(rows)
    assert "| 2048 | fp32 | 2 | 100 | 80 | 0.80× | 5.0 | 6.0 | 1.20× |" in table
    assert "| 2048 | fp32, MALLOC_MMAP_THRESHOLD_=131072 | 2 | 90 | 45 | 0.50× | 4.0 | 4.4 | 1.10× |" in table


def test_run_case_passes_the_mmap_threshold_to_the_child(monkeypatch):
    seen = {}

    class Done:
        returncode, stdout, stderr = 0, '{"model": "converted", "n": 8, "dtype": "fp32"}\n', ""

    def fake_run(cmd, **kw):
        seen.update(kw["env"])
        return Done()

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    r = bench.run_case("converted", 8, "fp32", 1, 10.0, mmap_threshold=131072)
    assert seen["MALLOC_MMAP_THRESHOLD_"] == "131072" and r["mmap_threshold"] == 131072
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    seen.clear()
    assert bench.run_case("converted", 8, "fp32", 1, 10.0)["mmap_threshold"] is None and "MALLOC_MMAP_THRESHOLD_" not in seen


def test_release_loss_rows_are_kept_apart_and_labelled():
    base = {"threads": 2, "load_avg_1m": 1.0, "tok_per_cpu_s": 20.0}
    rows = [
        {"model": "original", "n": 2048, "dtype": "fp32", "tok_s": 100.0, "peak_rss_gib": 5.0, **base},
        {"model": "converted", "n": 2048, "dtype": "fp32", "tok_s": 80.0, "peak_rss_gib": 6.0, **base},
        {"model": "original", "n": 2048, "dtype": "fp32", "release_loss": True, "tok_s": 100.0, "peak_rss_gib": 5.0, **base},
        {"model": "converted", "n": 2048, "dtype": "fp32", "release_loss": True, "tok_s": 80.0, "peak_rss_gib": 5.1, **base},
    ]
    table = bench.render(rows)
    assert "| 2048 | fp32 | 2 | 100 | 80 | 0.80× | 5.0 | 6.0 | 1.20× |" in table
    assert "| 2048 | fp32, loss released after backward | 2 | 100 | 80 | 0.80× | 5.0 | 5.1 | 1.02× |" in table


def test_run_case_passes_release_loss_to_the_child(monkeypatch):
    seen = []

    class Done:
        returncode, stdout, stderr = 0, '{"model": "converted", "n": 8, "dtype": "fp32", "release_loss": true}\n', ""

    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or Done())
    assert bench.run_case("converted", 8, "fp32", 1, 10.0, release_loss=True)["release_loss"] is True
    bench.run_case("converted", 8, "fp32", 1, 10.0)
    assert "--release-loss" in seen[0] and "--release-loss" not in seen[1]


@pytest.mark.slow
def test_child_case_with_the_loss_released_gives_the_same_loss():
    rows = {}
    for flag in ([], ["--release-loss"]):
        out = subprocess.run([sys.executable, str(_PATH), "--child", "converted", "128", "fp32", "--threads", "1", *flag], capture_output=True, text=True, timeout=600, check=True)
        rows[bool(flag)] = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert rows[True]["release_loss"] is True and rows[False]["release_loss"] is False
    assert rows[True]["loss"] == rows[False]["loss"]  # the same computation; only what stays alive differs
