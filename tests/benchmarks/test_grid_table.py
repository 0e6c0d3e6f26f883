"""benchmarks/grid_table.py: the side-by-side table of three models' evaluation grids, its paired
ratios and goal lines follow from the numbers, the kept commands reproduce the kept settings, and
docs/conversion.md holds the table rendered from the kept results file."""

import importlib.util
import json
import math
import shlex
from pathlib import Path

import pytest

from hf_rfa.recipes.intervals import bootstrap_ci, copy_ci, perplexity_ci, ratio_ci

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("grid_table_bench", ROOT / "benchmarks" / "grid_table.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TEXTS = ("wikipedia:eval", "bbc_news:test")
GRID = {"texts": list(TEXTS), "contexts": [4096, 8192], "max_tokens": 400, "gaps": [512, 3584], "passage": 256, "draws": 4,
        "lengths": [1024], "depths": [0.5], "trials": 10, "fillers": ["natural"], "filler_text": "wikipedia:eval"}


def _ppl(nll_per_token: list[float], tokens: int = 100) -> dict:
    window_nll = [x * tokens for x in nll_per_token]
    window_tokens = [tokens] * len(nll_per_token)
    return {"perplexity": math.exp(sum(nll_per_token) / len(nll_per_token)), "ci95": perplexity_ci(window_nll, window_tokens),
            "windows": len(nll_per_token), "tokens": tokens * len(nll_per_token), "window_nll": window_nll, "window_tokens": window_tokens}


def _copy(draw_nll: list[float]) -> dict:
    return {"first": 20.0, "second": math.exp(sum(draw_nll) / len(draw_nll)), "first_ci95": None, "second_ci95": copy_ci(draw_nll)}


def _passkey(hits: list[int]) -> dict:
    mean = sum(hits) / len(hits)
    ci = bootstrap_ci([float(h) for h in hits])
    return {"natural": {"mean": {"1024": mean}, "mean_ci95": {"1024": ci}, "key_mean": {"1024": mean}, "key_mean_ci95": {"1024": ci},
                        "filler": "natural (wikipedia:eval)"}}


def _result(ppl: list[float], copy512: list[float], copy3584: list[float], hits: list[int]) -> dict:
    """A grid result whose perplexity windows all have ``ppl`` NLL per token (the same on both texts and contexts)."""
    texts = {t: {"tokens": 10_000, "perplexity": {str(c): _ppl(ppl) for c in GRID["contexts"]},
                 "copy": {"512": _copy(copy512), "3584": _copy(copy3584)}} for t in TEXTS}
    return {"task": "grid", "name": "full", "model": "m", "grid": GRID, "seed": 0, "texts": texts, "passkey": _passkey(hits), "minutes": 2.0}


def _data(recipe_ppl: list[float], recipe_hits: list[int], original_hits: list[int] | None = None,
          original_ppl: list[float] | None = None) -> dict:
    window_ppl = [3.0, 2.0, 3.4, 2.6]
    results = {"original": _result(original_ppl or [2.9, 1.9, 3.3, 2.5], [0.2] * 4, [0.9, 1.0, 1.1, 1.0], original_hits or [1] * 10),
               "recipe": _result(recipe_ppl, [1.0, 1.1, 1.05, 1.0], [1.2, 1.9, 1.4, 1.8], recipe_hits),
               "window-only W320": _result(window_ppl, [3.0] * 4, [3.1] * 4, [0] * 10)}
    models = {m: {"model": m, "command": f"hf-rfa-evaluate --model {m} --grid full", "minutes": 2.0, "result": r} for m, r in results.items()}
    return {"cpu": "test CPU", "threads": 1, "hf_rfa": "0", "note": "", "models": models}


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_render_puts_each_figure_with_its_interval_and_the_paired_ratios():
    data = _data([2.95, 1.95, 3.35, 2.55], [1] * 10)
    text = bench.render(data)
    row = _line(text, "| perplexity @4,096, `bbc_news:test` (4 windows) |")
    recipe = data["models"]["recipe"]["result"]["texts"]["bbc_news:test"]["perplexity"]["4096"]
    assert recipe["perplexity"] == pytest.approx(math.exp(2.7))
    assert f"| {recipe['perplexity']:.2f} [{recipe['ci95'][0]:.2f}, {recipe['ci95'][1]:.2f}] |" in row
    # every window 0.05 nats above the original's and 0.05 below the window-only's: the paired ratio has no spread
    assert row.endswith(f"| {math.exp(0.05):.3f} [{math.exp(0.05):.3f}, {math.exp(0.05):.3f}] | {math.exp(-0.05):.3f} [{math.exp(-0.05):.3f}, {math.exp(-0.05):.3f}] |")
    copy = _line(text, "| copy, gap 512, `wikipedia:eval`: 2nd (1st) |")
    assert f"| {math.exp(1.0375):.2f} [" in copy and "(20.0)" in copy and f"| {math.exp(0.2):.2f} [{math.exp(0.2):.2f}, {math.exp(0.2):.2f}] (20.0) |" in copy
    assert _line(text, "| passkey @1,024, natural filler: digits / exact |") == (
        "| passkey @1,024, natural filler: digits / exact | 100% [100%, 100%] / 100% [100%, 100%] | 100% [100%, 100%] / 100% [100%, 100%] "
        "| 0% [0%, 0%] / 0% [0%, 0%] |  |  |")
    assert "10 trials at each depth of 50%" in text and "test CPU, 1 thread" in text


def test_goals_follow_the_intervals():
    text = bench.render(_data([2.95, 1.95, 3.35, 2.55], [1] * 10))
    assert "- copy at gap 512 at most 3, `wikipedia:eval`: **met** — recipe 2.82 [" in text
    assert "- copy at gap 3,584 at most 5, `bbc_news:test`: **not met** (the interval straddles the bound) — recipe" in text
    assert "- passkey digits (natural filler) at 1,024 tokens at least 90%: **met** — recipe 100% [100%, 100%] (10 trials × 1 depth)" in text
    # 0.05 nats over the original on every window: 1.051 × the original, above the 1.05 bound
    assert ("- perplexity at 4,096, `bbc_news:test`, at most 1.05 × the original's: **not met** — recipe ÷ original "
            f"{math.exp(0.05):.3f}") in text
    assert "`wikipedia:eval`, at most 1.05 × the original's" not in text  # judged on the held-out domain only
    # below the window-only baseline on every window, yet the two models' own intervals overlap
    assert "- perplexity at 8,192, `wikipedia:eval`, at most the window-only W320's: **met by the paired interval only**" in text


def test_goals_fail_where_the_recipe_falls_behind():
    text = bench.render(_data([3.1, 1.98, 3.5, 2.6], [1] * 8 + [0] * 2))
    assert "at 1,024 tokens at least 90%: **not met** (the interval reaches below it) — recipe 80% [" not in text
    assert "at 1,024 tokens at least 90%: **not met** — recipe 80% [" in text
    assert "at most the window-only W320's: **not met** (the paired interval straddles the bound)" in text
    met = bench.render(_data([2.80, 1.80, 3.20, 2.40], [1] * 9 + [0]))
    assert "at 1,024 tokens at least 90%: **not met** (the interval reaches below it) — recipe 90% [" in met
    assert "at most 1.05 × the original's: **met by the paired interval only** (the models' own intervals overlap) — recipe ÷ original 0.905" in met
    # equal windows: no spread in either model's perplexity, so their own intervals separate too
    flat = bench.render(_data([2.0] * 4, [1] * 10, original_ppl=[2.5] * 4))
    assert f"- perplexity at 8,192, `bbc_news:test`, at most 1.05 × the original's: **met** — recipe ÷ original {math.exp(-0.5):.3f}" in flat


def test_passkey_goal_is_the_original_s_where_lower():
    text = bench.render(_data([2.95, 1.95, 3.35, 2.55], [1] * 10, original_hits=[1] * 5 + [0] * 5))
    assert "at 1,024 tokens at least the original's 50%: **met** — recipe 100%" in text


def test_render_refuses_models_on_different_grids():
    data = _data([2.95, 1.95, 3.35, 2.55], [1] * 10)
    data["models"]["recipe"]["result"]["grid"] = {**GRID, "draws": 8}
    with pytest.raises(ValueError, match="different grids"):
        bench.render(data)


def test_collect_keeps_portable_commands_that_reproduce_the_settings(tmp_path):
    flags = ("--grid full --contexts 4096 8192 --max-tokens 400 --gaps 512 3584 --draws 4 --lengths 1024 --depths 0.5 "
             "--trials 10 --fillers natural")
    assert bench.grid_of_flags(flags) == GRID
    data = _data([2.95, 1.95, 3.35, 2.55], [1] * 10)
    specs = []
    for label, m in data["models"].items():
        path = tmp_path / "runs" / f"{label.split()[0]}.json"
        path.parent.mkdir(exist_ok=True)
        rfa = {"rfa": {"window": 1088, "memory_per_layer": [3, 5], "checkpoint_blocks": False}} if label.startswith("window") else {}
        path.write_text(json.dumps({**m["result"], **rfa, "model": str(tmp_path / "checkout" / "out" / label.split()[0])}))
        specs.append(f"{label}={path}")
    kept = bench.collect(specs, flags, str(tmp_path / "kept.json"), aliases={str(tmp_path / "checkout" / "out"): "out", str(tmp_path): "here"})
    assert kept["models"]["recipe"]["command"] == f"hf-rfa-evaluate --model out/recipe {flags} --output here/runs/recipe.json"
    (window,) = [m["command"] for label, m in kept["models"].items() if label.startswith("window")]
    assert window.startswith("hf-rfa-evaluate --model out/window-only --rfa window=1088 memory_per_layer=3,5 checkpoint_blocks=false --grid full")
    assert kept["models"]["recipe"]["result"]["model"] == "out/recipe" and str(tmp_path) not in (tmp_path / "kept.json").read_text()
    with pytest.raises(ValueError, match="not the grid of the flags"):
        bench.collect(specs, flags.replace("--draws 4", "--draws 8"), str(tmp_path / "other.json"))


def test_the_cpu_line_names_each_models_threads_where_they_differ(tmp_path):
    """collect keeps each model's torch threads from its result; the table says one count where all
    agree, else each model's ("not recorded" for a result from before the record)."""
    data = _data([2.95, 1.95, 3.35, 2.55], [1] * 10)
    assert "test CPU, 1 thread, float32" in bench.render(data)  # an older kept file: one int
    flags = ("--grid full --contexts 4096 8192 --max-tokens 400 --gaps 512 3584 --draws 4 --lengths 1024 --depths 0.5 "
             "--trials 10 --fillers natural")
    specs = []
    for (label, m), threads in zip(data["models"].items(), (None, 2, 2)):
        path = tmp_path / f"{label.split()[0]}.json"
        path.write_text(json.dumps({**m["result"], **({"threads": threads} if threads else {})}))
        specs.append(f"{label}={path}")
    kept = bench.collect(specs, flags, str(tmp_path / "kept.json"))
    assert kept["threads"] == {"original": None, "recipe": 2, "window-only W320": 2}
    assert "threads: original not recorded, recipe 2, window-only W320 2, float32" in bench.render(kept)
    kept = bench.collect(specs[1:] + specs[1:2], flags, str(tmp_path / "kept2.json"))
    assert kept["threads"] == {"recipe": 2, "window-only W320": 2}
    assert ", 2 threads, float32" in bench.render({**kept, "models": {**kept["models"], "x": kept["models"]["recipe"]}})


def test_docs_page_holds_the_table_rendered_from_the_kept_results_file():
    """docs/conversion.md's grid table is the rendering of the kept file, byte for byte
    (``python benchmarks/grid_table.py --docs`` regenerates it), and every kept command runs the
    settings its result holds."""
    page = (ROOT / bench.DOCS_PAGE).read_text(encoding="utf-8")
    assert bench.docs_section(ROOT) in page, "docs/conversion.md's grid table is stale: run `python benchmarks/grid_table.py --docs`"
    data = json.loads((ROOT / bench.RESULTS_FILE).read_text())
    assert list(data["models"]) == ["original", "recipe", "window-only W320"]
    for m in data["models"].values():
        argv = shlex.split(m["command"])
        assert argv[:3] == ["hf-rfa-evaluate", "--model", m["model"]] and argv[-2] == "--output"
        assert bench.grid_of_flags(shlex.join(argv[3:-2])) == m["result"]["grid"]


def test_collect_keeps_a_model_from_a_kept_results_file(tmp_path):
    """``LABEL=KEPT.json`` (a file an earlier collect wrote) keeps that model's result, command, CPU and
    threads as they stand there, next to models read from new results; the kept model must have run
    the flags' grid, and a label the file does not hold is refused by name."""
    flags = ("--grid full --contexts 4096 8192 --max-tokens 400 --gaps 512 3584 --draws 4 --lengths 1024 --depths 0.5 "
             "--trials 10 --fillers natural")
    old = _data([2.95, 1.95, 3.35, 2.55], [1] * 10)  # an older kept file: one CPU, threads one int
    old["models"]["original"]["command"] = "hf-rfa-evaluate --model ORIGINAL ..."
    (tmp_path / "kept.json").write_text(json.dumps(old))
    specs = [f"original={tmp_path / 'kept.json'}"]
    for label in ("recipe", "window-only W320"):
        path = tmp_path / f"{label.split()[0]}.json"
        path.write_text(json.dumps({**old["models"][label]["result"], "threads": 2}))
        specs.append(f"{label}={path}")
    new = bench.collect(specs, flags, str(tmp_path / "new.json"))
    assert list(new["models"]) == ["original", "recipe", "window-only W320"]
    assert new["models"]["original"]["command"] == "hf-rfa-evaluate --model ORIGINAL ..."
    assert new["models"]["original"]["result"]["texts"] == old["models"]["original"]["result"]["texts"]
    assert new["threads"] == {"original": 1, "recipe": 2, "window-only W320": 2}
    assert new["models"]["original"]["cpu"] == "test CPU" and new["models"]["recipe"]["cpu"] == bench.cpu_name()
    text = bench.render(new)
    assert "threads: original 1, recipe 2, window-only W320 2" in text
    if bench.cpu_name() != "test CPU":
        assert f"CPU: original: test CPU; recipe: {bench.cpu_name()}" in text
    with pytest.raises(ValueError, match="holds no model 'baseline'"):
        bench.collect([f"baseline={tmp_path / 'kept.json'}"], flags, str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="not the grid of the flags"):
        bench.collect(specs[:1], flags.replace("--draws 4", "--draws 8"), str(tmp_path / "x.json"))
