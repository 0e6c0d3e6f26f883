"""95% intervals of the evaluation figures (hf_rfa.recipes.intervals), the natural passkey filler,
the evaluation grid of hf-rfa-evaluate, and the intervals in the report, results page and model card."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random

import numpy as np
import pytest
import torch

from hf_rfa.recipes import evaluation, grid, intervals, long_range
from tiny_models import VOCAB, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- the bootstrap
def test_bootstrap_equals_a_hand_computed_bootstrap():
    """The same seeded index draws, resampled and averaged by hand, give the same percentiles."""
    values, weights = [2.0, 3.5, 1.0, 4.0, 2.5], [10, 30, 20, 5, 40]
    got = intervals.bootstrap_ci(values, weights, seed=7, resamples=500)
    idx = np.random.default_rng(7).integers(0, 5, size=(500, 5))
    stats = []
    for row in idx:
        num = sum(values[i] * weights[i] for i in row)
        den = sum(weights[i] for i in row)
        stats.append(num / den)
    stats.sort()
    # numpy's default percentile: linear interpolation between order statistics at (n-1)·q
    def pct(q):
        pos = (len(stats) - 1) * q
        lo = math.floor(pos)
        return stats[lo] + (stats[min(lo + 1, len(stats) - 1)] - stats[lo]) * (pos - lo)

    assert got == pytest.approx([pct(0.025), pct(0.975)], abs=1e-12)


def test_bootstrap_of_two_units_has_the_exact_distribution():
    """Two units: the resampled weighted mean is v0 (1/4), the pooled mean (1/2) or v1 (1/4)."""
    # 0 and 1 with weights 1 and 3: the mixed resamples average to 0.75, not 0.5
    assert intervals.bootstrap_ci([0.0, 1.0], [1, 3], level=0.4) == [0.75, 0.75]
    assert intervals.bootstrap_ci([0.0, 1.0], level=0.4) == [0.5, 0.5]
    assert intervals.bootstrap_ci([0.0, 1.0]) == [0.0, 1.0]
    # a perplexity over two windows: NLL sums 10 and 90 over 10 and 30 tokens (means 1 and 3)
    assert intervals.perplexity_ci([10.0, 90.0], [10, 30]) == pytest.approx([math.e, math.e ** 3])


def test_bootstrap_is_seeded_contains_the_estimate_and_narrows_with_more_units():
    rng = random.Random(0)
    small = [rng.gauss(3.0, 1.0) for _ in range(8)]
    large = small + [rng.gauss(3.0, 1.0) for _ in range(120)]
    a, b = intervals.bootstrap_ci(small, seed=1), intervals.bootstrap_ci(small, seed=1)
    assert a == b and intervals.bootstrap_ci(small, seed=2) != a
    for vals in (small, large):
        lo, hi = intervals.bootstrap_ci(vals)
        assert lo < sum(vals) / len(vals) < hi
    wide, narrow = intervals.bootstrap_ci(small), intervals.bootstrap_ci(large)
    assert narrow[1] - narrow[0] < 0.6 * (wide[1] - wide[0])
    assert intervals.bootstrap_ci([4.0] * 6) == [4.0, 4.0]
    assert intervals.bootstrap_ci([4.0]) is None and intervals.perplexity_ci([3.0], [10]) is None
    with pytest.raises(ValueError, match="weights"):
        intervals.bootstrap_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="level"):
        intervals.bootstrap_ci([1.0, 2.0], level=1.0)


def test_paired_ratio_interval_cancels_what_the_windows_share():
    """Two models on the same windows, one 5% worse on every window: their own intervals overlap
    widely, the paired interval of the ratio is the 5% exactly."""
    rng = random.Random(1)
    tokens = [1023] * 12
    ref = [n * rng.uniform(2.2, 3.6) for n in tokens]  # windows of very different difficulty
    worse = [s + n * math.log(1.05) for s, n in zip(ref, tokens)]
    a, b = intervals.perplexity_ci(worse, tokens), intervals.perplexity_ci(ref, tokens)
    assert a[0] < b[1]  # the two models' own intervals overlap
    assert intervals.ratio_ci(worse, ref, tokens) == pytest.approx([1.05, 1.05])
    noisy = [s + n * rng.gauss(0.05, 0.02) for s, n in zip(ref, tokens)]
    lo, hi = intervals.ratio_ci(noisy, ref, tokens, seed=4)
    diffs = [(x - y) / n for x, y, n in zip(noisy, ref, tokens)]
    assert [lo, hi] == pytest.approx([math.exp(v) for v in intervals.bootstrap_ci(diffs, tokens, seed=4)])
    assert lo < math.exp(sum(diffs) / len(diffs)) < hi
    row, orig = {"window_nll": noisy, "window_tokens": tokens}, {"window_nll": ref, "window_tokens": tokens}
    assert intervals.paired_ratio_ci(row, orig, seed=4) == [lo, hi]
    assert intervals.paired_ratio_ci(row, {"window_nll": ref[:6], "window_tokens": tokens[:6]}) is None  # other windows
    assert intervals.paired_ratio_ci(row, {"perplexity": 3.0}) is None  # a report without the sums
    with pytest.raises(ValueError, match="same windows"):
        intervals.ratio_ci(noisy, ref[:3], tokens)


def test_stratified_bootstrap_resamples_each_group_and_averages_them():
    groups = [[1, 1, 1, 1], [0, 1, 0, 1]]
    lo, hi = intervals.bootstrap_ci(groups, strata=True, resamples=2000, seed=3)
    # the first group never varies: the mean moves only with the second, half as much
    half = intervals.bootstrap_ci(groups[1], resamples=2000, seed=3)
    assert lo == pytest.approx(0.5 + half[0] / 2) and hi == pytest.approx(0.5 + half[1] / 2)
    assert intervals.bootstrap_ci([[1, 0], [1]], strata=True) is None


def test_fmt():
    assert intervals.fmt(19.957, [19.5, 20.44]) == "19.96 [19.50, 20.44]"
    assert intervals.fmt(19.957, None) == "19.96"
    assert intervals.fmt(0.8, [0.6, 1.0], percent=True) == "80% [60%, 100%]"


# --------------------------------------------------------------------------- the evaluators
def test_perplexity_carries_the_window_sums_and_their_interval():
    ids = torch.randint(2, VOCAB, (2048,), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    r = evaluation.perplexity(model, ids, 64, 1024, progress=False)
    assert r["windows"] == 16 == len(r["window_nll"]) and sum(r["window_tokens"]) == r["tokens"] == 16 * 63
    assert math.exp(sum(r["window_nll"]) / r["tokens"]) == pytest.approx(r["perplexity"])
    lo, hi = r["ci95"]
    assert lo < r["perplexity"] < hi
    assert r["ci95"] == intervals.perplexity_ci(r["window_nll"], r["window_tokens"], seed=0)
    assert evaluation.perplexity(model, ids, 64, 64, progress=False)["ci95"] is None  # one window


def test_copy_task_interval_over_draws():
    ids = torch.randint(2, 100, (4000,), generator=torch.Generator().manual_seed(0))
    model = tiny_model("llama")
    r = long_range.copy_task(model, ids, gap=40, passage=24, draws=6, skip=4, progress=False)
    assert r["second_ci95"][0] <= r["second"] <= r["second_ci95"][1]
    assert r["first_ci95"][0] <= r["first"] <= r["first_ci95"][1]
    assert r["second_ci95"] == intervals.copy_ci([math.log(p) for p in r["per_draw"]], seed=0)
    assert long_range.copy_task(model, ids, gap=40, passage=24, draws=1, skip=4, progress=False)["second_ci95"] is None


class _DigitTokenizer:
    """One token per character (digits single tokens, like SmolLM2's); batches of texts too."""

    def __call__(self, text, add_special_tokens=False):
        if isinstance(text, list):
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        return {"input_ids": [ord(c) % 97 + 2 for c in text]}


class _EvenKeys(torch.nn.Module):
    """Predicts its input's next token when the sequence's key (its last five tokens) ends in an
    even digit, else a wrong token: right on about half of the trials."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        nxt = torch.roll(input_ids, -1, dims=1)
        even = ((input_ids[:, -1] - 2 - ord("0") % 97) % 2 == 0)[:, None]
        return type("Out", (), {"logits": torch.nn.functional.one_hot(torch.where(even, nxt, torch.ones_like(nxt)), 200).float()})()


def test_passkey_intervals_over_trials():
    r = long_range.passkey_task(_EvenKeys(), _DigitTokenizer(), lengths=[450], depths=[0.1, 0.9], trials=12, progress=False)
    hits = r["hits"]["450"]
    assert all(len(h) == 12 for h in hits.values())
    for d, h in hits.items():
        assert r["accuracy"]["450"][d] == sum(h) / 12
        assert r["accuracy_ci95"]["450"][d] == intervals.bootstrap_ci(h, seed=0)
    assert 0 < r["mean"]["450"] < 1  # the model is right on some trials only
    lo, hi = r["mean_ci95"]["450"]
    assert lo < r["mean"]["450"] < hi
    assert r["mean_ci95"]["450"] == intervals.bootstrap_ci([hits["0.1"], hits["0.9"]], strata=True, seed=0)
    assert r["filler"] == "repeated"


def test_natural_filler_prompts_put_the_key_between_sentences_at_its_depth():
    tok = _DigitTokenizer()
    text = " ".join(f"Sentence number {i} tells of the river and the town." for i in range(400))
    filler = long_range.natural_filler(tok, text, "test text")
    assert filler.starts[0] == 0 and bool((filler.starts[1:] > filler.starts[:-1]).all())
    assert filler.ends[-1] == filler.ids.numel() and filler.ends[:-1].tolist() == filler.starts[1:].tolist()  # short sentences: one piece each
    needle = tok(" The pass key is 12345")["input_ids"]
    question = tok(" " + long_range.PASSKEY_QUESTION)["input_ids"]
    dot = tok(".")["input_ids"][0]
    lengths = set()
    for depth in (0.1, 0.5, 0.9):
        end = int(filler.ends[60])
        prompt, answer = long_range.passkey_prompt(tok, 2000, depth, "12345", filler, end)
        lengths.add(len(prompt))
        body = prompt.tolist()
        pos = next(i for i in range(len(body)) if body[i : i + len(needle)] == needle)
        assert abs(pos / len(prompt) - depth) < 0.1
        room = len(body) - len(tok(long_range.PASSKEY_INTRO)["input_ids"]) - len(question) - len(tok(" The pass key is 12345. Remember it. 12345 is the pass key.")["input_ids"])
        at = pos - len(tok(long_range.PASSKEY_INTRO)["input_ids"]) + end - room  # where the key went in the filler's own tokens
        assert at in filler.starts.tolist() and body[pos - 1] == dot  # between two sentences
        assert body[-len(question) - 1] == dot and body[-len(question):] == question  # the question follows a whole sentence
        assert body[-len(question) - 60 : -len(question)] == filler.ids[end - 60 : end].tolist()
    assert len(lengths) == 1  # every prompt of one length is as long: one batch
    # the natural filler changes the prompts, keeps the keys, and is seeded
    model = _EvenKeys()
    a = long_range.passkey_task(model, tok, lengths=[450], depths=[0.5], trials=6, progress=False, filler=filler)
    b = long_range.passkey_task(model, tok, lengths=[450], depths=[0.5], trials=6, progress=False, filler=filler)
    rep = long_range.passkey_task(model, tok, lengths=[450], depths=[0.5], trials=6, progress=False)
    assert a == b and a["filler"] == "natural (test text)" and a["hits"] == rep["hits"]  # the same keys
    g = torch.Generator().manual_seed(0 * 1_000_003 + 450 * 101 + 50)
    [int(torch.randint(10000, 100000, (1,), generator=g)) for _ in range(6)]
    ends = long_range._filler_ends(filler, 450, 6, g)
    assert len(set(ends)) > 1 and set(ends) <= set(filler.ends.tolist()) and min(ends) >= 450
    with pytest.raises(ValueError, match="too few"):
        long_range.passkey_task(model, tok, lengths=[450], depths=[0.5], trials=1, progress=False,
                                filler=long_range.natural_filler(tok, "Short. Text.", "short"))


def test_bbc_news_is_a_text_source(monkeypatch):
    from hf_rfa import assets

    monkeypatch.setattr(assets, "bbc_news", lambda split: [{"title": "T1", "text": "Body one.", "label": 0}, {"title": "T2", "text": "Body two.", "label": 3}])
    assert evaluation.load_text("bbc_news:test") == "T1\nBody one.\n\nT2\nBody two."
    assert evaluation.load_labelled("bbc_news:test") == (["Body one.", "Body two."], [0, 3])


# --------------------------------------------------------------------------- the grid and hf-rfa-evaluate
from conversion_runs import WORDS  # noqa: E402 - the word-level tokenizer's words


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conversion_runs import word_tokenizer

    root = tmp_path_factory.mktemp("tiny_eval")
    tiny_model("llama").save_pretrained(root / "llama")
    word_tokenizer().save_pretrained(root / "llama")
    rng = random.Random(0)
    for name in ("a", "b"):
        (root / f"{name}.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + " ." for _ in range(400)))
    return {"model": str(root / "llama"), "a": str(root / "a.txt"), "b": str(root / "b.txt"), "root": root}


def test_grid_flags_override_the_named_grid():
    from hf_rfa.cli import EvaluateArguments, _grid_of

    a = EvaluateArguments(model="m", grid="full", contexts=[64], trials=3)
    g = _grid_of(a, ["--model", "m", "--grid", "full", "--contexts", "64", "--trials=3"])
    full = grid.GRIDS["full"]
    assert g.contexts == (64,) and g.trials == 3
    assert (g.texts, g.gaps, g.lengths, g.draws, g.max_tokens, g.fillers) == (full.texts, full.gaps, full.lengths, full.draws, full.max_tokens, full.fillers)
    # the full grid is the evaluation a published model gets
    assert full.max_tokens >= 32768 and {8192, 16384} <= set(full.contexts) and full.gaps == (512, 1536, 3584, 7680) and full.draws >= 8
    assert full.lengths == (1024, 2048, 4096, 8192) and len(full.depths) == 3 and full.trials >= 10
    assert set(full.fillers) == {"repeated", "natural"} and len(full.texts) == 2 and full.filler_text == "wikipedia:eval"
    assert full.longest == 16384
    with pytest.raises(ValueError, match="grid"):
        EvaluateArguments(model="m", grid="huge")
    with pytest.raises(ValueError, match="--texts"):
        EvaluateArguments(model="m", grid="full", text="x")
    with pytest.raises(ValueError, match="fillers"):
        EvaluateArguments(model="m", task="passkey", fillers=["books"])


def test_evaluate_grid_on_a_tiny_model_writes_every_figure_with_its_interval(tiny, tmp_path, capsys):
    from hf_rfa.cli import evaluate_main

    out_file = tmp_path / "eval" / "grid.json"
    argv = ["--model", tiny["model"], "--grid", "full", "--texts", tiny["a"], tiny["b"], "--contexts", "32", "64", "--max-tokens", "512",
            "--gaps", "16", "48", "--passage", "24", "--draws", "4", "--lengths", "220", "--depths", "0.2", "0.8", "--trials", "3",
            "--filler-text", tiny["a"], "--output", str(out_file), "--no-progress"]
    out = evaluate_main(argv)
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(out_file.read_text()) == json.loads(json.dumps(out))
    assert out["task"] == "grid" and out["name"] == "full" and set(out["texts"]) == {tiny["a"], tiny["b"]}
    assert out["threads"] == torch.get_num_threads()  # the timing's thread count, kept with the result
    for e in out["texts"].values():
        for ctx in ("32", "64"):
            p = e["perplexity"][ctx]
            assert p["tokens"] == (512 // int(ctx)) * (int(ctx) - 1) and p["ci95"][0] <= p["perplexity"] <= p["ci95"][1]
        for gap in ("16", "48"):
            c = e["copy"][gap]
            assert c["draws"] == 4 and c["second_ci95"][0] <= c["second"] <= c["second_ci95"][1]
    assert set(out["passkey"]) == {"repeated", "natural"}
    assert out["passkey"]["natural"]["filler"] == f"natural ({tiny['a']})"
    assert out["passkey"]["repeated"]["hits"]["220"].keys() == {"0.2", "0.8"}
    md = (tmp_path / "eval" / "grid.md").read_text()
    ppl = out["texts"][tiny["a"]]["perplexity"]["32"]
    assert intervals.fmt(ppl["perplexity"], ppl["ci95"]) + " (16 × 32)" in md
    assert "| natural (" in md and "| repeated |" in md and "gap 48" in md
    # the 32-token windows that begin where a 64-token one did were read from its forward: the same figures
    alone = evaluate_main(["--model", tiny["model"], "--text", tiny["a"], "--context", "32", "--max-tokens", "512", "--no-progress"])
    assert ppl["window_tokens"] == alone["window_tokens"] and ppl["window_nll"] == pytest.approx(alone["window_nll"], rel=1e-6)
    # seeded: the same command gives the same figures
    again = evaluate_main(argv)
    for k in ("texts", "passkey"):
        assert again[k] == out[k]


def test_evaluate_single_tasks_report_intervals(tiny, capsys):
    from hf_rfa.cli import evaluate_main

    r = evaluate_main(["--model", tiny["model"], "--text", tiny["a"], "--context", "32", "--max-tokens", "256", "--no-progress"])
    assert r["windows"] == 8 and r["ci95"][0] < r["perplexity"] < r["ci95"][1]
    # each window's NLL sum and tokens, for paired comparisons of two models (intervals.ratio_ci)
    assert len(r["window_nll"]) == 8 and r["window_tokens"] == [31] * 8
    assert math.exp(sum(r["window_nll"]) / sum(r["window_tokens"])) == pytest.approx(r["perplexity"], rel=1e-9)
    both = evaluate_main(["--model", tiny["model"], "--task", "passkey", "--lengths", "220", "--trials", "2", "--fillers", "repeated", "natural",
                          "--filler-text", tiny["b"], "--no-progress"])
    assert set(both["by_filler"]) == {"repeated", "natural"} and "mean_ci95" in both["by_filler"]["natural"]
    one = evaluate_main(["--model", tiny["model"], "--task", "passkey", "--lengths", "220", "--trials", "2", "--no-progress"])
    assert one["filler"] == "repeated" and "mean_ci95" in one
    capsys.readouterr()


# --------------------------------------------------------------------------- report, results page, model card
def _report_module():
    spec = importlib.util.spec_from_file_location("conversion_report", os.path.join(ROOT, "conversion", "report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_shows_intervals_where_a_report_has_them():
    report = _report_module()
    rep = {"kind": "causal-lm", "config": {"model": "m"}, "rows": [
        {"variant": "original (softmax)", "context": 1024, "perplexity": 20.0, "perplexity_ci95": [19.0, 21.25], "eval_tokens": 4092},
        {"variant": "old", "context": 1024, "perplexity": 22.0, "eval_tokens": 4092}],
        "long_range": [{"variant": "original (softmax)", "copy": {"512": {"second": 1.2, "first": 20.0, "second_ci95": [1.1, 1.31]}},
                        "passkey": {"mean": {"1024": 0.5}, "mean_ci95": {"1024": [0.25, 0.75]}, "key_mean": {"1024": 1.0}, "key_mean_ci95": {"1024": None}}},
                       {"variant": "old", "copy": {"512": {"second": 9.0, "first": 20.0}}, "passkey": {"mean": {"1024": 0.5}}}]}
    table = report.run_table(rep)
    assert "| 20.00 [19.00, 21.25] | 1.000 |" in table and "| 22.00 | 1.100 |" in table
    # rows that keep their windows' sums: × original with its paired interval
    paired = {**rep, "rows": [{**rep["rows"][0], "window_nll": [2000.0, 3000.0, 2600.0], "window_tokens": [1000] * 3},
                              {**rep["rows"][1], "window_nll": [2100.0, 3090.0, 2700.0], "window_tokens": [1000] * 3}]}
    ci = intervals.ratio_ci([2100.0, 3090.0, 2700.0], [2000.0, 3000.0, 2600.0], [1000] * 3)
    assert f"| 1.100 [{ci[0]:.3f}, {ci[1]:.3f}] |" in report.run_table(paired)
    assert f"| 1.100 [{ci[0]:.3f}, {ci[1]:.3f}] |" in report.summary_table([("run", paired)])
    lr = report.long_range_table(rep)
    assert "| original (softmax) | 20.00 [19.00, 21.25] | 1.20 [1.10, 1.31] (20.0) | 50% [25%, 75%] (key 100%) |" in lr
    assert "| old | 22.00 | 9.00 (20.0) | 50% |" in lr
    summary = report.summary_table([("run", rep)])
    assert "| run | old | 1024 | 22.00 | 1.100 |" in summary


def test_model_card_shows_intervals_and_keeps_the_value_in_the_model_index():
    from hf_rfa.hub.model_card import eval_results, metrics_table

    m = {"perplexity @1024": {"converted": {"value": 19.96, "ci95": [19.5, 20.4]}, "original": {"value": 20.67, "ci95": None}, "ratio": 0.97}}
    table = metrics_table(m)
    assert "| perplexity @1024 | 19.96 [19.5, 20.4] | 20.67 | 0.97 |" in table
    assert {(r.metric_name, r.metric_value) for r in eval_results(m, "text-generation")} == {
        ("perplexity @1024 [converted]", 19.96), ("perplexity @1024 [original]", 20.67), ("perplexity @1024 [ratio]", 0.97)}
    assert "| ppl | 3 [2, 4] |" in metrics_table({"ppl": {"value": 3, "ci95": [2, 4]}})
    with pytest.raises(ValueError, match=r"ci95"):
        metrics_table({"ppl": {"rfa": {"value": 3.0, "ci95": [2.0]}}})
    with pytest.raises(ValueError, match=r"\['value'\]"):
        metrics_table({"ppl": {"rfa": {"value": float("nan"), "ci95": None}}})


def test_conversion_run_carries_intervals_into_report_results_and_card(tiny, tmp_path):
    import hf_rfa
    from hf_rfa.recipes.conversion import pipeline

    cfg = pipeline.ConversionConfig(
        model=tiny["model"], output=str(tmp_path / "out"), rfa=hf_rfa.RFAConfig(feature_map="favor+", num_features=16, window=4, sinks=1),
        transfer_tokens=0, lora_tokens=64, context=64, eval_contexts=[64], eval_tokens=256, error_tokens=64,
        calibration_text=tiny["a"], eval_text=tiny["b"], baselines=False, window_only_baseline=True, copy_gaps=[20], copy_draws=3,
        passkey_lengths=[220], passkey_trials=2, generate_prompt=None, progress=False,
    )
    rep = pipeline.run(cfg)
    for r in rep["rows"]:
        assert r["windows"] == 4 and r["perplexity_ci95"][0] <= r["perplexity"] <= r["perplexity_ci95"][1]
    for e in rep["long_range"]:
        c = e["copy"]["20"]
        assert c["second_ci95"][0] <= c["second"] <= c["second_ci95"][1]
    out = tmp_path / "out"
    final = next(r for r in rep["rows"] if r["variant"] == rep["final_variant"])
    results = (out / "RESULTS.md").read_text()
    assert "perplexity [95% CI]" in results and intervals.fmt(final["perplexity"], final["perplexity_ci95"], ".4g") in results
    card = (out / "README.md").read_text()
    assert "perplexity @64 (252 held-out tokens, 4 windows)" in card and "copy @gap 20 (second-copy perplexity, 3 draws)" in card
    assert "passkey @220 (exact match, 2 trials x 3 depths)" in card
    row = next(line for line in card.splitlines() if line.startswith("| perplexity @64"))
    lo, hi = final["perplexity_ci95"]
    assert f"{final['perplexity']:.4g} [{lo:.4g}, {hi:.4g}]" in row
    orig = rep["rows"][0]
    rlo, rhi = intervals.ratio_ci(final["window_nll"], orig["window_nll"], final["window_tokens"])
    assert f"{final['perplexity'] / orig['perplexity']:.4g} [{rlo:.4g}, {rhi:.4g}]" in row
    assert "value: " in card  # the model-index keeps numbers
