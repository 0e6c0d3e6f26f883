"""Tests for :mod:`hf_rfa.assets`.

Three kinds of tests:

* synthetic ones (a fake cache in ``tmp_path``): need nothing installed and always run;
* real-data ones: read the prepared cache (``$HF_RFA_CACHE``, default ``~/.cache/hf_rfa``) and
  run in well under a second once it exists; they are skipped when it does not (prepare it with
  ``python -m hf_rfa.assets`` or by running the slow tests);
* ``@pytest.mark.slow`` ones: install packages / convert / run the real models.
"""

from __future__ import annotations

import bz2
import csv
import json
import math
import os
from pathlib import Path

import pytest

from hf_rfa import assets


def _real_cache() -> Path:
    root = os.environ.get("HF_RFA_CACHE") or os.path.join("~", ".cache", "hf_rfa")
    return Path(root).expanduser()


def _need(relpath: str) -> None:
    """Skip unless the real cache holds ``relpath`` in the current format."""
    path = _real_cache() / relpath
    if assets._read_json(path) is None:
        pytest.skip(
            f"{path} not prepared (run `python -m hf_rfa.assets` or the slow tests)"
        )


# ------------------------------------------------------------------------------------------
# Slow: install and prepare (these also fill the cache the fast real-data tests read)
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_wikipedia() -> None:
    articles = assets.wikipedia_articles()
    assert len(articles) == 100
    assert all(len(a) >= assets.MIN_ARTICLE_CHARS for a in articles)


@pytest.mark.slow
def test_prepare_rotten_tomatoes() -> None:
    data = assets.rotten_tomatoes()
    assert set(data) == {"train", "test"}


@pytest.mark.slow
def test_minilm_loads() -> None:
    from transformers import AutoModel, AutoTokenizer

    path = assets.minilm_path()
    model = AutoModel.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "BertModel"
    assert model.config.num_hidden_layers == 6 and model.config.hidden_size == 384
    out = model(**tok(["a fine film"], return_tensors="pt"))
    assert out.last_hidden_state.shape[-1] == 384


@pytest.mark.slow
def test_gpt2_tokenizer_matches_known_ids() -> None:
    from transformers import AutoTokenizer, GPT2TokenizerFast

    path = assets.gpt2_tokenizer_path()
    tok = GPT2TokenizerFast.from_pretrained(path)
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok("Hello, world!").input_ids == [15496, 11, 995, 0]
    assert tok(" the").input_ids == [262]
    text = "naïve café 日本語 🤗\t  spaces"
    assert AutoTokenizer.from_pretrained(path).decode(tok(text).input_ids) == text


@pytest.mark.slow
def test_smollm2_loads_and_has_sane_perplexity() -> None:
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.smollm2_path()
    start = time.perf_counter()
    assert assets.smollm2_path() == path
    assert time.perf_counter() - start < 1.0  # cached
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model.config, "quantization_config", None) is None
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (30, 576)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (
        9,
        3,
    )
    ids = tok(assets.wikipedia_split("eval")[2], return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert 5 < math.exp(loss) < 60  # measured ~18.8 on this article


# ------------------------------------------------------------------------------------------
# Fast, nothing installed
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("func", [assets.wikipedia_split, assets.wikipedia_text_file])
def test_bad_wikipedia_split_raises(func) -> None:
    with pytest.raises(ValueError) as info:
        func("validation")
    message = str(info.value)
    assert "'validation'" in message
    for name in ("calibration", "train", "eval"):
        assert name in message


def test_bad_rotten_tomatoes_split_raises() -> None:
    with pytest.raises(ValueError, match=r"'dev'.*train.*test"):
        assets.rotten_tomatoes_csv("dev")


def test_cache_dir_follows_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_RFA_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == (tmp_path / "c").resolve()
    assert (tmp_path / "c").is_dir()


def test_ensure_package_finds_installed_package_without_pip() -> None:
    path = assets.ensure_package("not-on-pypi-hopefully", "0.0.0", "json")
    assert (path / "__init__.py").is_file()


def test_ensure_package_rejects_plain_module() -> None:
    with pytest.raises(ModuleNotFoundError):
        assets.ensure_package("not-on-pypi-hopefully", "0.0.0", "csv")


def test_bytes_to_unicode_is_a_bijection() -> None:
    table = assets._bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("a")] == "a"


