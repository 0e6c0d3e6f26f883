"""Conversion runs on tiny models (hf_rfa.recipes.conversion.pipeline): the rows a causal and an
encoder run report, the window-only baseline with the recipe's decode state, and the exact memory
switched on after training, uniform or split by layer."""

from __future__ import annotations

import json

import pytest

import hf_rfa
from conversion_runs import WORDS, tiny_dir, word_tokenizer  # noqa: F401 - tiny_dir: the shared fixture
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import pipeline


def test_causal_run_carries_the_window_only_baseline_and_long_range_rows(tiny_dir, tmp_path):
    """Every hybrid conversion reports window-only (same window/sinks, its own LoRA with the same
    token budget) next to the feature rows, and the copy task for every variant."""
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["llama"], output=str(tmp_path / "out"), rfa=hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=4, sinks=1),
        transfer_tokens=0, lora_tokens=128, context=64, eval_contexts=[64], eval_tokens=256, error_tokens=64,
        calibration_text=tiny_dir["cal"], eval_text=tiny_dir["eval"], baselines=False, window_only_baseline=True, copy_gaps=[20], copy_draws=2,
        generate_prompt=None, progress=False,
    )
    rep = pipeline.run(cfg)
    names = [r["variant"] for r in rep["rows"]]
    wo = "window-only: window 4 + sinks 1, no features"
    assert names == ["original (softmax)", f"{wo}, untrained", f"{wo}, after LoRA", "favor+ m=16 + window 4 + sinks 1, untrained",
                     "favor+ m=16 + window 4 + sinks 1, after LoRA"]
    assert rep["stages"]["lora (window-only)"]["tokens"] == rep["stages"]["lora"]["tokens"] == 128
    assert [e["variant"] for e in rep["long_range"]] == names
    assert all(set(e["copy"]) == {"20"} and e["copy"]["20"]["second"] > 0 for e in rep["long_range"])
    # the trained window-only model was a copy: the untrained rows of the recipe are not LoRA-tuned
    wo_rows = {r["variant"]: r["perplexity"] for r in rep["rows"]}
    assert wo_rows[f"{wo}, untrained"] != wo_rows[f"{wo}, after LoRA"]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["long_range"][0]["variant"] == "original (softmax)"


def test_encoder_run_carries_the_window_only_baseline(tiny_dir, tmp_path):
    """An encoder hybrid's report, metrics and model card carry window-only (same window and sinks,
    no training: encoders have no LoRA stage) next to the features; texts are cut at
    ``encoder_max_length`` tokens (a longer limit changes what is compared)."""
    def run(out, n):
        cfg = pipeline.ConversionConfig(
            model=tiny_dir["bert"], output=str(tmp_path / out), rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=2, sinks=1),
            transfer_tokens=128, error_tokens=64, encoder_max_length=n, calibration_text=tiny_dir["sent"], eval_text=tiny_dir["eval"],
            baselines=False, window_only_baseline=True, baseline_windows=[2, 6], progress=False,
        )
        return pipeline.run(cfg)

    rep = run("out", 8)
    names = [r["variant"] for r in rep["rows"]]
    wo = "window-only: window 2 + sinks 1, no features, untrained"
    assert names == ["original (softmax)", wo, "window-only: window 6 + sinks 1, no features, untrained",
                     "hedgehog m=8 + window 2 + sinks 1, untrained", "hedgehog m=8 + window 2 + sinks 1, after attention transfer"]
    assert "lora (window-only)" not in rep["stages"]
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["baseline_variant"] == wo and saved["final_variant"] == names[-1]
    rows = {r["variant"]: r for r in rep["rows"]}
    assert rows[wo]["cosine_mean"] < 1.0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "window_only_mean" in card and f"{rows[wo]['cosine_mean']:.4g}"[:5] in card
    longer = {r["variant"]: r for r in run("out32", 32)["rows"]}
    assert longer[wo]["cosine_mean"] != rows[wo]["cosine_mean"]
    with pytest.raises(ValueError, match="encoder_max_length"):
        pipeline.ConversionConfig(model="m", encoder_max_length=0)


