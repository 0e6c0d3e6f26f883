"""Command-line and text inputs give clear errors naming what is wrong."""

from __future__ import annotations

import importlib.util
import os

import pytest

from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import pipeline
from hf_rfa.recipes.conversion.pipeline import ConversionConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(name: str):
    """conversion/<name>.py loaded by path (not put on sys.path: its evaluate.py would shadow the
    ``evaluate`` package)."""
    spec = importlib.util.spec_from_file_location(f"conversion_{name}", os.path.join(ROOT, "conversion", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_local_model_folder_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ws").mkdir()
    for spec in ("ws/llama", str(tmp_path / "nowhere"), "./model"):
        with pytest.raises(ValueError, match="local folder .* not found"):
            pipeline.resolve_checkpoint(spec)
    assert pipeline.resolve_checkpoint("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a Hub id passes through


def test_text_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        evaluation.load_text("data/my:notes.txt")  # a path with ':' is not a Hub dataset
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    for load in (evaluation.load_text, evaluation.load_labelled):
        with pytest.raises(ValueError, match="latin1.txt is not UTF-8"):
            load(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    for load in (evaluation.load_text, evaluation.load_labelled):
        with pytest.raises(ValueError, match="holds no text"):
            load(str(empty))
    (tmp_path / "empty.csv").write_text("text,label\n")
    with pytest.raises(ValueError, match="holds no text"):
        evaluation.load_labelled(str(tmp_path / "empty.csv"))


@pytest.mark.parametrize(
    "field,value",
    [("transfer_minutes", float("nan")), ("transfer_minutes", -1.0), ("lora_minutes", float("inf")), ("transfer_lr", 0.0),
     ("lora_lr", float("nan")), ("eval_tokens", -5), ("transfer_queries", 0)],
)
def test_numeric_flags_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        ConversionConfig(model="m", **{field: value})


@pytest.mark.parametrize("value", [0, -4])
def test_a_context_below_one_is_named_before_the_query_blocks_that_depend_on_it(value):
    # the recall preset's transfer query blocks are checked against the context: a bad context is named first
    with pytest.raises(ValueError, match=rf"^context must be an int >= 1, got {value}$"):
        ConversionConfig(model="m", context=value, transfer_query_blocks=4, transfer_queries=256)


def test_output_naming_a_file_is_refused_before_loading(tmp_path):
    script = _script("convert")

    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        script.main(["--model", "does-not-matter/x", "--output", str(tmp_path / "f"), "--calibration-text", "a.txt", "--eval-text", "b.txt"])


@pytest.mark.parametrize("flag", [["--max-tokens", "0"], ["--max-tokens", "-5"], ["--context", "1"]])
def test_evaluate_script_checks_numbers(flag, capsys):
    script = _script("evaluate")

    with pytest.raises(SystemExit):
        script.main(["--model", "x", "--text", "y.txt", *flag])
    assert flag[0] in capsys.readouterr().err


def test_gguf_cache_is_keyed_on_content(tmp_path, monkeypatch):
    from hf_rfa import assets

    calls = []
    monkeypatch.setattr(assets, "cache_dir", lambda: tmp_path / "cache")

    def fake_convert(spec, out, overwrite):
        calls.append(spec)
        out.mkdir(parents=True)
        (out / "config.json").write_text(open(spec).read())

    monkeypatch.setattr(assets, "gguf_to_hf", fake_convert)
    for d, content in (("a", "model A"), ("b", "model B")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "model.gguf").write_text(content)
    out_a = pipeline.resolve_checkpoint(str(tmp_path / "a" / "model.gguf"))
    out_b = pipeline.resolve_checkpoint(str(tmp_path / "b" / "model.gguf"))
    assert out_a != out_b and open(os.path.join(out_b, "config.json")).read() == "model B"
    assert pipeline.resolve_checkpoint(str(tmp_path / "a" / "model.gguf")) == out_a and len(calls) == 2  # cached


def test_unreachable_hub_model_is_named_in_the_one_line_error(tmp_path, monkeypatch, capsys):
    """A Hub id that cannot be fetched (offline, a typo) is one stderr line that names the id,
    exit status 2 (transformers' own message names no model)."""
    import transformers

    from hf_rfa import cli

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cached files.\nCheck your connection.")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    status = cli.convert_command(["--model", "someone/no-such-model", "--calibration-text", str(text), "--eval-text", str(text),
                                  "--output", str(tmp_path / "out"), "--no-memory-check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("hf-rfa-convert: error: model 'someone/no-such-model' could not be loaded: We couldn't connect")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec,allowed", [("rotten_tomatoes:tset", "rotten_tomatoes:train, rotten_tomatoes:test"),
                                          ("wikipedia:evl", "wikipedia:calibration, wikipedia:train, wikipedia:eval"),
                                          ("bbc_news:dev", "bbc_news:train, bbc_news:test")])
def test_unknown_asset_split_names_the_source_and_the_splits(spec, allowed):
    """A misspelt offline split is a ValueError naming it and the allowed ones (rotten_tomatoes
    raised a bare KeyError), and the command refuses it before loading the model."""
    for load in (evaluation.load_text, evaluation.load_labelled):
        with pytest.raises(ValueError, match=f"text source '{spec}': unknown split .*expected one of {allowed}$"):
            load(spec)
    with pytest.raises(ValueError, match=f"^--eval-text: text source '{spec}'"):
        pipeline.checks.check_inputs(ConversionConfig(model="someone/not-loaded", calibration_text="wikipedia:calibration", eval_text=spec))


@pytest.mark.parametrize("script,argv", [
    ("conversion/convert.py", ["--model", "./no-such-model", "--calibration-text", "wikipedia:calibration", "--eval-text", "wikipedia:eval", "--output", "out"]),
    ("conversion/evaluate.py", ["--model", "./no-such-model", "--task", "passkey"]),
    ("conversion/main_job.py", ["--quick", "--output", "out", "--window", "-3"]),
    ("training/finetune.py", ["--model_name_or_path", "m", "--task", "regression", "--train_file", "a.txt", "--output_dir", "o"]),
    ("training/train_accelerate.py", ["--model_name_or_path", "m", "--task", "regression", "--train_file", "a.txt", "--output_dir", "o"]),
])
def test_repository_scripts_report_user_errors_as_the_commands_do(script, argv, tmp_path, monkeypatch, capsys):
    """``python conversion/convert.py`` is the same command as ``hf-rfa-convert`` (and so on): a bad
    input is one stderr line and exit status 2, not a traceback and status 1."""
    import runpy
    import sys

    from hf_rfa import assets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(assets, "smollm2_path", lambda: tmp_path / "model")  # main_job's assets: not prepared here
    monkeypatch.setattr(assets, "wikipedia_text_file", lambda split: tmp_path / f"{split}.txt")
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.setattr(sys, "path", [os.path.join(ROOT, os.path.dirname(script)), *sys.path])  # as `python <script>` puts it first
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2, last
    assert last.startswith(f"{script}: error: ") and last.endswith("(--debug shows the traceback)"), last
