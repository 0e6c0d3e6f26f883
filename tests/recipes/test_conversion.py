"""The conversion pipeline (hf_rfa.recipes.conversion.pipeline, conversion/*.py) on tiny models built in code.

A tiny Llama / GPT-2 / BERT with a word-level tokenizer is saved to a temp folder; the scripts run
end to end on it. One ``slow`` test converts the real SmolLM2-135M (quick settings).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

import hf_rfa
from hf_rfa.cli import config_from_args
from hf_rfa.recipes.conversion import pipeline
from conversion_runs import ROOT, WORDS, conversion_args, conversion_script, installed_command, tiny_dir, word_tokenizer  # noqa: F401 - tiny_dir: the shared fixture
from tiny_models import tiny_model


@pytest.mark.parametrize("fam", ["llama", "gpt2", "bert"])
def test_convert_script_end_to_end(tiny_dir, tmp_path, fam):
    script = conversion_script("convert")

    extra = ["--lora-tokens", "64"] if fam != "bert" else []
    report = script.main(conversion_args(tiny_dir, fam, tmp_path / "out", *extra))
    out = tmp_path / "out"
    for f in ("config.json", "model.safetensors", "README.md", "report.json", "RESULTS.md", "layer_errors.md", "layer_errors.png", "modeling_hf_rfa.py"):
        assert (out / f).is_file(), f
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    rep = json.loads((out / "report.json").read_text())
    assert rep["stages"]["transfer"]["tokens"] >= 256
    variants = [r["variant"] for r in rep["rows"]]
    assert variants[0] == "original (softmax)" and len(variants) >= 3
    card = (out / "README.md").read_text()
    assert ("perplexity" in card) if fam != "bert" else ("cosine" in card)
    # the loading snippets name the published folder, never the staging folder it was written in
    assert str(out.resolve()) in card and ".tmp-" not in card
    # the export loads back with identical outputs
    model, _, _ = pipeline.load_model(str(out))
    assert hf_rfa.rfa_config_of(model).window == 4
    assert report["output"] == str(out.resolve())


def test_failed_run_leaves_no_output(tiny_dir, tmp_path, monkeypatch):
    script = conversion_script("convert")

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pipeline.transfer, "attention_transfer", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        script.main(conversion_args(tiny_dir, "llama", tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_refused(tiny_dir, tmp_path):
    script = conversion_script("convert")

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        script.main(conversion_args(tiny_dir, "llama", tmp_path / "out"))
    assert (tmp_path / "out" / "keep.txt").read_text() == "x"


def test_learnable_projections_are_transferred(tiny_dir, tmp_path):
    """--learnable-projections: favor+ gets a transfer stage that moves its projections."""
    script = conversion_script("convert")

    script.main(conversion_args(tiny_dir, "llama", tmp_path / "out", "--feature-map", "favor+", "--learnable-projections"))
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["stages"]["transfer"]["tokens"] >= 256
    model, _, _ = pipeline.load_model(str(tmp_path / "out"))
    maps = list(hf_rfa.model_feature_maps(model))
    assert all(fm.learnable for fm in maps)
    assert any(not torch.equal(fm.omega.detach(), hf_rfa.build_feature_map("favor+", head_dim=fm.head_dim, num_features=8, seed=fm.seed).omega) for fm in maps)
    with pytest.raises(ValueError, match="learnable_projections"):
        pipeline.ConversionConfig(model="x", rfa=hf_rfa.RFAConfig(feature_map="hedgehog"), learnable_projections=True)


def test_bad_config_names_field():
    with pytest.raises(ValueError, match="num_features"):
        pipeline.ConversionConfig(model="x", rfa=hf_rfa.RFAConfig(num_features=0))
    with pytest.raises(ValueError, match="eval_contexts"):
        pipeline.ConversionConfig(model="x", eval_contexts=[])
    with pytest.raises(ValueError, match="rfa must be an RFAConfig"):
        pipeline.ConversionConfig(model="x", rfa={"feature_map": "favor+"})
    base = ["--model", "m", "--output", "o", "--calibration-text", "c", "--eval-text", "e"]
    with pytest.raises(ValueError, match="num_features"):
        config_from_args([*base, "--num-features", "0"])
    with pytest.raises(SystemExit):  # argparse lists the choices
        config_from_args([*base, "--feature-map", "nope"])


def test_evaluate_prints_json(tiny_dir, tmp_path):
    script = os.path.join(ROOT, "conversion", "evaluate.py")
    res = subprocess.run([sys.executable, script, "--model", tiny_dir["llama"], "--text", tiny_dir["eval"], "--context", "32", "--max-tokens", "128", "--no-progress"],
                         capture_output=True, text=True, check=True)
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["tokens"] == 4 * 31 and line["perplexity"] > 1


def test_evaluate_converted_checkpoint_matches_in_process(tiny_dir, tmp_path):
    script = conversion_script("evaluate")
    conv = conversion_script("convert")

    conv.main(conversion_args(tiny_dir, "llama", tmp_path / "out"))
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    final = [r for r in rep["rows"] if r["variant"] == rep["final_variant"]][0]
    got = script.main(["--model", str(tmp_path / "out"), "--text", tiny_dir["eval"], "--context", "32", "--max-tokens", "256", "--no-progress"])
    assert got["tokens"] == final["eval_tokens"]
    assert got["perplexity"] == pytest.approx(final["perplexity"], rel=1e-4)


def test_perplexity_windows_are_non_overlapping():
    from hf_rfa.recipes.evaluation import token_windows

    ids = torch.arange(100)
    w = token_windows(ids, 10)
    assert len(w) == 10 and torch.equal(torch.cat(w), ids)
    w3 = token_windows(ids, 10, 3)
    assert [int(x[0]) for x in w3] == [0, 30, 60]
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(ids, 200)


def _counting_forwards(model):
    calls = []
    model.model.register_forward_hook(lambda m, i, o: calls.append(1))
    return calls


@pytest.mark.parametrize("converted", [False, True])
def test_perplexity_reads_a_shorter_window_from_a_longer_forward(converted):
    """``prefixes``: the 128-token window at offset 0 is the first half of the 256-token one and is
    read from its forward (one forward fewer); the figures equal separate forwards' (softmax, and
    the recall recipe's hybrid with a decay and an exact memory re-chosen every 4 positions)."""
    import hf_rfa
    from hf_rfa.recipes import evaluation
    from tiny_models import VOCAB, tiny_model

    model = tiny_model("llama")
    if converted:
        cfg = hf_rfa.RFAConfig(feature_map="hedgehog", num_features=16, window=8, sinks=1, decay=5.0, chunk_size=16, memory=4, memory_every=4,
                               feature_input="unrotated", memory_score="feature_error")
        model = hf_rfa.convert(model, cfg).eval()
    ids = torch.randint(2, VOCAB, (512,), generator=torch.Generator().manual_seed(0))
    assert evaluation.prefix_consistent(model)
    calls = _counting_forwards(model)
    prefixes: dict = {}
    long = evaluation.perplexity(model, ids, 256, 256, progress=False, prefixes=prefixes)
    short = evaluation.perplexity(model, ids, 128, 256, progress=False, prefixes=prefixes)
    assert len(calls) == 2 and sorted(prefixes) == [0, 256]  # 256 @0, then 128 @256 only (128 @0 was read)
    alone = evaluation.perplexity(model, ids, 128, 256, progress=False)
    assert len(calls) == 4 and short["window_tokens"] == alone["window_tokens"] == [127, 127]
    assert short["window_nll"] == pytest.approx(alone["window_nll"], rel=1e-5)
    assert short["perplexity"] == pytest.approx(alone["perplexity"], rel=1e-5)
    assert long["window_nll"][0] != pytest.approx(short["window_nll"][0], rel=1e-3)  # the 256 window is not what was read whole


