"""One config family on the command line: ``ConversionConfig`` and ``RFAArguments``
contain an ``RFAConfig``; ``HfArgumentParser`` parses them flat; defaults are the preset's (``--preset``)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from dataclasses import fields

import pytest

from hf_rfa import RFAConfig
from hf_rfa.presets import DEFAULT_PRESET, PRESETS
from hf_rfa.cli import _parse_training, config_from_args, convert_parser
from hf_rfa.recipes import flags
from hf_rfa.recipes.conversion.config import ConversionConfig
from hf_rfa.recipes.training import DataArguments, LoopArguments, ModelArguments, RFAArguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--model", "m", "--output", "o", "--calibration-text", "c", "--eval-text", "e"]
TRAIN = ["--model_name_or_path", "m", "--train_file", "a.txt", "--output_dir", "o"]
TRAIN_CLASSES = (ModelArguments, DataArguments, RFAArguments, LoopArguments)


def _script(path: str):
    spec = importlib.util.spec_from_file_location("script_" + os.path.basename(path)[:-3], os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_convert_defaults_are_the_recall_preset():
    """No --preset: the recall preset, settings and budgets; the Python twin builds the same config."""
    cfg = config_from_args(BASE)
    assert cfg.rfa == RFAConfig.from_preset("recall") == RFAConfig.from_preset(DEFAULT_PRESET)
    assert cfg.rfa.feature_map_options == {"hybrid_mix": True} and cfg.rfa_config() == cfg.rfa  # the CLI adds nothing
    assert (cfg.transfer_tokens, cfg.transfer_query_blocks, cfg.context, cfg.lora_tokens, cfg.lora_lr, cfg.lora_context, cfg.memory_after_training) == (
        131072, 4, 1024, 65536, 3e-4, 4096, 256)
    assert cfg == ConversionConfig.from_preset("recall", model="m", output="o", calibration_text="c", eval_text="e")
    assert not cfg.baselines and not cfg.evaluates_window_only  # baselines only when asked


def _run_file() -> dict:
    import glob

    (path,) = glob.glob(os.path.join(ROOT, "conversion", "results", "runs", "smollm2-recall_v*.json"))
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def test_main_job_resolves_to_the_kept_run():
    """``make main`` (``--preset recall`` + its evaluation flags) resolves to the config of the kept
    run field for field, and converts the same layers (the preset's ``hybrid_mix`` option
    included)."""
    main_job = _script("conversion/main_job.py")
    old = _run_file()["config"]
    paths = ["--model", old["model"], "--output", old["output"], "--overwrite", "--calibration-text", old["calibration_text"],
             "--train-text", old["train_text"], "--eval-text", old["eval_text"]]
    cfg = config_from_args([*main_job.DEFAULT, *paths])
    new = cfg.to_dict()
    assert old["feature_map_options"] == {"hybrid_mix": True}
    defaults = RFAConfig().to_dict()  # fields added after the kept run keep their defaults
    assert cfg.rfa_config() == RFAConfig(**{f.name: old.get(f.name, defaults[f.name]) for f in fields(RFAConfig)})
    display = {"progress"}  # progress bars on or off (--no-progress) change nothing the run computes
    differ = {k: (old[k], new.get(k, "<missing>")) for k in old if k not in display and new.get(k, "<missing>") != old[k]}
    assert differ == {}
    assert (cfg.baselines, cfg.window_only_baseline, cfg.evaluates_window_only) == (False, True, True)
    quick = config_from_args([*main_job.QUICK, *BASE])
    assert (quick.rfa.feature_map, quick.rfa.num_features, quick.rfa.window, quick.rfa.decay, quick.rfa.feature_map_options) == ("favor+", 128, 64, 0.0, {})
    assert (quick.baselines, quick.random_hybrid, quick.lora_context, quick.memory_after_training) == (True, False, 256, 0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses_and_explicit_flags_override_it(name):
    preset = PRESETS[name]
    cfg = config_from_args([*BASE, "--preset", name])
    assert cfg.rfa == RFAConfig.from_preset(name)
    for field_name, value in preset.training.items():
        assert getattr(cfg, field_name) == value, field_name
    over = config_from_args([*BASE, "--preset", name, "--window", "16", "--lora-tokens", "5", "--seed", "3"])
    assert over.rfa == RFAConfig.from_preset(name, window=16, seed=3) and over.lora_tokens == 5
    assert (over.context, over.transfer_tokens) == (cfg.context, cfg.transfer_tokens)  # the rest stays the preset's
    assert f"(default: {preset.rfa['feature_map']})" in " ".join(convert_parser(name).format_help().split())


def test_an_other_feature_map_drops_the_presets_map_options():
    """recall's ``hybrid_mix`` is a Hedgehog option: ``--feature-map favor+`` alone does not carry it over."""
    cfg = config_from_args([*BASE, "--feature-map", "favor+"])
    assert cfg.rfa.feature_map_options == {} and cfg.rfa.decay == 128.0  # every other setting stays recall's
    kept = config_from_args([*BASE, "--feature-map", "t2r", "--feature-map-options", '{"hybrid_mix": false}'])
    assert kept.rfa.feature_map_options == {"hybrid_mix": False}
    assert RFAConfig.from_preset("recall", feature_map="favor+").feature_map_options == {}


