"""The documentation: the site builds strictly (no broken link or anchor), every page is in the
navigation, the README (also the PyPI page) stays small, and the repository speaks of the product —
no work-log labels and no build machine's folders in any tracked file or file name."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12 * 1024

#: work-log labels: "session 12", "issue 13", "round 3", "issues 15/16", run suffixes such as
#: "main_job_s23" or "s4_full" that name a working session instead of what a thing is
WORK_LOG = re.compile(r"(?<![-\w])(?:sessions?|issues?|rounds?)[ _#-]?\d+|\b\w+_s\d+\b|\bs\d{1,2}_[a-z]\w*", re.IGNORECASE)
#: absolute folders of a build machine (a home, the scratch folder, a work tree)
MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|root|home|tmp|Users)/")
#: the only files allowed to spell these patterns: this test (it defines them)
ALLOWED = {"tests/test_docs.py"}


def _tracked() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def _offences(name: str, text: str) -> list[str]:
    found = [f"{name}: file name {m.group(0)!r}" for rx in (WORK_LOG, MACHINE_PATH) for m in rx.finditer(name)]
    for i, line in enumerate(text.splitlines(), 1):
        found += [f"{name}:{i}: {m.group(0)!r}" for rx in (WORK_LOG, MACHINE_PATH) for m in rx.finditer(line)]
    return found


def test_patterns_catch_what_they_should():
    bad = ["session 23", "Session 4 measurements", "issue 13", "issues 15/16", "(issue-14)", "round 3", "smollm2_main_job_s23.json",
           "benchmarks/results/s4_full", "experiments/issue13/x.py", "/work/main/.venv", "/root/.cache/hf_rfa", "/tmp/s21/run", "/home/me/x"]
    good = ['@pytest.fixture(scope="session")', "--rounds 4", "fastest of 4 interleaved rounds", "~/.cache/hf_rfa", "$HOME/x",
            "conversion/results/runs/smollm2-recall_v0.2.0.json", "/proc/cpuinfo", "hf_rfa/ops/backends/native", "s_t = γ s_{t−1}"]
    assert all(_offences("f", line) for line in bad), [line for line in bad if not _offences("f", line)]
    assert not [line for line in good if _offences("f", line)]


def test_no_work_log_labels_or_machine_paths_in_tracked_files():
    offences = []
    for name in _tracked():
        if name in ALLOWED:
            continue
        path = ROOT / name
        try:
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
        except UnicodeDecodeError:  # images and other binary files: only their names are checked
            text = ""
        offences += _offences(name, text)
    assert not offences, "work-log labels or machine paths:\n" + "\n".join(offences[:50])


def test_readme_is_small():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}: it is also the PyPI page; move detail to docs/)"


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation_and_exists():
    yaml = pytest.importorskip("yaml")
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(cfg["nav"])
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == pages, f"nav {sorted(nav)} vs docs/ {pages}"


def _build(docs_root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=docs_root, capture_output=True, text=True, timeout=300)


def test_mkdocs_build_strict(tmp_path):
    """The site builds with no warning; a broken link would fail it (checked on a copy)."""
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "method" / "index.html").is_file()
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    with open(copy / "docs" / "index.md", "a", encoding="utf-8") as f:
        f.write("\n[a page that does not exist](missing.md)\n")
    broken = _build(copy, tmp_path / "site2")
    assert broken.returncode != 0 and "missing.md" in broken.stdout + broken.stderr