def test_bpe_split_respects_rank_limit() -> None:
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4}
    assert assets._bpe_split(ranks, b"abc", 4) == [b"ab", b"c"]
    assert assets._bpe_split(ranks, b"abc", 3) == [b"a", b"b", b"c"]
    assert assets._bpe_split(ranks, b"abc", 10) == [b"abc"]


def test_strip_wikitext() -> None:
    pytest.importorskip("mwparserfromhell")
    raw = (
        "'''Foo''' ({{IPA|/fu/}}) is a [[bar (thing)|bar]] in [[Baz]].<ref>{{cite web|x=1}}</ref>\n"
        "[[File:Foo.jpg|thumb|A foo.]]\n\n"
        "== History ==\n"
        "It   was {{convert|3|km}} long.\n"
        "[[Category:Foos]]\n[[de:Foo]]"
    )
    assert assets._strip_wikitext(raw) == "Foo is a bar in Baz.\nHistory\nIt was long."


def _fake_wikipedia(cache: Path, n: int = 100) -> list[str]:
    articles = [f"Article {i}. " + "text " * 500 for i in range(n)]
    path = cache / "wikipedia" / "articles.json"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "format": assets._FORMAT_VERSION,
                "titles": [f"T{i}" for i in range(n)],
                "articles": articles,
            }
        ),
        encoding="utf-8",
    )
    return articles


def test_wikipedia_splits_on_fake_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_RFA_CACHE", str(tmp_path))
    articles = _fake_wikipedia(tmp_path)
    assert assets.wikipedia_articles() == articles
    assert assets.wikipedia_titles()[:2] == ["T0", "T1"]
    splits = {s: assets.wikipedia_split(s) for s in assets.WIKIPEDIA_SPLITS}
    assert {s: len(v) for s, v in splits.items()} == {
        "calibration": 10,
        "train": 70,
        "eval": 20,
    }
    assert splits["eval"] == [articles[i] for i in range(4, 100, 5)]
    assert splits["calibration"] == [articles[i] for i in range(0, 100, 10)]
    assert sorted(sum(splits.values(), [])) == sorted(articles)

    path = assets.wikipedia_text_file("eval")
    assert path == tmp_path / "wikipedia" / "eval.txt"
    assert path.read_text(encoding="utf-8") == "\n\n".join(splits["eval"]) + "\n"
    assert assets.wikipedia_text_file("eval") == path  # cached


def test_stale_format_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": -1}), encoding="utf-8")
    assert assets._read_json(path) is None
    path.write_text("{not json", encoding="utf-8")
    assert assets._read_json(path) is None
    assert assets._read_json(tmp_path / "missing.json") is None


