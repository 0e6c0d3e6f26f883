"""Local data files go through datasets.load_dataset, one code path for training and conversion."""

from __future__ import annotations

import json

import pytest

from hf_rfa.recipes import evaluation
from hf_rfa.recipes.data_files import builder_of, load_local
from hf_rfa.recipes.training.args import DataArguments
from hf_rfa.recipes.training.data import load_raw

ROWS = [{"text": "a good film", "label": 1}, {"text": "a bad film", "label": 0}, {"text": "fine", "label": 1}]


def _write_all(tmp_path):
    import pandas as pd

    files = {}
    (tmp_path / "d.csv").write_text("text,label\n" + "\n".join(f"{r['text']},{r['label']}" for r in ROWS) + "\n")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (tmp_path / "d.json").write_text(json.dumps({"data": ROWS}))
    (tmp_path / "l.json").write_text(json.dumps(ROWS))
    pd.DataFrame(ROWS).to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.jsonl", "d.json", "l.json", "d.parquet"):
        files[name] = str(tmp_path / name)
    return files


def test_builders_by_suffix():
    assert [builder_of(p) for p in ("a.csv", "a.JSONL", "a.json", "a.parquet", "a.txt", "a.raw")] == ["csv", "json", "json", "parquet", "text", "text"]


def test_every_format_gives_texts_and_labels(tmp_path):
    """.jsonl keeps its labels in conversion (was read as raw lines) and .parquet is accepted."""
    for name, path in _write_all(tmp_path).items():
        texts, labels = evaluation.load_labelled(path)
        assert texts == [r["text"] for r in ROWS] and labels == [r["label"] for r in ROWS], name
        raw = load_raw(DataArguments(task="classification", train_file=path))
        assert raw["train"]["text"] == [r["text"] for r in ROWS] and raw["train"]["label"] == [r["label"] for r in ROWS], name


def test_text_files(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("first doc line one\nline two\n\nsecond doc\n\n\nthird\n")
    assert evaluation.load_text(str(f)) == f.read_text()
    assert evaluation.load_labelled(str(f)) == (["first doc line one", "line two", "second doc", "third"], None)
    raw = load_raw(DataArguments(task="causal-lm", train_file=str(f)))
    assert raw["train"]["text"] == ["first doc line one\nline two", "second doc", "third"]
    with pytest.raises(ValueError, match="causal-lm"):
        load_raw(DataArguments(task="classification", train_file=str(f)))


def test_missing_file_and_bad_sample_by(tmp_path):
    with pytest.raises(ValueError, match="train_file"):
        load_local(tmp_path / "nope.csv", what="train_file")
    (tmp_path / "a.txt").write_text("x\n")
    with pytest.raises(ValueError, match="sample_by"):
        load_local(tmp_path / "a.txt", sample_by="word")
