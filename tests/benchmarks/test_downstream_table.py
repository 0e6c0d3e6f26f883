"""benchmarks/downstream_table.py: lm-eval output folders are read per document, the table's
intervals and goal lines follow from the numbers, and docs/lm_eval.md holds the table rendered from
the kept results file."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("downstream_table_bench", ROOT / "benchmarks" / "downstream_table.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _task(correct: list[float], shots: int) -> dict:
    n = len(correct)
    acc = sum(correct) / n
    sd = math.sqrt(sum((c - acc) ** 2 for c in correct) / (n - 1))
    return {"shots": shots, "n": n, "acc": acc, "stderr": sd / math.sqrt(n), "doc_ids": list(range(n)), "correct": correct}


def _data(short_recipe: list[float], many_recipe: list[float], many_window: list[float]) -> dict:
    models = {m: {"commands": [f"hf-rfa-lm-eval --model {m}"], "minutes": 1.0} for m in ("original", "recipe", "window-only W320")}
    short_orig = [1.0] * 8 + [0.0] * 2
    return {"cpu": "test CPU", "hf_rfa": "0", "lm_eval": "0", "note": "", "models": models, "tasks": {
        "rfa_rotten_tomatoes": {"original": _task(short_orig, 8), "recipe": _task(short_recipe, 8), "window-only W320": _task(short_orig, 8)},
        "rfa_rotten_tomatoes_manyshot": {"original": _task(many_recipe, 128), "recipe": _task(many_recipe, 128),
                                         "window-only W320": _task(many_window, 128)},
    }}


def test_interval_is_lm_eval_stderr_times_1_96_clipped():
    assert bench.interval(0.5, 0.1) == pytest.approx((0.304, 0.696))
    assert bench.interval(0.95, 0.05) == pytest.approx((0.852, 1.0))


def test_render_cells_differences_and_goals_follow_the_numbers():
    many_recipe, many_window = [1.0] * 40, [0.0] * 39 + [1.0]
    text = bench.render(_data([1.0] * 8 + [0.0] * 2, many_recipe, many_window))
    row = next(line for line in text.splitlines() if line.startswith("| `rfa_rotten_tomatoes` |"))
    lo, hi = bench.interval(0.8, _task([1.0] * 8 + [0.0] * 2, 8)["stderr"])
    assert f"80.0 [{100 * lo:.1f}, {100 * hi:.1f}]" in row and "| 8 | 10 |" in row and "+0.0 [+0.0, +0.0]" in row
    assert ("`rfa_rotten_tomatoes` (short): recipe at most 2 points below the original — **met** (+0.0 points; "
            "the paired interval rules out a larger loss)") in text
    assert "`rfa_rotten_tomatoes_manyshot` (many-shot): recipe ahead of window-only W320 by more than the intervals — **met**" in text
    many_row = next(line for line in text.splitlines() if line.startswith("| `rfa_rotten_tomatoes_manyshot` |"))
    assert many_row.rstrip(" |").split("| ")[-1].startswith("+97.5")  # recipe − window-only: 1 − 1/40


def test_goals_fail_when_the_recipe_falls_behind():
    text = bench.render(_data([1.0] * 7 + [0.0] * 3, [1.0] * 20 + [0.0] * 20, [1.0] * 19 + [0.0] * 21))
    assert "at most 2 points below the original — **not met** (-10.0 points; the paired interval does not rule out a larger loss)" in text
    assert "by more than the intervals — **not met**" in text


def test_render_refuses_a_task_a_model_did_not_score():
    data = _data([1.0] * 10, [1.0] * 4, [0.0] * 4)
    del data["tasks"]["rfa_rotten_tomatoes"]["recipe"]
    with pytest.raises(ValueError, match="no result for"):
        bench.render(data)


def test_read_lm_eval_folder_merges_runs_by_document(tmp_path):
    sub = tmp_path / "model_dir"
    sub.mkdir()

    def write(stamp: str, task: str, accs: dict[int, float], limit: int | None) -> None:
        cfg = {"model": "hf_rfa", "model_args": "pretrained=x,dtype=float32", "limit": None if limit is None else float(limit)}
        res = {"results": {task: {"acc,none": 0.5, "acc_stderr,none": 0.1}}, "n-shot": {task: 8}, "config": cfg,
               "total_evaluation_time_seconds": "30.0"}
        (sub / f"results_{stamp}.json").write_text(json.dumps(res))
        (sub / f"samples_{task}_{stamp}.jsonl").write_text("".join(json.dumps({"doc_id": i, "acc": a}) + "\n" for i, a in reversed(list(accs.items()))))

    write("2026-01-01T00-00-00.0", "t", {0: 0.0, 1: 0.0}, 2)
    write("2026-01-02T00-00-00.0", "t", {1: 1.0, 3: 1.0}, None)  # --samples: replaces doc 1, adds doc 3
    write("2026-01-02T00-00-01.0", "u", {0: 1.0}, 1)
    run = bench.read_lm_eval_folder(str(tmp_path), aliases={str(tmp_path): "out/lm_eval"})
    t = run["tasks"]["t"]
    assert t["doc_ids"] == [0, 1, 3] and t["correct"] == [0.0, 1.0, 1.0] and t["n"] == 3
    assert t["acc"] == pytest.approx(2 / 3) and t["stderr"] == pytest.approx(_task([0.0, 1.0, 1.0], 8)["stderr"])
    assert run["tasks"]["u"]["shots"] == 8 and run["seconds"] == pytest.approx(90.0)
    assert run["commands"][0] == ("hf-rfa-lm-eval --model hf_rfa --model_args pretrained=x,dtype=float32 --tasks t --limit 2 "
                                  "--device cpu --batch_size 1 --log_samples --output_path out/lm_eval")
    assert """--samples '{"t":[1,3]}'""" in run["commands"][1]


def test_mean_stderr_is_lm_eval_s():
    mean_stderr = pytest.importorskip("lm_eval.api.metrics").mean_stderr

    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert bench.mean_stderr(values) == pytest.approx(mean_stderr(values))


def test_docs_page_holds_the_table_rendered_from_the_kept_results_file():
    """docs/lm_eval.md's downstream table is the rendering of the kept file, byte for byte
    (``python benchmarks/downstream_table.py --docs`` regenerates it)."""
    page = (ROOT / bench.DOCS_PAGE).read_text(encoding="utf-8")
    section = bench.docs_section(ROOT)
    assert section in page, "docs/lm_eval.md's downstream table is stale: run `python benchmarks/downstream_table.py --docs`"
    data = json.loads((ROOT / bench.RESULTS_FILE).read_text())
    assert list(data["models"])[:3] == ["original", "recipe", "window-only W320"]
    from hf_rfa.integrations.lm_eval_tasks import TASKS

    assert set(data["tasks"]) == set(TASKS), "the table covers every offline task"
    for task, per in data["tasks"].items():
        for model, r in per.items():
            assert len(r["correct"]) == r["n"] == len(r["doc_ids"]), (task, model)
            assert sum(r["correct"]) / r["n"] == pytest.approx(r["acc"]), (task, model)


def test_compare_prints_both_accuracies_and_the_paired_difference(tmp_path, capsys):
    """``compare A=FOLDER B=FOLDER --task T``: each model's accuracy and interval, and A − B over
    the shared documents (here A is right on 3 of 4, B on 1: +50 points); a task one folder lacks
    is refused naming the tasks it has."""
    def folder(name: str, accs: list[float]) -> str:
        sub = tmp_path / name / "m"
        sub.mkdir(parents=True)
        res = {"results": {"t": {"acc,none": 0.5}}, "n-shot": {"t": 8}, "config": {"model": "hf", "model_args": "pretrained=x"}}
        (sub / "results_2026-01-01T00-00-00.0.json").write_text(json.dumps(res))
        (sub / "samples_t_2026-01-01T00-00-00.0.jsonl").write_text("".join(json.dumps({"doc_id": i, "acc": a}) + "\n" for i, a in enumerate(accs)))
        return str(tmp_path / name)

    a, b = folder("a", [1.0, 1.0, 1.0, 0.0]), folder("b", [1.0, 0.0, 0.0, 0.0])
    bench.main(["compare", f"A={a}", f"B={b}", "--task", "t"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("- A: 75.0 [") and out[1].startswith("- B: 25.0 [") and out[2].startswith("- A − B: +50.0 [")
    with pytest.raises(SystemExit):
        bench.main(["compare", f"A={a}", f"B={b}", "--task", "missing"])
    assert "has no results for 'missing'" in capsys.readouterr().err


def test_collect_keeps_a_model_from_a_kept_results_file(tmp_path):
    """``LABEL=FILE.json`` takes that model's results, commands and CPU from a results file an earlier
    collect wrote (the original, measured once), next to models read from lm-eval folders; the order
    of the specs stays the table's order, and a label the file does not hold is refused by name."""
    pytest.importorskip("lm_eval")
    kept = tmp_path / "kept.json"
    old = _data([1.0] * 8 + [0.0] * 2, [1.0] * 4, [0.0] * 4)
    old["cpu"] = "an older CPU"
    kept.write_text(json.dumps(old))
    sub = tmp_path / "recipe" / "m"
    sub.mkdir(parents=True)
    res = {"results": {"rfa_rotten_tomatoes": {"acc,none": 0.5}}, "n-shot": {"rfa_rotten_tomatoes": 8},
           "config": {"model": "hf_rfa", "model_args": "pretrained=y", "limit": 3.0}, "total_evaluation_time_seconds": "60"}
    (sub / "results_2026-01-01T00-00-00.0.json").write_text(json.dumps(res))
    (sub / "samples_rfa_rotten_tomatoes_2026-01-01T00-00-00.0.jsonl").write_text(
        "".join(json.dumps({"doc_id": i, "acc": a}) + "\n" for i, a in enumerate([1.0, 0.0, 1.0])))
    out = tmp_path / "new.json"
    data = bench.collect([f"original={kept}", f"recipe={tmp_path / 'recipe'}"], str(out))
    assert list(data["models"]) == ["original", "recipe"]
    assert data["models"]["original"]["commands"] == old["models"]["original"]["commands"]
    assert data["models"]["original"]["cpu"] == "an older CPU" and data["models"]["recipe"]["cpu"] == bench.cpu_name()
    assert data["tasks"]["rfa_rotten_tomatoes"]["original"] == old["tasks"]["rfa_rotten_tomatoes"]["original"]
    assert data["tasks"]["rfa_rotten_tomatoes_manyshot"]["original"]["n"] == 4
    assert data["tasks"]["rfa_rotten_tomatoes"]["recipe"]["correct"] == [1.0, 0.0, 1.0]
    assert json.loads(out.read_text()) == data
    with pytest.raises(ValueError, match="holds no model 'baseline'"):
        bench.collect([f"baseline={kept}"], str(out))