def test_read_rotten_tomatoes_dedupes(tmp_path: Path) -> None:
    rows = [
        ("plot", "A plot summary.", "m", "True"),
        ("fresh", "Great  fun.", "m", "True"),
        ("rotten", "Dull.", "m", "True"),
        ("fresh", "Great fun.", "m2", "True"),  # duplicate after whitespace normalising
        ("fresh", "Mixed.", "m", "True"),
        ("rotten", "Mixed.", "m3", "True"),  # conflicting labels: dropped
        ("fresh", 'Says "hi",\nthen leaves.', "m", "True"),
    ]
    path = tmp_path / "rt.csv.bz2"
    with bz2.open(path, "wt", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
        writer.writerows(rows)
    assert assets._read_rotten_tomatoes(path) == [
        {"text": "Great fun.", "label": 1},
        {"text": "Dull.", "label": 0},
        {"text": 'Says "hi", then leaves.', "label": 1},
    ]


def test_publish_dir_keeps_winner(tmp_path: Path) -> None:
    final = tmp_path / "final"
    first, second = tmp_path / "a", tmp_path / "b"
    for d in (first, second):
        d.mkdir()
        (d / "config.json").write_text(d.name)
    assert assets._publish_dir(first, final) == final
    assert assets._publish_dir(second, final) == final  # lost the race: discarded
    assert (final / "config.json").read_text() == "a" and not second.exists()


# ------------------------------------------------------------------------------------------
# Fast once the real cache exists
# ------------------------------------------------------------------------------------------


def test_real_wikipedia_splits_disjoint_and_deterministic() -> None:
    _need("wikipedia/articles.json")
    articles = assets.wikipedia_articles()
    assert len(articles) == 100
    assert len(set(articles)) == 100
    splits = {s: assets.wikipedia_split(s) for s in assets.WIKIPEDIA_SPLITS}
    assert [len(splits[s]) for s in assets.WIKIPEDIA_SPLITS] == [10, 70, 20]
    sets = {s: set(v) for s, v in splits.items()}
    assert not sets["eval"] & sets["train"]
    assert not sets["eval"] & sets["calibration"]
    assert not sets["train"] & sets["calibration"]
    assert set().union(*sets.values()) == set(articles)
    for s in assets.WIKIPEDIA_SPLITS:
        assert assets.wikipedia_split(s) == splits[s]
    titles = assets.wikipedia_titles()
    assert titles[0] == "Anarchism" and len(titles) == 100
    assert sum(map(len, articles)) > 2_500_000
    assert all("[[" not in a and "{{" not in a and "<ref" not in a for a in articles)


def test_real_wikipedia_text_files() -> None:
    _need("wikipedia/articles.json")
    for split in assets.WIKIPEDIA_SPLITS:
        text = assets.wikipedia_text_file(split).read_text(encoding="utf-8")
        assert text.rstrip("\n").split("\n\n") == assets.wikipedia_split(split)


def test_real_rotten_tomatoes() -> None:
    _need("rotten_tomatoes/rotten_tomatoes.json")
    data = assets.rotten_tomatoes()
    train, test = data["train"], data["test"]
    n = len(train) + len(test)
    assert 12_000 < n < 12_808
    assert abs(len(test) / n - 0.1) < 0.01
    texts_train = {ex["text"] for ex in train}
    texts_test = {ex["text"] for ex in test}
    assert len(texts_train) == len(train) and len(texts_test) == len(test)
    assert not texts_train & texts_test
    assert {ex["label"] for ex in train} == {0, 1} == {ex["label"] for ex in test}
    assert assets.rotten_tomatoes() == data  # deterministic
    for split in assets.RT_SPLITS:
        with open(assets.rotten_tomatoes_csv(split), encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [{"text": r["text"], "label": int(r["label"])} for r in rows] == data[
            split
        ]


def test_library_calls_never_pip_install(monkeypatch) -> None:
    """A missing asset package is an error naming the set-up command; pip runs only inside
    ``installing()`` (``python -m hf_rfa.assets``)."""
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    with pytest.raises(assets.AssetNotPrepared, match=r"python -m hf_rfa\.assets"):
        assets.ensure_package("not-on-pypi-hopefully", "0.0.0", "hf_rfa_no_such_module_xyz")
    assert calls == []
    with assets.installing(), pytest.raises(ModuleNotFoundError, match="still not found"):
        assets.ensure_package("not-on-pypi-hopefully", "0.0.0", "hf_rfa_no_such_module_xyz")
    assert len(calls) == 1 and calls[0][-1] == "not-on-pypi-hopefully==0.0.0"


@pytest.mark.parametrize("package", [("gensim", "4.4.0", "gensim_x"), ("openai-whisper", "20250625", "whisper_x")])
def test_pinned_installs_refuse_source_builds(monkeypatch, tmp_path, package):
    """pip always gets --only-binary :all: (no setup.py runs, openai-whisper included: its
    tokenizer file comes from the verified source archive instead)."""
    binary = True
    import importlib.util
    import subprocess
    import types

    from hf_rfa.assets import store

    calls, found = [], iter([None, types.SimpleNamespace(submodule_search_locations=[str(tmp_path)], origin=None)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda module: next(found))
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd))
    with store.installing():
        assert store.ensure_package(*package) == tmp_path
    (cmd,) = calls
    assert cmd[-1] == f"{package[0]}=={package[1]}" and "--no-deps" in cmd
    assert (cmd[cmd.index("--only-binary") + 1] == ":all:") if binary else "--only-binary" not in cmd


# ---- a pinned source archive, read without running anything (hf_rfa.assets.sdist) ---------------
def _tar(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> str:
    """Write a .tar.gz of ``members`` (name: bytes) and symlinks ``links`` (name: target); return its sha256."""
    import hashlib
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _demo(tmp_path: Path, extra: dict[str, bytes] | None = None, links: dict[str, str] | None = None):
    import hashlib

    from hf_rfa.assets.sdist import Sdist

    data = b"ranks 0 1 2\n"
    archive = tmp_path / "demo_pkg-1.0.tar.gz"
    digest = _tar(archive, {"demo_pkg-1.0/setup.py": b"raise SystemExit('must not run')\n", "demo_pkg-1.0/pkg/assets/ranks.txt": data, **(extra or {})}, links)
    return archive, Sdist("demo-pkg", "1.0", archive.name, digest, {"pkg/assets/ranks.txt": hashlib.sha256(data).hexdigest()}), data


def test_sdist_members_are_read_only_from_a_verified_archive(tmp_path):
    from dataclasses import replace

    from hf_rfa.assets.sdist import read_members

    archive, sd, data = _demo(tmp_path)
    assert read_members(archive, sd) == {"pkg/assets/ranks.txt": data}
    assert not (tmp_path / "demo_pkg-1.0").exists()  # nothing extracted by name
    with pytest.raises(ValueError, match="sha256 .* is not the pinned .*refused"):
        read_members(archive, replace(sd, sha256="0" * 64))
    with pytest.raises(ValueError, match="ranks.txt.*sha256.*refused"):
        read_members(archive, replace(sd, members={"pkg/assets/ranks.txt": "1" * 64}))
    with pytest.raises(ValueError, match="no member"):
        read_members(archive, replace(sd, members={"pkg/missing.txt": "1" * 64}))


@pytest.mark.parametrize(
    "extra,links",
    [
        ({"demo_pkg-1.0/../../evil.txt": b"x"}, None),
        ({"/etc/evil.txt": b"x"}, None),
        ({"demo_pkg-1.0/a\\..\\..\\evil.txt": b"x"}, None),
        (None, {"demo_pkg-1.0/pkg/link": "../../../etc/passwd"}),
        (None, {"demo_pkg-1.0/pkg/link": "/etc/passwd"}),
    ],
    ids=["dotdot", "absolute", "backslash", "symlink-dotdot", "symlink-absolute"],
)
def test_sdist_path_traversal_refuses_the_archive(tmp_path, extra, links):
    from hf_rfa.assets.sdist import read_members

    archive, sd, _ = _demo(tmp_path, extra, links)  # the pinned hash is this very archive's
    with pytest.raises(ValueError, match="archive refused"):
        read_members(archive, sd)


def test_index_urls_follow_pip_config():
    from hf_rfa.assets.sdist import DEFAULT_INDEX, index_urls

    cfg = "global.cert='/x.crt'\nglobal.extra-index-url='file:///a/simple file:///b/simple'\n:env:.find-links='/w'\n"
    assert index_urls(cfg, env={}) == [DEFAULT_INDEX, "file:///a/simple", "file:///b/simple"]
    assert index_urls("install.index-url='https://mirror/simple'\n", env={}) == ["https://mirror/simple"]
    assert index_urls(cfg, env={"PIP_INDEX_URL": "https://m/simple", "PIP_EXTRA_INDEX_URL": "file:///c"}) == ["https://m/simple", "file:///c"]


def _index(root: Path, sd, archive: Path, listed: str | None) -> str:
    """A file:// simple index at ``root`` listing ``archive`` (hash fragment ``listed``)."""
    page = root / "simple" / "demo-pkg"
    page.mkdir(parents=True)
    (page / archive.name).write_bytes(archive.read_bytes())
    frag = f"#sha256={listed}" if listed else ""
    (page / "index.html").write_text(f'<html><body><a href="{archive.name}{frag}">{archive.name}</a></body></html>')
    return (root / "simple").as_uri()


def test_sdist_file_offline_and_prepared_from_an_index(tmp_path, monkeypatch):
    """Library calls never fetch (AssetNotPrepared); the set-up step fetches from the index,
    verifies, caches the member only; later calls read the cache."""
    import subprocess
    import urllib.request

    from hf_rfa.assets import sdist, store

    monkeypatch.setenv("HF_RFA_CACHE", str(tmp_path / "cache"))
    archive, sd, data = _demo(tmp_path)
    index = _index(tmp_path / "idx", sd, archive, sd.sha256)
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("no network"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("nothing is run"))
    with pytest.raises(store.AssetNotPrepared, match=r"python -m hf_rfa\.assets"):
        sdist.sdist_file(sd, "pkg/assets/ranks.txt", indexes=[index])
    with store.installing():
        path = sdist.sdist_file(sd, "pkg/assets/ranks.txt", indexes=["file:///nonexistent/simple", index])
    assert path.read_bytes() == data and path == sd.cached("pkg/assets/ranks.txt")
    assert sorted(p.name for p in path.parent.parent.parent.rglob("*") if p.is_file()) == ["ranks.txt"]  # no archive, no setup.py
    assert sdist.sdist_file(sd, "pkg/assets/ranks.txt") == path  # offline: the cache
    with pytest.raises(ValueError, match="member must be one of"):
        sdist.sdist_file(sd, "setup.py")


def test_sdist_file_refuses_a_tampered_archive(tmp_path, monkeypatch):
    from dataclasses import replace

    from hf_rfa.assets import sdist, store

    monkeypatch.setenv("HF_RFA_CACHE", str(tmp_path / "cache"))
    archive, sd, _ = _demo(tmp_path)
    pinned = replace(sd, sha256="ab" * 32)  # the index serves another archive than the pinned one
    for listed in (None, sd.sha256):  # unlisted hash: refused after download; listed other: before
        root = tmp_path / f"idx-{listed is None}"
        with store.installing(), pytest.raises(ValueError, match="not the pinned"):
            sdist.sdist_file(pinned, "pkg/assets/ranks.txt", indexes=[_index(root, sd, archive, listed)])
        assert not pinned.cached("pkg/assets/ranks.txt").exists()


def test_whisper_pin_is_the_gpt2_tokenizer_file():
    """The pinned member hash is the file an installed openai-whisper 20250625 holds (when one is)."""
    import hashlib
    import importlib.util

    from hf_rfa.assets import store

    project, version, filename, _, members = store.WHISPER_SDIST
    assert (project, version, filename) == ("openai-whisper", "20250625", "openai_whisper-20250625.tar.gz")
    assert list(members) == [store.GPT2_TIKTOKEN_FILE]
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("openai-whisper not installed here")
    installed = Path(spec.submodule_search_locations[0]).parent / store.GPT2_TIKTOKEN_FILE
    assert hashlib.sha256(installed.read_bytes()).hexdigest() == members[store.GPT2_TIKTOKEN_FILE]
