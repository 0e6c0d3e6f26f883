"""The conversion workflow is an explicit ordered list of small stages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hf_rfa.recipes.conversion import stages
from hf_rfa.recipes.conversion.config import ConversionConfig
from hf_rfa.recipes.conversion.loading import CAUSAL_LM, CLASSIFIER, ENCODER
from hf_rfa.recipes.conversion.state import EVALUATORS, State

ROOT = Path(__file__).resolve().parents[2]


def test_stage_lists_read_top_to_bottom():
    names = {kind: [f.__name__ for f in stages.STAGES[kind]] for kind in (CAUSAL_LM, ENCODER, CLASSIFIER)}
    assert names[CAUSAL_LM] == [
        "load_texts", "evaluate_original", "measure_split", "random_baselines", "window_only_baseline", "convert_target", "init_mixing",
        "evaluate_untrained", "attention_transfer", "lora", "causal_metrics", "generation_sample",
    ]
    assert names[ENCODER] == names[CLASSIFIER] == [
        "load_sentences", "embed_original", "random_baselines", "window_only_baseline", "convert_target", "init_mixing",
        "evaluate_untrained", "attention_transfer", "encoder_metrics",
    ]
    assert set(EVALUATORS) == set(stages.STAGES)


def test_run_stages_runs_the_kinds_list_in_order(monkeypatch):
    seen = []
    fake = [lambda s, i=i: seen.append((i, s.kind)) for i in range(3)]
    monkeypatch.setitem(stages.STAGES, ENCODER, fake)
    state = State(cfg=ConversionConfig(model="m"), model=None, tok=None, kind=ENCODER, report={"rows": [], "stages": {}})
    assert stages.run_stages(state) is state
    assert seen == [(0, ENCODER), (1, ENCODER), (2, ENCODER)]


def test_missing_texts_are_refused_by_the_first_stage():
    for kind in (CAUSAL_LM, ENCODER):
        state = State(cfg=ConversionConfig(model="m"), model=None, tok=None, kind=kind, report={"rows": [], "stages": {}})
        with pytest.raises(ValueError, match="calibration_text and eval_text are required"):
            stages.STAGES[kind][0](state)


WORKFLOW = [ROOT / "hf_rfa" / "recipes" / "conversion" / f"{m}.py" for m in ("config", "loading", "state", "stages", "pipeline")]


@pytest.mark.parametrize("path", WORKFLOW + [ROOT / "hf_rfa" / "recipes" / "flags.py", ROOT / "hf_rfa" / "cli.py"], ids=lambda p: p.name)
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 400, path
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert long == [], long
