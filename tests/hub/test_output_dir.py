"""Nothing lost: overwrite replaces only folders hf_rfa wrote and never one holding an
input, results are swapped in atomically, and staging folders of killed runs are cleaned up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hf_rfa
from hf_rfa import output_dir
from hf_rfa.hub.export import export
from hf_rfa.recipes.conversion.pipeline import _tmp_dir
from tiny_models import tiny_model


def _converted():
    return hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8))


def test_export_overwrite_replaces_only_hf_rfa_folders(tmp_path):
    model = _converted()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="not written by hf_rfa"):
        export(model, foreign, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "precious"

    out = export(model, tmp_path / "out")
    assert (out / output_dir.MARKER).is_file() and (out / "config.json").is_file()
    (out / "stale.txt").write_text("from the first export")
    with pytest.raises(ValueError, match="not empty"):
        export(model, out)
    export(model, out, overwrite=True)
    assert not (out / "stale.txt").exists() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no staging left


def test_interrupted_export_keeps_the_old_result(tmp_path, monkeypatch):
    model = _converted()
    out = export(model, tmp_path / "out")
    before = sorted(p.name for p in out.iterdir())
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["hf_rfa.hub.export"], "_check_saved_rfa_tensors", interrupt)
    with pytest.raises(KeyboardInterrupt):
        export(model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_output_containing_the_inputs_is_refused(tmp_path):
    """`convert.py --model ws/llama --output ws --overwrite` deleted the input model and texts."""
    ws = tmp_path / "ws"
    (ws / "llama").mkdir(parents=True)
    (ws / "llama" / "config.json").write_text("{}")
    (ws / "text.txt").write_text("hello")
    (ws / output_dir.MARKER).write_text("{}")  # even a folder hf_rfa wrote
    for inputs in ((str(ws / "llama"), None), ("some/hub-id", str(ws / "text.txt")), (str(ws),)):
        with pytest.raises(ValueError, match="contains"):
            _tmp_dir(ws, True, inputs)
    assert (ws / "llama" / "config.json").is_file() and (ws / "text.txt").is_file()
    assert _tmp_dir(tmp_path / "elsewhere", True, (str(ws / "llama"),)).name.startswith(".tmp-elsewhere.")


def test_output_naming_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        output_dir.check_target(tmp_path / "f", True)


def test_publish_swaps_and_cleans_stale_staging(tmp_path):
    out = tmp_path / "res"
    out.mkdir()
    (out / "old.txt").write_text("old")
    (out / output_dir.MARKER).write_text("{}")
    # a staging folder of a killed run (its process is gone) and one of a live run
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    killed, live = tmp_path / ".tmp-res.killed", tmp_path / ".tmp-res.live"
    for folder, pid in ((killed, int(dead.stdout)), (live, os.getpid())):
        folder.mkdir()
        (folder / ".hf_rfa-owner").write_text(json.dumps({"host": os.uname().nodename, "pid": pid}))
    output_dir.check_target(out, True)
    tmp = output_dir.staging_dir(out)
    assert not killed.exists() and live.exists()
    (tmp / "new.txt").write_text("new")
    output_dir.publish(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == [output_dir.MARKER, "new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-res.live", "res"]