def test_length_dependent_rotary_does_not_share_prefixes():
    """A ``dynamic`` rotary rescales its frequencies once a sequence is longer than the model's
    positions, so a long window's first positions are not the short window's: no sharing."""
    import transformers as tf
    from hf_rfa.recipes import evaluation
    from tiny_models import VOCAB, tiny_config, tiny_model

    cfg = tiny_config("llama")
    cfg.max_position_embeddings = 64
    cfg.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    assert not evaluation.prefix_consistent(model)
    plain = tiny_model("llama")
    ids = torch.randint(2, VOCAB, (1, 128), generator=torch.Generator().manual_seed(0))

    def head_change(m):  # the first 31 NLLs: of a 128-token forward against a 32-token one
        with torch.no_grad():
            return float((evaluation.next_token_nll(m, ids)[0, :31] - evaluation.next_token_nll(m, ids[:, :32])[0]).abs().max())

    assert head_change(plain) < 1e-5 < 1e-4 < head_change(model)
    assert evaluation.prefix_consistent(tiny_model("llama"))


@pytest.mark.slow
def test_smollm2_quick_conversion_improves_over_untrained(tmp_path):
    from hf_rfa import assets

    path = assets.smollm2_path()
    cal = assets.wikipedia_text_file("calibration")
    ev = assets.wikipedia_text_file("eval")
    cfg = pipeline.ConversionConfig(
        model=str(path), output=str(tmp_path / "out"), rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=32, window=32, sinks=4),
        transfer_tokens=4 * 512, lora_tokens=0, context=512, eval_contexts=[512], eval_tokens=2048, error_tokens=512,
        calibration_text=str(cal), eval_text=str(ev), baselines=False, generate_tokens=0, progress=False,
    )
    rep = pipeline.run(cfg)
    rows = {r["variant"].split(", ")[-1]: r["perplexity"] for r in rep["rows"]}
    assert rows["after attention transfer"] < rows["untrained"]


