"""lm-evaluation-harness on a converted tiny Llama: ``--model hf_rfa`` (hf_rfa's loader, RFACache
when generating) and an exported folder through remote code in a process without hf_rfa; both
score the local next-sentence task exactly as hf_rfa's own multiple-choice scoring does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import hf_rfa  # noqa: E402
from hf_rfa.integrations import lm_eval as ours  # noqa: E402
from hf_rfa.integrations.scoring import score_multiple_choice  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import lm_eval_fixtures as fx  # noqa: E402

LIMIT = 8
#: float32 sums of a few hundred log-probabilities (lm-eval) against float64 sums (ours)
LL_RTOL = 1e-6

pytestmark = pytest.mark.slow  # lm-eval's start-up and task loading take 20-40 s on 2 cores


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return fx.build(tmp_path_factory.mktemp("lm_eval"))


@pytest.fixture(scope="module")
def own(folders):
    model = hf_rfa.from_pretrained(folders["saved"]).eval()
    return score_multiple_choice(model, fx.char_tokenizer(), fx.task_docs(folders["tasks"], LIMIT))


@pytest.fixture(scope="module")
def softmax_lls(folders):
    """The same weights run as plain softmax: what a loader that skipped hf_rfa would score."""
    import transformers as tf
    from hf_rfa.hf.convert import bypass_load_hook

    with bypass_load_hook():
        model = tf.AutoModelForCausalLM.from_pretrained(folders["saved"]).eval()
    assert not hf_rfa.hf.cache.uses_rfa(model)
    return score_multiple_choice(model, fx.char_tokenizer(), fx.task_docs(folders["tasks"], LIMIT))["loglikelihoods"]


def _assert_same(result: dict, own: dict, softmax_lls: list) -> None:
    assert result["acc"] == pytest.approx(own["acc"], abs=1e-6)
    assert result["acc_norm"] == pytest.approx(own["acc_norm"], abs=1e-6)
    assert len(result["lls"]) == own["n"] == LIMIT
    for doc_id, lls in result["lls"].items():
        ref = own["loglikelihoods"][int(doc_id)]
        assert lls == pytest.approx(ref, rel=LL_RTOL, abs=0), doc_id
        assert max(abs(a - b) for a, b in zip(lls, softmax_lls[int(doc_id)])) > 1e-2  # not softmax
    assert result["correct"] == {str(i): c for i, c in enumerate(own["correct"])}


def _summary(res: dict) -> dict:
    r = res["results"][fx.TASK]
    samples = res["samples"][fx.TASK]
    return {
        "acc": r["acc,none"], "acc_norm": r["acc_norm,none"],
        "lls": {str(s["doc_id"]): [float(x[0]) for x in s["filtered_resps"]] for s in samples},
        "correct": {str(s["doc_id"]): int(s["acc"]) for s in samples},
    }


def test_hf_rfa_model_entry_matches_own_scoring(folders, own, softmax_lls):
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(
        model="hf_rfa", model_args=f"pretrained={folders['saved']},dtype=float32", tasks=[fx.TASK],
        task_manager=TaskManager(include_path=str(folders["tasks"]), include_defaults=False),
        limit=LIMIT, device="cpu", batch_size=1, log_samples=True,
    )
    _assert_same(_summary(res), own, softmax_lls)


def test_stock_hf_entry_after_import_hf_rfa_matches_own_scoring(folders, own, softmax_lls):
    """``--model hf`` in a process that imported hf_rfa: its load hook attaches the RFA layers."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folders['saved']},dtype=float32", tasks=[fx.TASK],
        task_manager=TaskManager(include_path=str(folders["tasks"]), include_defaults=False),
        limit=LIMIT, device="cpu", batch_size=1, log_samples=True,
    )
    _assert_same(_summary(res), own, softmax_lls)


CHILD = textwrap.dedent(
    r'''
    import importlib.abc, json, sys

    class BlockHfRfa(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_rfa" or name.startswith("hf_rfa."):
                raise ImportError(f"hf_rfa is blocked in this process ({name})")

    sys.meta_path.insert(0, BlockHfRfa())
    try:
        import hf_rfa  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("hf_rfa is importable in the child: the test would prove nothing")

    import lm_eval
    from lm_eval.tasks import TaskManager

    exported, tasks, task, limit, out = sys.argv[1:6]
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported},trust_remote_code=True,dtype=float32", tasks=[task],
        task_manager=TaskManager(include_path=tasks, include_defaults=False),
        limit=int(limit), device="cpu", batch_size=1, log_samples=True,
    )
    r, samples = res["results"][task], res["samples"][task]
    json.dump({
        "acc": r["acc,none"], "acc_norm": r["acc_norm,none"],
        "lls": {str(s["doc_id"]): [float(x[0]) for x in s["filtered_resps"]] for s in samples},
        "correct": {str(s["doc_id"]): int(s["acc"]) for s in samples},
        "hf_rfa_loaded": sorted(k for k in sys.modules if k == "hf_rfa" or k.startswith("hf_rfa.")),
        "remote_modules": sorted(k for k in sys.modules if "modeling_hf_rfa" in k),
    }, open(out, "w"))
    '''
)


def test_exported_folder_through_remote_code_matches_own_scoring(folders, own, softmax_lls, tmp_path):
    script, out = tmp_path / "child.py", tmp_path / "out.json"
    script.write_text(CHILD)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, str(script), str(folders["exported"]), str(folders["tasks"]), fx.TASK, str(LIMIT), str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["hf_rfa_loaded"] == [] and result["remote_modules"]
    _assert_same(result, own, softmax_lls)