def test_pack_texts_joins_consecutive_lines_in_order(tiny_dir):
    tok = word_tokenizer()
    lines = [" ".join(WORDS[i : i + 3]) for i in range(7)]  # 3 tokens each
    packed = evaluation.pack_texts(tok, lines, 7)
    assert packed == [" ".join(lines[0:3]), " ".join(lines[3:6])]  # 9 tokens each; the 3-token rest dropped
    assert evaluation.pack_texts(tok, lines, 100) == []
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="min_tokens"):
            evaluation.pack_texts(tok, lines, bad)


def test_encoder_run_on_packed_passages(tiny_dir, tmp_path):
    """``encoder_pack_tokens``: calibration, training and evaluation texts become passages of at
    least that many tokens (here 4 lines of 12 words), so fewer, longer texts are compared."""
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["bert"], output=str(tmp_path / "out"), rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=2, sinks=1),
        transfer_tokens=128, error_tokens=64, encoder_pack_tokens=40, encoder_max_length=64, calibration_text=tiny_dir["sent"],
        eval_text=tiny_dir["sent"], baselines=False, progress=False,
    )
    rep = pipeline.run(cfg)
    assert {r["sentences"] for r in rep["rows"]} == {10}  # 40 lines of 12 tokens -> 10 passages of 48
    bad = pipeline.ConversionConfig(**{**cfg.__dict__, "output": str(tmp_path / "bad"), "encoder_pack_tokens": 10_000})
    with pytest.raises(ValueError, match="calibration_text has fewer than encoder_pack_tokens=10000 tokens"):
        pipeline.run(bad)
    with pytest.raises(ValueError, match="encoder_pack_tokens"):
        pipeline.ConversionConfig(model="m", encoder_pack_tokens=-1)


def test_encoder_max_length_beyond_the_model_is_refused(tiny_dir, tmp_path):
    from transformers import AutoConfig

    limit = AutoConfig.from_pretrained(tiny_dir["bert"]).max_position_embeddings
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["bert"], output=str(tmp_path / "out"), rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=2, sinks=1),
        transfer_tokens=0, encoder_max_length=limit + 1, calibration_text=tiny_dir["sent"], eval_text=tiny_dir["sent"], baselines=False, progress=False,
    )
    with pytest.raises(ValueError, match=f"encoder_max_length must be at most the model's max_position_embeddings \\({limit}\\)"):
        pipeline.run(cfg)
    assert not (tmp_path / "out").exists()


def test_main_job_shaped_run_has_the_equal_state_baseline_and_skips_the_untransferred_map(tiny_dir, tmp_path):
    """The main job's shape on a tiny Llama: a learned map on un-rotated q/k with a decay, a second
    window-only baseline (``baseline_windows``) after its own LoRA, no evaluation of the map before
    transfer (``evaluate_before_transfer=False``); the export loads back with the setting."""
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["llama"], output=str(tmp_path / "out"),
        rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1, decay=16.0, feature_input="unrotated"),
        transfer_tokens=128, lora_tokens=64, context=32, eval_contexts=[32], eval_tokens=128, error_tokens=64,
        calibration_text=tiny_dir["cal"], eval_text=tiny_dir["eval"], baselines=False, window_only_baseline=True, baseline_windows=[8],
        evaluate_before_transfer=False, generate_prompt=None, progress=False,
    )
    rep = pipeline.run(cfg)
    names = [r["variant"] for r in rep["rows"]]
    wo = "window-only: window 4 + sinks 1, no features"
    label = "hedgehog m=8 + window 4 + sinks 1 + decay 16, un-rotated q/k"
    assert names == ["original (softmax)", f"{wo}, untrained", f"{wo}, after LoRA", "window-only: window 8 + sinks 1, no features, after LoRA",
                     f"{label}, after attention transfer", f"{label}, after transfer + LoRA"]
    assert rep["stages"]["lora (window-only 8)"]["tokens"] == rep["stages"]["lora"]["tokens"] >= 64
    model, _, _ = pipeline.load_model(str(tmp_path / "out"))
    assert hf_rfa.rfa_config_of(model).feature_input == "unrotated"
    assert model.model.layers[0].self_attn.rfa.feature_input == "unrotated"