def test_report_regenerates_from_committed_runs(tmp_path, monkeypatch):
    """docs/results.md is rendered from the report.json copies kept in the repository, byte for byte
    (``python conversion/report.py --docs``); every causal run's summary row is its last variant over
    the original at the same context, next to its window-only baseline."""
    import glob

    report = conversion_script("report")

    specs = sorted(glob.glob(os.path.join(ROOT, "conversion", "results", "runs", "*.json")))
    assert specs, "no committed conversion runs"
    text = report.docs_page(ROOT)
    with open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8") as f:
        assert f.read() == text, "docs/results.md is stale: run `python conversion/report.py --docs`"
    for spec in specs:
        label, rep = report.load_run(spec)
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+_v\d+\.\d+\.\d+", label), f"run {label!r}: name it <model>-<preset>_v<version>"
        if rep["kind"] != "causal-lm":
            continue
        rows = rep["rows"]
        for ctx in {r["context"] for r in rows}:
            orig = next(r for r in rows if r["context"] == ctx and r["variant"].startswith("original"))
            last = [r for r in rows if r["context"] == ctx and not r["variant"].startswith("original")][-1]
            base = report.baseline_variant(rep)
            wo = next((f"{r['perplexity']:.2f}" for r in rows if r["context"] == ctx and r["variant"] == base), "not measured")
            ci = r"(?: \[[0-9.]+, [0-9.]+\])?"  # the 95% interval, where the run has one
            row = (rf"\| {re.escape(label)} \| {re.escape(last['variant'])} \| {ctx} \| {last['perplexity']:.2f}{ci} \| "
                   rf"{last['perplexity'] / orig['perplexity']:.3f}{ci} \| {re.escape(wo)}{ci} \|")
            assert re.search(row, text), row
    with pytest.raises(ValueError, match="no report.json"):
        report.load_run(str(tmp_path))
    with pytest.raises(ValueError, match="no committed runs"):
        report.docs_page(str(tmp_path))
    # the published run's baseline is the same-memory window-only model after its own LoRA
    _, recall = report.load_run(os.path.join(ROOT, "conversion", "results", "runs", "smollm2-recall_v0.2.0.json"))
    assert report.baseline_variant(recall) == "window-only: window 64 + sinks 4 + memory 256 by layer (value_norm), no features, after LoRA"
    # the kept SmolLM2 run is the main job: make main [ARGS=...], or its script run directly (make main without the set-up)
    assert re.search(r"```\n(make main|python conversion/main_job\.py)\b", text)
    (tmp_path / "named").mkdir()
    (tmp_path / "named" / "report.json").write_text(json.dumps({**recall, "machine": {"cpu": "Some CPU", "threads": 2}}))
    assert f"- wall time of the whole run: {recall['minutes_total']:.1f} min (Some CPU, 2 threads)\n" in report.render([str(tmp_path / "named")])
    # reports without "baseline_variant": the last window-only row with the run's own window and sinks
    old = {"config": {"rfa": {"window": 64, "sinks": 4}}, "rows": [
        {"variant": "window-only: window 64 + sinks 4, no features, after LoRA"},
        {"variant": "window-only: window 128 + sinks 4, no features, after LoRA"}]}
    assert report.baseline_variant(old) == "window-only: window 64 + sinks 4, no features, after LoRA"  # not the window-128 one
    assert report.baseline_variant({"config": {"rfa": {"window": 0, "sinks": 0}}, "rows": []}) is None
    assert report.baseline_variant({"baseline_variant": "x", "rows": []}) == "x"
    assert report.command_of({"model": "~/m dir", "output": "o", "eval_contexts": [8]}).startswith("python conversion/convert.py --model ~/'m dir' --output o")