def test_render_names_each_model_s_cpu_where_they_differ():
    data = _data([1.0] * 10, [1.0] * 4, [0.0] * 4)
    assert "CPU: test CPU (float32" in bench.render(data)
    data["models"]["original"]["cpu"] = "CPU A"
    for m in ("recipe", "window-only W320"):
        data["models"][m]["cpu"] = "CPU B"
    assert "CPU: original: CPU A; recipe: CPU B; window-only W320: CPU B (float32" in bench.render(data)


def test_a_samples_run_from_the_first_document_is_named_by_samples():
    """A run given ``--samples`` 0..n-1 of a larger task (no ``--limit``) is kept with ``--samples``: the
    command must not score the whole task; a run that scored every document needs neither."""
    cfg = {"model": "hf_rfa", "model_args": "pretrained=x", "limit": None}
    cmd = bench._command(cfg, {"t": [0, 1, 2]}, "out", sizes={"t": 10})
    assert """--samples '{"t":"0-2"}'""" in cmd
    assert "--samples" not in bench._command(cfg, {"t": [0, 1, 2]}, "out", sizes={"t": 3})


def test_kept_commands_name_their_documents_as_ranges_that_expand_to_what_was_scored():
    """The kept file's ``--samples`` are the short form, and expanding each gives the documents its
    run scored: a command copied from docs/lm_eval.md scores the same documents."""
    import shlex

    from hf_rfa.integrations.lm_eval_samples import expand_samples

    data = json.loads((bench.ROOT / bench.RESULTS_FILE).read_text())
    seen = 0
    for label, model in data["models"].items():
        for cmd in model["commands"]:
            parts = shlex.split(cmd)
            if "--samples" not in parts:
                continue
            value = parts[parts.index("--samples") + 1]
            assert len(value) < 200, value
            tasks = json.loads(expand_samples(value))
            assert set(tasks) == set(parts[parts.index("--tasks") + 1].split(","))
            for t, ids in tasks.items():
                assert ids and set(ids) <= set(data["tasks"][t][label]["doc_ids"]), (label, t)
            seen += 1
    assert seen >= 10