def test_memory_after_training_rows_and_published_model(tiny_dir, tmp_path):
    """``memory_after_training``: the window-only baseline after its LoRA and the recipe after
    transfer + LoRA are evaluated again with the exact memory switched on (the baseline ranks by
    ‖v‖, the recipe by its memory_score); the published model carries the memory."""
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["llama"], output=str(tmp_path / "out"),
        rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1, decay=16.0, feature_input="unrotated", memory_score="feature_error", memory_every=8),
        transfer_tokens=64, lora_tokens=64, context=32, eval_contexts=[32], eval_tokens=128, error_tokens=64,
        calibration_text=tiny_dir["cal"], eval_text=tiny_dir["eval"], baselines=False, window_only_baseline=True, memory_after_training=3,
        evaluate_before_transfer=False, generate_prompt=None, progress=False, copy_gaps=[8], copy_draws=1,
    )
    rep = pipeline.run(cfg)
    names = [r["variant"] for r in rep["rows"]]
    wo = "window-only: window 4 + sinks 1, no features"
    label = "hedgehog m=8 + window 4 + sinks 1 + decay 16, un-rotated q/k"
    assert names == ["original (softmax)", f"{wo}, untrained", f"{wo}, after LoRA",
                     "window-only: window 4 + sinks 1 + memory 3 (value_norm), no features, after LoRA",
                     f"{label}, after attention transfer", f"{label}, after transfer + LoRA", f"{label}, after transfer + LoRA + memory 3 (feature_error)"]
    ppl = {r["variant"]: r["perplexity"] for r in rep["rows"]}
    assert ppl[names[-1]] != ppl[names[-2]] and ppl[names[3]] != ppl[names[2]]  # the memory is used
    assert rep["final_variant"] == names[-1]
    model, _, _ = pipeline.load_model(str(tmp_path / "out"))
    cfg_out = hf_rfa.rfa_config_of(model)
    assert (cfg_out.memory, cfg_out.memory_every, cfg_out.memory_score) == (3, 8, "feature_error")
    assert model.model.layers[0].self_attn.rfa.memory == 3
    # past the model's positions its memory keys count as the farthest trained distance (tests/hf/test_hf_memory_distance.py)
    assert cfg_out.memory_distance == model.config.max_position_embeddings - 1 and model.model.layers[0].self_attn.rfa.memory_rope is not None
    with pytest.raises(ValueError, match="memory_after_training"):
        pipeline.ConversionConfig(model="x", rfa=hf_rfa.RFAConfig(memory=2), memory_after_training=3)
    with pytest.raises(ValueError, match="memory_after_training"):
        pipeline.ConversionConfig(model="x", memory_after_training=-1)


def test_memory_split_by_induction_in_the_recipe_and_its_baseline(tiny_dir, tmp_path):
    """``memory_split="induction"``: the same total of memory keys split over the layers by the
    original's induction share (measured before conversion, in the report), used by the window-only
    baseline and by the published recipe alike."""
    cfg = pipeline.ConversionConfig(
        model=tiny_dir["llama"], output=str(tmp_path / "out"),
        rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1, feature_input="unrotated", memory_score="feature_error", memory_every=8),
        transfer_tokens=64, lora_tokens=64, context=32, eval_contexts=[32], eval_tokens=128, error_tokens=64,
        calibration_text=tiny_dir["cal"], eval_text=tiny_dir["eval"], baselines=False, window_only_baseline=True, memory_after_training=3,
        memory_split="induction", memory_floor=0.34, evaluate_before_transfer=False, generate_prompt=None, progress=False, copy_gaps=[8], copy_draws=1,
    )
    rep = pipeline.run(cfg)
    assert rep["machine"]["cpu"] and rep["machine"]["threads"] >= 1 and "gpu" not in rep["machine"]  # where the figures were measured
    split = rep["memory_split"]
    assert sum(split["sizes"]) == 3 * 2 and min(split["sizes"]) >= 1 == split["floor"] and split["gaps"] == [8]
    assert len(split["induction"]) == 2 and all(len(h) == 2 and all(0 < x < 1 for x in h) for h in split["induction"])
    names = [r["variant"] for r in rep["rows"]]
    assert "window-only: window 4 + sinks 1 + memory 3 by layer (value_norm), no features, after LoRA" in names
    assert names[-1].endswith("after transfer + LoRA + memory 3 by layer (feature_error)") and rep["final_variant"] == names[-1]
    model, _, _ = pipeline.load_model(str(tmp_path / "out"))
    assert hf_rfa.rfa_config_of(model).memory_per_layer == split["sizes"]
    assert [layer.self_attn.rfa.memory for layer in model.model.layers] == split["sizes"]
