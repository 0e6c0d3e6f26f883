"""The offline lm-eval tasks: documents, few-shot pools, rendered configs, prompt lengths."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_rfa.integrations import lm_eval_tasks as lt


ARTICLES = [
    "Alpha one is here. Alpha two follows now. Alpha three is the sentence that comes next.\nA short one.",
    "Beta first sentence is long enough. Beta second sentence is also long. Beta third sentence closes it.",
    "Gamma opens the text right here. Gamma continues in a second line. Gamma ends with this sentence.",
    "Delta starts with this sentence. Delta goes on with another one. Delta finishes with the last one.",
]


def test_next_sentence_docs_follow_their_context():
    docs = lt.wiki_next_sentence_docs(ARTICLES, per_article=5)
    assert len(docs) == 4
    for doc in docs:
        assert len(doc["choices"]) == 4 == len(set(doc["choices"]))
        gold = doc["choices"][doc["gold"]]
        article = next(a for a in ARTICLES if doc["context"] in a)
        assert article.index(doc["context"]) + len(doc["context"]) + 1 == article.index(gold)
        assert all(c not in article for i, c in enumerate(doc["choices"]) if i != doc["gold"])
    assert [d["gold"] for d in docs] == [d["gold"] for d in lt.wiki_next_sentence_docs(ARTICLES, per_article=5)]
    with pytest.raises(ValueError, match="n_choices"):
        lt.wiki_next_sentence_docs(ARTICLES, n_choices=1)


def test_balanced_pool_blocks():
    ex = [{"text": str(i), "label": i % 3} for i in range(30)]
    pool = lt.balanced_pool(ex, 3, blocks=4)
    assert len(pool) == 12
    for b in range(4):
        assert sorted(e["label"] for e in pool[3 * b: 3 * b + 3]) == [0, 1, 2]
    assert len({e["text"] for e in pool}) == 12
    with pytest.raises(ValueError, match="fewer than blocks"):
        lt.balanced_pool(ex, 3, blocks=11)


@pytest.mark.filterwarnings("ignore")
def test_prepare_tasks_writes_configs_pointing_at_data(tmp_path):
    pytest.importorskip("mwparserfromhell")
    try:
        out = lt.prepare_tasks(tmp_path, [lt.TAG])
    except ModuleNotFoundError as e:  # an asset package not prepared here
        pytest.skip(str(e))
    for name, (config, folder) in lt.TASKS.items():
        cfg = yaml.safe_load((out / config).read_text())
        assert cfg["task"] == name and lt.TAG in cfg["tag"]
        files = cfg["dataset_kwargs"]["data_files"]
        assert all(lt.DATA_PLACEHOLDER not in p and (out / folder).as_posix() in p for p in files.values())
        test = [json.loads(x) for x in open(files["test"], encoding="utf-8")]
        assert len(test) > 100
        if "train" in files:
            shots = [json.loads(x) for x in open(files["train"], encoding="utf-8")]
            assert len(shots) >= cfg["num_fewshot"]
            assert not {s["text"] for s in shots} & {t["text"] for t in test}
            assert len(cfg["doc_to_choice"]) == len({s["label"] for s in shots[: cfg["num_fewshot"]]})
    with pytest.raises(ValueError, match="unknown offline tasks"):
        lt.prepare_tasks(tmp_path, ["piqa"])
    assert lt.resolve_tasks(["piqa", lt.TAG]) == list(lt.TASKS)


@pytest.mark.slow
def test_many_shot_prompts_exceed_4k_tokens(tmp_path):
    """lm-eval's own prompts for the many-shot tasks, counted with SmolLM2's tokenizer."""
    pytest.importorskip("lm_eval")
    from hf_rfa import assets
    from lm_eval.tasks import TaskManager, get_task_dict
    from transformers import AutoTokenizer

    try:
        out, tok_dir = lt.prepare_tasks(tmp_path), assets.smollm2_path()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tm = TaskManager(include_path=str(out), include_defaults=False)
    for name in ("rfa_rotten_tomatoes_manyshot", "rfa_bbc_topic_manyshot"):
        task = get_task_dict([name], tm)[name]
        task.build_all_requests(limit=3, rank=0, world_size=1)
        lengths = [len(tok.encode(inst.arguments[0])) for inst in task.instances]
        assert min(lengths) >= 4096, (name, lengths)


def test_bbc_reader_on_a_synthetic_folder(tmp_path):
    from hf_rfa.assets.bbc_news import BBC_LABELS, _FOLDERS, _read_bbc

    for i, topic in enumerate(BBC_LABELS):
        d = tmp_path / _FOLDERS[topic]
        d.mkdir()
        (d / "001.txt").write_bytes(f"Title {topic}\n\nBody of {topic} \n second  line.\n".encode())
        (d / "002.txt").write_bytes(f"Caf\xe9 {topic}\n\nLatin-1 body {topic}.".encode("latin-1"))
        (d / "003.txt").write_bytes(f"Again\n\nBody of {topic} second line.".encode())  # duplicate body
    rows = _read_bbc(tmp_path)
    assert len(rows) == 10 and [r["label"] for r in rows] == [i for i in range(5) for _ in range(2)]
    assert rows[0] == {"title": "Title business", "text": "Body of business second line.", "label": 0}
    assert rows[1]["title"] == "Café business"
    (tmp_path / "tech" / "001.txt").unlink()
    (tmp_path / "tech" / "002.txt").unlink()
    (tmp_path / "tech" / "003.txt").unlink()
    (tmp_path / "tech").rmdir()
    with pytest.raises(FileNotFoundError, match="tech"):
        _read_bbc(tmp_path)


def test_bbc_news_splits():
    from hf_rfa import assets

    try:
        train, test = assets.bbc_news("train"), assets.bbc_news("test")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    assert len(train) + len(test) > 2000 and abs(len(test) / (len(train) + len(test)) - 0.2) < 0.01
    assert {r["label"] for r in test} == set(range(5))
    assert not {r["text"] for r in train} & {r["text"] for r in test}
    with pytest.raises(ValueError, match="unknown split"):
        assets.bbc_news("validation")
