"""The staging clean-up deletes only what hf_rfa provably wrote, never a complete result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from hf_rfa import output_dir


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout)


def _old(path, days=3):
    t = time.time() - days * 86400
    os.utime(path, (t, t))


def test_a_users_folder_that_looks_like_staging_is_kept(tmp_path):
    mine = tmp_path / ".tmp-notes.mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("years of work")
    _old(mine)
    output_dir.staging_dir(tmp_path / "notes")
    assert (mine / "thesis.txt").read_text() == "years of work"


def test_the_output_name_is_not_a_glob_pattern(tmp_path):
    other = tmp_path / ".tmp-xyz.keep"
    other.mkdir()
    (other / ".hf_rfa-owner").write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "target": "xyz"}))
    _old(other)
    output_dir.staging_dir(tmp_path / "x*")
    assert other.is_dir()


def test_staging_of_another_target_with_a_common_prefix_is_kept(tmp_path):
    other = tmp_path / ".tmp-res.v2.abcdefgh"  # staging of target "res.v2"
    other.mkdir()
    (other / ".hf_rfa-owner").write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "target": "res.v2"}))
    output_dir.staging_dir(tmp_path / "res")
    assert other.is_dir()


def test_a_publish_killed_between_its_renames_loses_nothing(tmp_path):
    """Old result aside, new complete result in its staging folder, no target: a later run keeps both."""
    out = tmp_path / "res"
    aside = tmp_path / ".tmp-res.old-abcd1234"
    (aside / "res").mkdir(parents=True)
    (aside / "res" / output_dir.MARKER).write_text("{}")
    (aside / "res" / "old.txt").write_text("old")
    new = tmp_path / ".tmp-res.efgh5678"
    new.mkdir()
    (new / output_dir.MARKER).write_text("{}")
    (new / "new.txt").write_text("new")
    for d in (aside, new):
        _old(d)
    output_dir.check_target(out, False)
    tmp = output_dir.staging_dir(out)
    assert (aside / "res" / "old.txt").read_text() == "old" and (new / "new.txt").read_text() == "new"
    (tmp / "third.txt").write_text("3")
    output_dir.publish(tmp, out)
    assert (out / "third.txt").is_file() and (aside / "res" / "old.txt").is_file() and (new / "new.txt").is_file()


def test_a_killed_runs_own_staging_folder_is_still_removed(tmp_path):
    killed = tmp_path / ".tmp-res.k1ll3d00"
    killed.mkdir()
    (killed / "partial.bin").write_text("x")
    (killed / ".hf_rfa-owner").write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "target": "res"}))
    output_dir.staging_dir(tmp_path / "res")
    assert not killed.exists()