def test_unknown_preset_is_refused_with_the_names(capsys):
    with pytest.raises(SystemExit):
        config_from_args([*BASE, "--preset", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"preset must be one of \['recall', 'window-only', 'encoder', 'favor\+', 'rfa'\], got 'nope'"):
        RFAConfig.from_preset("nope")
    with pytest.raises(ValueError, match="preset must be one of"):
        ConversionConfig.from_preset("nope", model="m")


def test_every_rfa_config_field_is_a_flag_with_its_help():
    conv = {f.name: f for f in fields(flags.flag_view(ConversionConfig))}
    train = {f.name: f for f in fields(flags.flag_view(RFAArguments))}
    for f in fields(RFAConfig):
        assert f.name in conv, f.name
        t = {"seed": "rfa_seed", "layers": "rfa_layers"}.get(f.name, f.name)
        assert t in train, t
        if f.name not in ("feature_map", "layers", "feature_map_options"):
            assert conv[f.name].metadata["help"] == f.metadata["help"]
    assert "seed" not in train  # the training loop's own --seed stays separate
    assert "rfa" not in conv and "rfa" not in train


@pytest.mark.parametrize("argv, attr, value", [
    (["--feature_map", "hedgehog", "--num-features", "32"], "rfa.num_features", 32),
    (["--preset", "rfa", "--gate"], "rfa.gate", True),
    (["--layers", "0,2"], "rfa.layers", [0, 2]),
    (["--layers", "3 1"], "rfa.layers", [1, 3]),
    (["--feature-map-options", '{"learnable": true}'], "rfa.feature_map_options", {"learnable": True}),
    (["--no-checkpoint-blocks"], "rfa.checkpoint_blocks", False),
    (["--backend", "torch"], "rfa.backend", "torch"),
    (["--seed", "7"], "seed", 7),
    (["--eval-tokens", "0"], "eval_tokens", None),
    (["--preset", "favor+", "--transfer_queries", "0"], "transfer_queries", None),
    (["--preset", "window-only"], "rfa.feature_map", "none"),
    (["--baselines"], "evaluates_window_only", True),
    (["--baselines", "false"], "baselines", False),
    (["--window_only_baseline"], "window_only_baseline", True),
    (["--preset", "favor+", "--learnable-projections"], "learnable_projections", True),
    (["--copy-gaps", "5", "6"], "copy_gaps", [5, 6]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_convert_flags(argv, attr, value):
    obj = config_from_args([*BASE, *argv])
    for part in attr.split("."):
        obj = getattr(obj, part)
    assert obj == value


@pytest.mark.parametrize("argv, match", [
    (["--num-features", "0"], "num_features"),
    (["--layers", "0,x"], "--layers must be comma-separated"),
    (["--feature-map-options", "[1]"], "--feature_map_options must be a JSON object"),
    (["--feature-map-options", "{oops"], "--feature_map_options must be a JSON object"),
    (["--feature-map", "none", "--window", "0", "--sinks", "0"], "window-only baseline"),
    (["--lora-context", "0"], "lora_context"),
])
def test_convert_bad_values_name_the_field(argv, match):
    with pytest.raises(ValueError, match=match):
        config_from_args([*BASE, *argv])


def test_required_flags_and_choices(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--model", "m", "--output", "o"])
    assert "--calibration_text" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_from_args([*BASE, "--feature-map", "nope"])
    assert "invalid choice" in capsys.readouterr().err
    text = convert_parser().format_help()
    assert "{elu,favor+,favor++,hedgehog,none,positive,rfa,rff,t2r}" in text.replace("\n", "")
    flat = " ".join(text.split())
    assert "(default: hedgehog)" in flat and "(default: 64)" in flat and "{recall,window-only,encoder,favor+,rfa}" in flat


def test_training_flags():
    model, data, rfa, loop = _parse_training(TRAIN_CLASSES, [*TRAIN, "--rfa_seed", "3", "--seed", "5", "--rfa-layers", "0,1", "--num_features", "16"], (".json",))
    assert rfa.rfa == RFAConfig.from_preset("recall", num_features=16, seed=3, layers=[0, 1]) and loop.seed == 5
    _, _, other, _ = _parse_training(TRAIN_CLASSES, [*TRAIN, "--preset", "favor+", "--window", "8"], (".json",))
    assert other.rfa == RFAConfig.from_preset("favor+", window=8)
    assert rfa.redraw_interval is None  # not given: a converted checkpoint keeps its own
    _, _, soft, _ = _parse_training(TRAIN_CLASSES, [*TRAIN, "--feature_map", "softmax", "--redraw_interval", "4"], (".json",))
    assert soft.rfa is None and soft.is_softmax and soft.redraw_interval == 4
    _, _, given, _ = _parse_training(TRAIN_CLASSES, [*TRAIN, "--redraw-interval", "4"], (".json",))
    assert given.rfa.redraw_interval == 4 == given.redraw_interval
    with pytest.raises(ValueError, match="rfa is None"):
        soft.to_rfa_config()
    with pytest.raises(ValueError, match="num_features"):
        _parse_training(TRAIN_CLASSES, [*TRAIN, "--num_features", "0"], (".json",))


def test_training_json_config_file(tmp_path, monkeypatch):
    cfg = {"model_name_or_path": "m", "train_file": "a.txt", "output_dir": "o", "feature_map": "hedgehog", "num_features": 8, "window": 0, "sinks": 0, "rfa_layers": "1"}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    monkeypatch.setattr("sys.argv", ["train", str(path)])
    _, _, rfa, _ = _parse_training(TRAIN_CLASSES, None, (".json",))
    assert rfa.rfa == RFAConfig.from_preset("recall", num_features=8, window=0, sinks=0, layers=[1])
    path.write_text(json.dumps({**cfg, "preset": "encoder"}))
    _, _, enc, _ = _parse_training(TRAIN_CLASSES, None, (".json",))
    assert enc.rfa == RFAConfig.from_preset("encoder", num_features=8, window=0, sinks=0, layers=[1])


def test_flat_dict_round_trips_and_keeps_the_report_keys():
    cfg = config_from_args([*BASE, "--feature-map", "hedgehog", "--layers", "1", "--seed", "3"])
    flat = cfg.to_dict()
    old_keys = {"model", "output", "feature_map", "num_features", "window", "sinks", "seed", "learnable_projections",
                "transfer_tokens", "lora_tokens", "eval_contexts", "baselines", "random_num_features", "push_to_hub"}
    assert old_keys <= set(flat) and "rfa" not in flat and flat["layers"] == [1]
    assert flags.from_flags(ConversionConfig, flat) == cfg
    report = _script("conversion/report.py")
    argv = shlex.split(report.command_of(flat))[2:]
    again = config_from_args([*argv, "--calibration-text", "c", "--eval-text", "e"])
    assert again.rfa == cfg.rfa and again.baselines is False
    odd = config_from_args([*BASE, "--preset", "rfa", "--gate", "--layers", "0,2", "--chunk-size", "16", "--backend", "torch",
                            "--no-checkpoint-blocks", "--redraw-interval", "5", "--feature-map-options", '{"x": 1}'])
    again = config_from_args([*shlex.split(report.command_of(odd.to_dict()))[2:], "--calibration-text", "c", "--eval-text", "e"])
    assert again.rfa == odd.rfa


def test_report_command_reproduces_every_field_a_run_set():
    """RESULTS' commands once dropped the memory, decay, encoder and baseline-window flags."""
    report = _script("conversion/report.py")
    cfg = config_from_args([*BASE, "--feature-map", "hedgehog", "--num-features", "32", "--decay", "128", "--feature-input", "unrotated",
                            "--memory-score", "feature_error", "--memory-after-training", "256", "--memory-every", "32",
                            "--encoder-pack-tokens", "512", "--encoder-max-length", "512", "--baseline-windows", "32", "64",
                            "--copy-gaps", "512", "--train-autocast", "off", "--no-evaluate-before-transfer", "--feature-map-options", '{"hybrid_mix": false}',
                            "--transfer-schedule", "cosine", "--random-feature-map", "hedgehog", "--no-progress"])
    argv = shlex.split(report.command_of(cfg.to_dict()))[2:]
    again = config_from_args([*argv, "--calibration-text", "c", "--eval-text", "e"])
    mine, theirs = cfg.to_dict(), again.to_dict()
    for k in ("progress", "calibration_text", "eval_text"):
        mine.pop(k), theirs.pop(k)
    assert theirs == mine


def test_evaluate_command_parses_with_hf_argument_parser(capsys):
    from hf_rfa.cli import EvaluateArguments, evaluate_main

    with pytest.raises(ValueError, match="max_tokens"):
        EvaluateArguments(model="m", text="t", max_tokens=0)
    with pytest.raises(ValueError, match="needs --text"):
        EvaluateArguments(model="m", task="copy")
    for argv, needle in ((["--model", "m", "--task", "nope"], "invalid choice"), (["--model", "m", "--task", "passkey", "--max_tokens", "0"], "--max-tokens")):
        with pytest.raises(SystemExit):
            evaluate_main(argv)
        assert needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_main(["--help"])
    assert "{perplexity,copy,passkey}" in capsys.readouterr().out


def test_report_long_range_table_shows_the_key_accuracy_only_where_it_differs():
    report = _script("conversion/report.py")
    rep = {"rows": [{"variant": "a", "context": 1024, "perplexity": 20.0}, {"variant": "b", "context": 1024, "perplexity": 21.0}],
           "long_range": [
               {"variant": "a", "passkey": {"mean": {"2048": 1 / 3}, "key_mean": {"2048": 1.0}}},
               {"variant": "b", "passkey": {"mean": {"2048": 0.5}, "key_mean": {"2048": 0.5}}},
           ]}
    table = report.long_range_table(rep)
    assert "| a | 20.00 | 33% (key 100%) |" in table
    assert "| b | 21.00 | 50% |" in table
    old = {"rows": rep["rows"][:1], "long_range": [{"variant": "a", "passkey": {"mean": {"2048": 1.0}}}]}  # older runs measured no key accuracy
    assert "| a | 20.00 | 100% |" in report.long_range_table(old)


def test_main_job_dry_run_prints_the_plan_and_no_job_time(tmp_path, capsys, monkeypatch):
    """``conversion/main_job.py --dry-run``: the memory plan, and no "main job: N min wall" line
    (no job ran); nothing is written to the output folder."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "conversion"))  # its `import convert`, as when run as a script
    main_job = _script("conversion/main_job.py")
    main_job.main(["--quick", "--dry-run", "--output", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "Peak:" in out and "| part |" in out
    assert "main job:" not in out
    assert not (tmp_path / "out" / "report.json").exists()