def test_main_job_run_file_is_portable(tmp_path):
    """make main keeps its report as conversion/results/runs/smollm2-recall_v<version>.json, with no
    folder of the machine it ran on."""
    main_job = conversion_script("main_job")
    home = str(tmp_path / "home")
    rep = {"model": home + "/.cache/hf_rfa/smollm2", "config": {"eval_text": home + "/x/eval.txt", "texts": [home, "wikipedia:eval"]},
           "other": home + "x"}
    assert main_job.portable(rep, home) == {"model": "~/.cache/hf_rfa/smollm2", "config": {"eval_text": "~/x/eval.txt", "texts": ["~", "wikipedia:eval"]},
                                            "other": home + "x"}
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"model": os.path.expanduser("~/m")}))
    main_job.write_run_file(str(out), str(tmp_path / "runs" / "r.json"), "make main")
    assert json.loads((tmp_path / "runs" / "r.json").read_text()) == {"model": "~/m", "command": "make main"}
    assert main_job.run_file_name().endswith(os.path.join("conversion", "results", "runs", f"smollm2-recall_v{hf_rfa.__version__}.json"))
    # a run that wrote no report (--dry-run) keeps no run file: an earlier run's report is not this one's
    written = (out / "report.json").stat().st_mtime
    assert main_job.wrote_report(str(out), written) and not main_job.wrote_report(str(out), written + 1)
    assert not main_job.wrote_report(str(tmp_path / "nowhere"), 0)


def test_main_job_run_file_names_the_command_that_ran(monkeypatch):
    main_job = conversion_script("main_job")
    monkeypatch.setenv("MAKELEVEL", "1")
    assert main_job.run_command([]) == "make main"
    assert main_job.run_command(["--no-progress"]) == "make main ARGS=--no-progress"
    assert main_job.run_command(["--no-progress", "--dtype", "bfloat16"]) == "make main ARGS='--no-progress --dtype bfloat16'"
    monkeypatch.delenv("MAKELEVEL")
    assert main_job.run_command(["--quick"]) == "python conversion/main_job.py --quick"


def test_no_matplotlib_and_offline_push_keep_the_results(tiny_dir, tmp_path, monkeypatch, caplog, capsys):
    """Without matplotlib the plot is skipped with one warning (checked before any stage); a failed
    --push-to-hub keeps the folder, prints the table and says how to upload."""
    import importlib.util

    script = conversion_script("convert")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "matplotlib" else real_find_spec(name, *a, **k))

    def offline(*args, **kwargs):
        raise OSError("Connection refused")

    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", offline)
    with caplog.at_level("WARNING", logger="hf_rfa.recipes.conversion.pipeline"):
        report = script.main(conversion_args(tiny_dir, "llama", tmp_path / "out", "--push-to-hub", "me/tiny-rfa"))
    out = tmp_path / "out"
    assert (out / "model.safetensors").is_file() and (out / "layer_errors.md").is_file()
    assert not (out / "layer_errors.png").exists()
    assert len([r for r in caplog.records if "matplotlib is not installed" in r.getMessage()]) == 1
    assert "hf upload me/tiny-rfa" in report["push_error"]
    printed = capsys.readouterr().out
    assert "| original (softmax)" in printed and "push to the Hub failed" in printed and str(out.resolve()) in printed
    assert (out / "tokenizer.json").is_file()  # exported by hf_rfa.export itself


