"""Presets (hf_rfa.presets), hf_rfa.linearize against the command line, and the commands' behaviour
on bad input (one line, no traceback, before any work) through the installed entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import hf_rfa
from hf_rfa.presets import PRESETS
from hf_rfa.recipes.conversion import pipeline
from conversion_runs import conversion_script, installed_command, tiny_dir  # noqa: F401 - tiny_dir: the shared fixture

# the recall preset with budgets a tiny model trains in seconds (every stage still runs)
TINY_BUDGET = {"num_features": 8, "window": 4, "sinks": 1, "decay": 16.0, "transfer_tokens": 128, "transfer_queries": 8,
               "lora_tokens": 64, "context": 32, "lora_context": 32, "memory_after_training": 3, "memory_every": 8}


def _flags(values: dict) -> list[str]:
    out = []
    for k, v in values.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def test_presets_name_their_config_and_budgets():
    assert list(hf_rfa.available_presets()) == ["recall", "window-only", "encoder", "favor+", "rfa"]
    assert all(isinstance(v, str) and v for v in hf_rfa.available_presets().values())
    recall = hf_rfa.RFAConfig.from_preset("recall")
    assert (recall.feature_map, recall.num_features, recall.window, recall.sinks, recall.decay, recall.feature_input, recall.memory_score) == (
        "hedgehog", 64, 64, 4, 128.0, "unrotated", "feature_error")
    assert recall.feature_map_options == {"hybrid_mix": True}
    assert dict(PRESETS["recall"].training) == {"transfer_tokens": 131072, "transfer_query_blocks": 4, "context": 1024,
                                                "lora_tokens": 65536, "lora_lr": 3e-4, "lora_context": 4096,
                                                "memory_after_training": 256, "memory_split": "induction"}
    assert "memory_split" not in PRESETS["window-only"].training  # its own memory stays uniform when it is the run's recipe
    wo = hf_rfa.RFAConfig.from_preset("window-only")
    assert (wo.feature_map, wo.window, wo.sinks, wo.memory_score) == ("none", 64, 4, "value_norm")
    assert PRESETS["window-only"].training["memory_after_training"] == 256
    enc = hf_rfa.RFAConfig.from_preset("encoder")
    assert (enc.feature_map, enc.num_features, enc.window, enc.sinks, enc.decay) == ("hedgehog", 32, 8, 1, 0.0)
    assert PRESETS["encoder"].training["encoder_pack_tokens"] == 512
    assert hf_rfa.RFAConfig.from_preset("favor+") == hf_rfa.RFAConfig(feature_map="favor+", num_features=256)
    assert hf_rfa.RFAConfig.from_preset("rfa").feature_map == "rfa"
    assert hf_rfa.RFAConfig.from_preset("recall", window=128).window == 128
    # the table cannot be changed through what a call returns
    hf_rfa.RFAConfig.from_preset("recall").feature_map_options["hybrid_mix"] = False
    assert hf_rfa.RFAConfig.from_preset("recall").feature_map_options == {"hybrid_mix": True}


def test_linearize_builds_the_model_the_command_builds(tiny_dir, tmp_path):
    """``hf-rfa-convert --preset recall`` (tiny budgets) and ``hf_rfa.linearize(..., "recall")`` with
    the same settings and training text: the same weights, buffers and logits."""
    out = tmp_path / "out"
    script = conversion_script("convert")
    script.main(["--preset", "recall", "--model", tiny_dir["llama"], "--output", str(out), "--calibration-text", tiny_dir["cal"],
                 "--train-text", tiny_dir["cal"], "--eval-text", tiny_dir["eval"], "--eval-contexts", "32", "--eval-tokens", "64",
                 "--error-tokens", "32", "--no-progress", "--generate-tokens", "0", *_flags(TINY_BUDGET)])
    cli = hf_rfa.from_pretrained(str(out)).eval()
    py = hf_rfa.linearize(tiny_dir["llama"], "recall", train_texts=tiny_dir["cal"], **TINY_BUDGET)
    assert hf_rfa.rfa_config_of(py) == hf_rfa.rfa_config_of(cli)
    assert hf_rfa.rfa_config_of(py).memory == 3 and hf_rfa.rfa_config_of(py).feature_map_options == {"hybrid_mix": True}
    a, b = py.state_dict(), cli.state_dict()
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    from transformers import AutoModelForCausalLM

    untrained = hf_rfa.convert(AutoModelForCausalLM.from_pretrained(tiny_dir["llama"]), hf_rfa.RFAConfig.from_preset("recall", **{
        k: v for k, v in TINY_BUDGET.items() if k in ("num_features", "window", "sinks", "decay", "memory_every")}))
    assert any(not torch.equal(a[k], v) for k, v in untrained.state_dict().items() if k in a)  # training changed weights
    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(py(ids).logits, cli(ids).logits, rtol=0, atol=0)


def test_linearize_refuses_what_it_cannot_do(tiny_dir):
    with pytest.raises(ValueError, match="give train_texts"):
        hf_rfa.linearize(tiny_dir["llama"], "recall", **{**TINY_BUDGET, "transfer_tokens": 0})
    with pytest.raises(ValueError, match=r"unknown settings \['windw'\]"):
        hf_rfa.linearize(tiny_dir["llama"], "recall", windw=3)
    with pytest.raises(ValueError, match="preset must be one of"):
        hf_rfa.linearize(tiny_dir["llama"], "fast")
    m = hf_rfa.linearize(tiny_dir["llama"], "favor+", lora_tokens=0, num_features=8)  # untrained random features need no text
    assert hf_rfa.rfa_config_of(m).feature_map == "favor+"


def _convert(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([installed_command("hf-rfa-convert"), *argv], capture_output=True, text=True, timeout=300)


def _base(tiny, out) -> list[str]:
    return ["--model", tiny["gpt2"], "--output", str(out), "--calibration-text", tiny["cal"], "--eval-text", tiny["eval"], "--no-progress"]


@pytest.mark.parametrize("case", ["missing-text", "positions", "unrotated", "bad-value"])
def test_user_errors_are_one_line_before_any_work(tiny_dir, tmp_path, case, capsys, monkeypatch):
    """A bad input is one line on stderr with the fix, exit status 2, no traceback, nothing written,
    refused before any stage; ``--debug`` raises instead."""
    from hf_rfa import cli
    from hf_rfa.recipes.conversion import stages

    def no_stage(s):
        raise AssertionError("a stage ran before the input was refused")

    monkeypatch.setattr(stages, "run_stages", no_stage)
    base = _base(tiny_dir, tmp_path / "out")
    argv = {
        "missing-text": [*base, "--feature-input", "rotated", "--train-text", str(tmp_path / "nope.txt")],
        "positions": [*base, "--feature-input", "rotated", "--eval-contexts", "4096", "--context", "32", "--lora-context", "32", "--transfer-queries", "8", "--transfer-query-blocks", "1"],
        "unrotated": base,  # recall (the default) reads q/k before the rotary embedding: GPT-2 has none
        "bad-value": [*base, "--window", "-1"],
    }[case]
    expected = {"missing-text": "--train-text", "positions": "--eval-contexts asks for 4096 tokens but", "unrotated": "use --feature-input rotated",
                "bad-value": "window"}[case]
    assert cli.convert_command(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "hf-rfa-convert: error:" in line]
    assert len(lines) == 1 and expected in lines[0] and "--debug shows the traceback" in lines[0], err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert not any(n.startswith(".tmp-") for n in os.listdir(tmp_path))
    with pytest.raises(ValueError):
        cli.convert_command([*argv, "--debug"])


def test_installed_command_reports_a_user_error_in_one_line(tiny_dir, tmp_path):
    r = _convert(*_base(tiny_dir, tmp_path / "out"), "--train-text", str(tmp_path / "nope.txt"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("hf-rfa-convert: error: --train-text")


def test_window_covering_the_context_warns_and_the_card_says_so(tiny_dir, tmp_path, capsys, caplog):
    from hf_rfa import cli

    out = tmp_path / "out"
    argv = ["--preset", "favor+", "--model", tiny_dir["llama"], "--output", str(out), "--calibration-text", tiny_dir["cal"],
            "--eval-text", tiny_dir["eval"], "--no-progress", "--num-features", "8", "--window", "32", "--context", "32",
            "--lora-tokens", "0", "--eval-contexts", "32", "--eval-tokens", "64", "--error-tokens", "32", "--generate-tokens", "0"]
    with caplog.at_level("WARNING", logger="hf_rfa.recipes.conversion.checks"):
        assert cli.convert_command(argv) == 0
    warned = [r.getMessage() for r in caplog.records if r.name == "hf_rfa.recipes.conversion.checks"]
    assert len(warned) == 1 and "--window 32 >= --context 32" in warned[0] and "exact softmax" in warned[0]
    printed = capsys.readouterr().out
    assert "| original (softmax)" in printed and "report.json" in printed  # the summary table on stdout
    card = (out / "README.md").read_text()
    assert "Up to 32 tokens every key lies inside the exact window" in card and "exact softmax attention" in card
    assert json.loads((out / "report.json").read_text())["warnings"] == warned


def test_baselines_only_when_asked():
    """Without ``--baselines`` / ``--window-only-baseline`` the baseline stages do nothing (they never
    touch the model: None here); either flag switches the window-only baseline on."""
    from hf_rfa.recipes.conversion import stages
    from hf_rfa.recipes.conversion.loading import CAUSAL_LM
    from hf_rfa.recipes.conversion.state import State

    cfg = pipeline.ConversionConfig.from_preset("recall", model="m")
    s = State(cfg=cfg, model=None, tok=None, kind=CAUSAL_LM, report={"rows": [], "stages": {}})
    stages.random_baselines(s)
    stages.window_only_baseline(s)
    assert s.rows == [] and s.baseline is None
    assert pipeline.ConversionConfig.from_preset("recall", model="m", baselines=True).evaluates_window_only
    assert pipeline.ConversionConfig.from_preset("recall", model="m", window_only_baseline=True).evaluates_window_only


@pytest.mark.slow
def test_two_process_accelerate_launch_exits_0(tiny_dir, tmp_path):
    """``accelerate launch`` with 2 CPU processes of ``hf-rfa-train`` on a tiny model exits 0 (an
    installed command that returned its report once made every launch end in ChildFailedError)."""
    accelerate = installed_command("accelerate")
    train = tmp_path / "train.txt"
    train.write_text(open(tiny_dir["cal"]).read())
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         installed_command("hf-rfa-train"), "--model_name_or_path", tiny_dir["llama"], "--train_file", str(train), "--output_dir", str(tmp_path / "run"),
         "--preset", "recall", "--num_features", "8", "--window", "4", "--sinks", "1", "--decay", "16", "--max_seq_length", "32",
         "--max_train_steps", "2", "--per_device_train_batch_size", "2", "--disable_tqdm"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "ChildFailedError" not in r.stderr and (tmp_path / "run" / "final").is_dir()


def test_evaluate_refuses_a_context_beyond_learned_positions(tiny_dir, capsys):
    from transformers import AutoConfig

    from hf_rfa import cli

    limit = AutoConfig.from_pretrained(tiny_dir["gpt2"]).n_positions
    with pytest.raises(SystemExit) as e:
        cli.evaluate_main(["--model", tiny_dir["gpt2"], "--text", tiny_dir["eval"], "--context", str(limit + 1), "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--context: perplexity needs {limit + 1} tokens but" in err and f"has {limit} learned positions" in err and "Traceback" not in err


def test_linearize_shows_the_training_progress_by_default(tiny_dir, capsys):
    """``hf_rfa.linearize`` trains for minutes with the recall preset's budgets: its stages show
    their progress bars as the command's do, unless ``progress=False``."""
    hf_rfa.linearize(tiny_dir["llama"], "recall", train_texts=tiny_dir["cal"], **TINY_BUDGET)
    err = capsys.readouterr().err
    assert "attention transfer" in err and "LoRA" in err
    hf_rfa.linearize(tiny_dir["llama"], "recall", train_texts=tiny_dir["cal"], progress=False, **TINY_BUDGET)
    err = capsys.readouterr().err
    assert "attention transfer" not in err and "LoRA" not in err


def test_linearize_of_a_model_built_in_code_asks_for_its_tokenizer(tiny_dir):
    """A model object that was not loaded from a checkpoint has no name to load a tokenizer by:
    the error says to pass ``tokenizer=`` (it was the Hub's error for the id 'LlamaForCausalLM')."""
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match="LlamaForCausalLM given was not loaded from a checkpoint.*pass tokenizer=$"):
        hf_rfa.linearize(tiny_model("llama"), "recall", train_texts=tiny_dir["cal"], **TINY_BUDGET)