def test_generate_until_uses_rfa_cache(folders):
    from lm_eval.api.instance import Instance
    from hf_rfa.hf.cache import RFACache

    lm = ours.RFALM(pretrained=str(folders["saved"]), dtype="float32", device="cpu", batch_size=1)
    made = []

    class Spy(RFACache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    req = Instance(request_type="generate_until", doc={}, arguments=("The cat sat", {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}), idx=0)
    with mock.patch("hf_rfa.hf.cache.RFACache", Spy):
        (text,) = lm.generate_until([req])
    assert len(made) == 1 and made[0].get_seq_length() > 0
    tok = fx.char_tokenizer()
    ids = torch.tensor([tok.encode("The cat sat")])
    with torch.no_grad():
        ref = lm.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **{ours.cache_kwarg(): RFACache(lm.model.config)})
    assert text == tok.decode(ref[0, ids.shape[1]:])


def test_unconverted_folder_refused_or_converted_on_load(tmp_path):
    import transformers as tf

    from tiny_models import tiny_model

    plain = tmp_path / "plain"
    tiny_model("llama").save_pretrained(plain)
    fx.char_tokenizer().save_pretrained(plain)
    with pytest.raises(ValueError, match="not a converted hf_rfa checkpoint"):
        ours.RFALM(pretrained=str(plain), device="cpu")
    lm = ours.RFALM(pretrained=str(plain), device="cpu", rfa_feature_map="none", rfa_window=8, rfa_sinks=2)
    assert hf_rfa.hf.cache.uses_rfa(lm.model) and hf_rfa.rfa_config_of(lm.model).window == 8
    with pytest.raises(ValueError, match="unknown RFAConfig fields"):
        ours.RFALM(pretrained=str(plain), device="cpu", rfa_wndow=8)
    assert isinstance(tf.AutoConfig.from_pretrained(plain), tf.LlamaConfig)


def test_converted_folder_takes_settings_without_parameters(tmp_path):
    """``rfa_memory=3,rfa_window=8`` on a converted folder: the model equals one converted with
    them; a field that shapes parameters is refused naming the ones that can change."""
    from tiny_models import tiny_model

    base = dict(feature_map="favor+", num_features=16, window=4, sinks=1)
    hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**base)).save_pretrained(tmp_path / "saved")
    fx.char_tokenizer().save_pretrained(tmp_path / "saved")
    lm = ours.RFALM(pretrained=str(tmp_path / "saved"), device="cpu", dtype="float32", rfa_window=8, rfa_memory=3)
    want = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(**{**base, "window": 8, "memory": 3}))
    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lm.model(ids).logits, want(ids).logits)
    with pytest.raises(ValueError, match="cannot change"):
        ours.RFALM(pretrained=str(tmp_path / "saved"), device="cpu", rfa_num_features=8)


def test_command_line_runs_offline_task(folders, tmp_path):
    """The documented command: ``python -m hf_rfa.integrations.lm_eval`` with --model hf_rfa."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(Path(hf_rfa.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "hf_rfa.integrations.lm_eval", "--model", "hf_rfa", "--model_args", f"pretrained={folders['saved']},dtype=float32",
           "--tasks", fx.TASK, "--limit", "3", "--device", "cpu", "--batch_size", "1", "--output_path", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())["results"][fx.TASK]
    assert 0.0 <= res["acc,none"] <= 1.0 and res["acc,none"] * 3 == pytest.approx(round(res["acc,none"] * 3))


def test_wrapper_adds_the_offline_task_folder_to_include_path():
    with mock.patch("hf_rfa.integrations.lm_eval_tasks.prepare_tasks", return_value=Path("TASKS")) as prep:
        assert ours.with_offline_tasks(["--model", "hf_rfa", "--tasks", "piqa"]) == ["--model", "hf_rfa", "--tasks", "piqa"]
        prep.assert_not_called()
        assert ours.with_offline_tasks(["--tasks", "piqa,rfa_bbc_topic"]) == ["--tasks", "piqa,rfa_bbc_topic", "--include_path", "TASKS"]
        assert prep.call_args.kwargs["tasks"] == ["rfa_bbc_topic"]
        assert ours.with_offline_tasks(["--tasks=hf_rfa_offline", "--include_path", "mine"]) == ["--tasks=hf_rfa_offline", "--include_path", "mine:TASKS"]
        assert ours.with_offline_tasks(["--tasks", "rfa_bbc_topic", "--include_path=mine"]) == ["--tasks", "rfa_bbc_topic", "--include_path=mine:TASKS"]


def test_wrapper_expands_sample_ranges_for_lm_eval():
    assert ours.with_expanded_samples(["--tasks", "t", "--samples", '{"t":"2-4"}']) == ["--tasks", "t", "--samples", '{"t":[2,3,4]}']
    assert ours.with_expanded_samples(["--samples={\"t\":[\"0-1\",7]}"]) == ['--samples={"t":[0,1,7]}']
    assert ours.with_expanded_samples(["-E", '{"t":"5"}']) == ["-E", '{"t":[5]}']
    assert ours.with_expanded_samples(["--limit", "3"]) == ["--limit", "3"]


def test_bad_sample_range_is_a_one_line_user_error(capsys):
    assert ours.main(["--model", "hf", "--tasks", "t", "--samples", '{"t":"9-3"}']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'9-3'" in err and err.startswith("hf-rfa-lm-eval: error:")