def test_installed_commands_exit_0_on_success(tiny_dir, tmp_path):
    """The console-script wrappers call ``sys.exit(command())``: a returned report dict would exit 1
    and be printed to stderr; the commands exit 0 and keep stderr free of the report."""
    ev = subprocess.run([installed_command("hf-rfa-evaluate"), "--model", tiny_dir["llama"], "--text", tiny_dir["eval"], "--context", "32",
                         "--max-tokens", "64", "--no-progress"], capture_output=True, text=True)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "perplexity" in ev.stdout and "{'task'" not in ev.stderr
    conv = subprocess.run([installed_command("hf-rfa-convert"), *conversion_args(tiny_dir, "llama", tmp_path / "out")], capture_output=True, text=True)
    assert conv.returncode == 0, conv.stderr[-2000:]
    assert (tmp_path / "out" / "config.json").is_file()
    assert "{'rows'" not in conv.stderr and "'output':" not in conv.stderr


@pytest.mark.slow
def test_classifier_conversion_reports_each_metric(tiny_dir, tmp_path):
    """``--metric``: a sequence classifier's conversion reports every named metric for every variant
    (the offline implementations here: ``evaluate`` cannot reach the Hub), equal to the metric
    computed on the same predictions, and the model card carries them next to the original's."""
    import numpy as np

    from hf_rfa.integrations import metrics as hf_metrics
    from hf_rfa.recipes.conversion.loading import load_model

    d = tmp_path / "cls"
    tiny_model("bert", head="cls").save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    rows = [" ".join(random.Random(i).choice(WORDS) for _ in range(10)) for i in range(40)]
    csv = tmp_path / "labelled.csv"
    csv.write_text("text,label\n" + "\n".join(f"{t},{i % 2}" for i, t in enumerate(rows)) + "\n")
    out = tmp_path / "out"
    conversion_script("convert").main(["--model", str(d), "--output", str(out), "--preset", "encoder", "--encoder-max-length", "16", "--encoder-pack-tokens", "0",
          "--feature-map", "hedgehog", "--num-features", "8", "--window", "2", "--sinks", "1", "--transfer-tokens", "64", "--error-tokens", "32",
          "--calibration-text", str(csv), "--eval-text", str(csv), "--metric", "accuracy", "f1", "--no-progress"])
    rep = json.loads((out / "report.json").read_text())
    for r in rep["rows"]:
        assert {"accuracy", "f1"} <= set(r), r
    orig = rep["rows"][0]
    model, tok, _ = load_model(str(d))
    from hf_rfa.recipes import evaluation

    preds = []
    for ids, mask in evaluation.sentence_batches(tok, rows, 32, 16):
        preds.append(model(input_ids=ids, attention_mask=mask).logits.argmax(-1))
    pred = np.concatenate([p.detach().numpy() for p in preds])
    gold = np.array([i % 2 for i in range(40)])
    assert orig["f1"] == pytest.approx(hf_metrics.f1(pred, gold)["f1"], abs=1e-12)
    assert orig["accuracy"] == pytest.approx(float((pred == gold).mean()), abs=1e-12)
    card = (out / "README.md").read_text()
    assert "f1" in card and "accuracy" in card


def test_a_run_reports_each_stage_peak_rss_next_to_the_plan(tiny_dir, tmp_path):
    """report.json's ``memory``: the plan's stage totals (``--dry-run``'s numbers) and, on Linux, the
    resident-memory peak of the load and of every stage, measured."""
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["llama"], output=str(tmp_path / "out"), rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1),
        transfer_tokens=64, lora_tokens=64, context=32, eval_contexts=[32], eval_tokens=64, error_tokens=32, generate_tokens=0,
        calibration_text=tiny_dir["cal"], eval_text=tiny_dir["eval"], progress=False,
    )
    mem = pipeline.run(cfg)["memory"]
    assert set(mem["plan_bytes"]) == {"transfer", "lora", "eval"} and all(v > 0 for v in mem["plan_bytes"].values())
    if os.path.exists("/proc/self/statm"):
        peaks = mem["peak_rss_bytes"]
        assert {"load", "attention_transfer", "lora"} <= set(peaks) and all(v > 2**20 for v in peaks.values())
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["memory"] == mem


