"""evaluate metrics with the offline fallback: same numbers on the same predictions."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from hf_rfa.integrations import metrics as M

RNG = np.random.default_rng(0)
BIN_P, BIN_R = RNG.integers(0, 2, 200), RNG.integers(0, 2, 200)
MC_P, MC_R = RNG.integers(0, 5, 300), RNG.integers(0, 5, 300)
W = RNG.random(200)


def test_offline_metrics_equal_scikit_learn():
    sk = pytest.importorskip("sklearn.metrics")
    assert M.accuracy(BIN_P, BIN_R)["accuracy"] == pytest.approx(sk.accuracy_score(BIN_R, BIN_P), abs=1e-12)
    assert M.accuracy(BIN_P, BIN_R, sample_weight=W)["accuracy"] == pytest.approx(sk.accuracy_score(BIN_R, BIN_P, sample_weight=W), abs=1e-12)
    assert M.accuracy(BIN_P, BIN_R, normalize=False)["accuracy"] == sk.accuracy_score(BIN_R, BIN_P, normalize=False)
    for kind, fn in (("f1", sk.f1_score), ("precision", sk.precision_score), ("recall", sk.recall_score)):
        ours = M.OFFLINE_METRICS[kind]
        assert ours(BIN_P, BIN_R)[kind] == pytest.approx(fn(BIN_R, BIN_P), abs=1e-12)
        assert ours(BIN_P, BIN_R, pos_label=0, sample_weight=W)[kind] == pytest.approx(fn(BIN_R, BIN_P, pos_label=0, sample_weight=W), abs=1e-12)
        for avg in ("macro", "micro", "weighted"):
            assert ours(MC_P, MC_R, average=avg)[kind] == pytest.approx(fn(MC_R, MC_P, average=avg), abs=1e-12), (kind, avg)
    with pytest.raises(ValueError, match="average='binary' needs two classes"):
        M.f1(MC_P, MC_R)
    with pytest.raises(ValueError, match="average must be one of"):
        M.f1(BIN_P, BIN_R, average="samples")
    with pytest.raises(ValueError, match="3 entries but references has 2"):
        M.accuracy([1, 0, 1], [1, 0])


def test_fallback_when_evaluate_load_fails():
    with mock.patch.object(M, "_evaluate_load", side_effect=FileNotFoundError("no Hub")):
        m = M.load_metric("f1")
        assert m.source == "offline"
        assert m.compute(predictions=MC_P, references=MC_R, average="macro") == M.f1(MC_P, MC_R, average="macro")
        with pytest.raises(ValueError, match="offline implementations"):
            M.load_metric("bleu")
        with pytest.raises(ValueError, match="could not be loaded"):
            M.load_metric("accuracy", fallback=False)


METRIC_SCRIPT = textwrap.dedent(
    '''
    import datasets
    import evaluate
    from sklearn.metrics import f1_score

    class LocalF1(evaluate.Metric):
        def _info(self):
            return evaluate.MetricInfo(description="f1", citation="", inputs_description="",
                                       features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}))

        def _compute(self, predictions, references, average="binary"):
            return {"f1": float(f1_score(references, predictions, average=average))}
    '''
)


def test_evaluate_metric_when_loadable_gives_the_same_numbers(tmp_path):
    """A metric evaluate *can* load (a local script here; a Hub name with the Hub) is used, and
    agrees with the offline implementation on the same predictions."""
    pytest.importorskip("evaluate")
    pytest.importorskip("sklearn")
    script = tmp_path / "local_f1" / "local_f1.py"
    script.parent.mkdir()
    script.write_text(METRIC_SCRIPT)
    m = M.load_metric(str(script.parent))
    assert m.source == "evaluate"
    for avg in ("binary", "macro"):
        p, r = (BIN_P, BIN_R) if avg == "binary" else (MC_P, MC_R)
        assert m.compute(predictions=p, references=r, average=avg)["f1"] == pytest.approx(M.f1(p, r, average=avg)["f1"], abs=1e-12)


@pytest.mark.parametrize("name", ["accuracy", "f1"])
def test_hub_metric_matches_offline_when_available(name):
    """With the Hub (evaluate.load works), the Hub's script and the offline one agree."""
    pytest.importorskip("evaluate")
    try:
        hub = M._evaluate_load(name)
    except Exception as e:  # offline: evaluate fetches the script from the Hub
        pytest.skip(f"evaluate.load({name!r}) unavailable here: {type(e).__name__}")
    assert hub.compute(predictions=BIN_P, references=BIN_R)[name] == pytest.approx(M.OFFLINE_METRICS[name](BIN_P, BIN_R)[name], abs=1e-12)


def test_classification_metrics_for_trainer():
    with mock.patch.object(M, "_evaluate_load", side_effect=ConnectionError("offline")):
        fn = M.classification_metrics(["accuracy", "f1"])
    logits = np.eye(5)[MC_P] + 0.01
    out = fn(SimpleNamespace(predictions=logits, label_ids=MC_R))
    assert out == {"accuracy": M.accuracy(MC_P, MC_R)["accuracy"], "f1": M.f1(MC_P, MC_R, average="macro")["f1"]}
    out2 = fn(SimpleNamespace(predictions=BIN_P, label_ids=BIN_R))  # already argmaxed: binary f1
    assert out2["f1"] == M.f1(BIN_P, BIN_R)["f1"]
    with pytest.raises(ValueError, match="names is empty"):
        M.classification_metrics([])