def test_failed_push_exits_1_and_keeps_the_folder(tiny_dir, tmp_path, monkeypatch, capsys):
    """``hf-rfa-convert --push-to-hub`` whose upload fails keeps the complete folder, prints how to
    upload it, and exits 1 (it exited 0, as if the model were on the Hub)."""
    from hf_rfa import cli

    def offline(*args, **kwargs):
        raise OSError("Connection refused")

    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", offline)
    out = tmp_path / "out"
    assert cli.convert_command(conversion_args(tiny_dir, "llama", out, "--push-to-hub", "me/tiny-rfa", "--generate-tokens", "0")) == 1
    assert "hf upload me/tiny-rfa" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "report.json").is_file()
    assert cli.convert_command(conversion_args(tiny_dir, "llama", tmp_path / "out2", "--generate-tokens", "0")) == 0  # no push asked: 0


def test_evaluate_rfa_settings_equal_a_model_converted_with_them(tiny_dir, tmp_path, capsys):
    """``hf-rfa-evaluate --rfa window=8 memory=3``: the saved model evaluated with other settings that
    involve no parameters gives the perplexity of the same model converted with them, and the result
    records them; an unconverted model and a parameter-shaping field are one-line usage errors."""
    from hf_rfa import cli

    base = dict(feature_map="favor+", num_features=16, window=4, sinks=1, memory=0, chunk_size=8)
    for name, cfg in (("saved", base), ("want", {**base, "window": 8, "memory": 3, "memory_every": 4})):
        m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**cfg))
        m.save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)
    common = ["--text", tiny_dir["eval"], "--context", "64", "--max-tokens", "256", "--no-progress"]
    got = cli.evaluate_main(["--model", str(tmp_path / "saved"), "--rfa", "window=8", "memory=3", "memory_every=4", *common])
    want = cli.evaluate_main(["--model", str(tmp_path / "want"), *common])
    plain = cli.evaluate_main(["--model", str(tmp_path / "saved"), *common])
    assert got["perplexity"] == want["perplexity"] != plain["perplexity"]
    assert got["rfa"] == {"window": 8, "memory": 3, "memory_every": 4} and "rfa" not in plain
    capsys.readouterr()
    for model, rfa, msg in ((tiny_dir["llama"], "window=8", "is not converted"), (str(tmp_path / "saved"), "num_features=8", "FIELD one of")):
        with pytest.raises(SystemExit) as e:
            cli.evaluate_main(["--model", model, "--rfa", rfa, *common])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert msg in err and "Traceback" not in err


def test_evaluate_warns_when_the_memory_reads_past_the_rotary_positions(tiny_dir, tmp_path, caplog):
    """A converted rotary model with an exact memory read past ``max_position_embeddings`` (512 for the
    tiny Llama) logs one warning naming the limit and the way out; within it, without a memory, or with
    the memory's distances clamped below the limit, none."""
    import logging

    from hf_rfa import cli

    m = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=4, sinks=1, memory=3, memory_every=4, feature_input="unrotated"))
    m.save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")
    common = ["--model", str(tmp_path / "m"), "--text", tiny_dir["eval"], "--max-tokens", "1023", "--no-progress"]
    cases = ((["--context", "1024"], True), (["--context", "512"], False), (["--context", "1024", "--rfa", "memory=0"], False),
             (["--context", "1024", "--rfa", "memory_distance=511"], False), (["--context", "1024", "--rfa", "memory_distance=600"], True))
    for extra, warned in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hf_rfa.cli"):
            cli.evaluate_main(common + extra)
        hits = [r.getMessage() for r in caplog.records if "max_position_embeddings (512)" in r.getMessage()]
        assert len(hits) == int(warned), (extra, hits)
        if warned:
            assert hits[0].startswith("--context: 1024 tokens with an exact memory") and "--rfa memory_distance=511" in hits[0]
