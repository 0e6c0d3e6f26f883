"""hf_rfa.export / push_to_hub: a Hub-ready folder that loads with trust_remote_code=True
in a process where hf_rfa cannot be imported, with identical outputs and the saved buffers."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers as tf
import yaml
from safetensors.torch import load_file, save_file

import hf_rfa
from hf_rfa.hub.export import MODELING_FILE, bundle_sources, bundled_modules, export, push_to_hub
from hf_rfa.hub.model_card import metrics_table

VOCAB = 128


def tiny_config(family: str):
    """Tiny configs built in code (Llama with GQA: 4 query heads, 2 KV heads)."""
    if family == "llama":
        return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if family == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1)
    if family == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=128)
    raise ValueError(family)


def tiny_model(family: str, head: str = "lm"):
    torch.manual_seed(0)
    cfg = tiny_config(family)
    if family == "bert":
        return tf.BertModel(cfg).eval()
    return (tf.AutoModelForCausalLM if head == "lm" else tf.AutoModel).from_config(cfg).eval()


def batch(family: str, n: int = 20, b: int = 3):
    """Token ids and a padding mask: left padding for decoders, right padding for BERT."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for i, p in enumerate([0, 5, 11][:b]):
        if p and family == "bert":
            mask[i, n - p:] = 0
        elif p:
            mask[i, :p] = 0
    return ids, mask


def output_of(family: str, out):
    return out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out.logits

def _perturb_learned(model: torch.nn.Module) -> None:
    """Move learned feature-map parameters away from their init, so only loading can restore them."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".rfa." in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _rfa_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if ".rfa." in k}


# name: (family, head, RFAConfig kwargs, redraw step or None, perturb learned, expected Auto class)
CASES = {
    "llama_gqa_favor_window_sinks": ("llama", "lm", dict(feature_map="favor+", num_features=16, window=4, sinks=2), None, False, "AutoModelForCausalLM"),
    "llama_gqa_redraw3": ("llama", "lm", dict(feature_map="favor+", num_features=16, window=4, sinks=2), 3, False, "AutoModelForCausalLM"),
    "gpt2_hedgehog_window": ("gpt2", "lm", dict(feature_map="hedgehog", num_features=8, window=3), None, True, "AutoModelForCausalLM"),
    "bert_positive_redraw3": ("bert", "base", dict(feature_map="positive", num_features=16, window=2, sinks=1), 3, False, "AutoModel"),
    "llama_favor_memory": ("llama", "lm", dict(feature_map="favor+", num_features=16, window=4, sinks=2, memory=3, memory_every=4), None, False, "AutoModelForCausalLM"),
    "llama_hedgehog_norm_preserving": ("llama", "lm", dict(feature_map="hedgehog", num_features=8, window=3, sinks=1, decay=4.0,
                                                          feature_map_options={"hybrid_mix": True, "norm_preserving": True}), None, True, "AutoModelForCausalLM"),
    "llama_hedgehog_memory_distance": ("llama", "lm", dict(feature_map="hedgehog", num_features=8, window=3, sinks=1, memory=3, memory_every=4,
                                                          feature_input="unrotated", memory_distance=5), None, True, "AutoModelForCausalLM"),
    "llama_cls_rfa_gate": ("llama", "cls", dict(feature_map="rfa", num_features=8, gate=True, sinks=1), None, True, "AutoModelForSequenceClassification"),
}


def _build(name: str) -> torch.nn.Module:
    family, head, kwargs, step, perturb, _auto = CASES[name]
    if head == "cls" and family == "llama":
        torch.manual_seed(0)
        cfg = tiny_config("llama")
        cfg.num_labels, cfg.pad_token_id = 3, 0
        model = tf.LlamaForSequenceClassification(cfg).eval()
    else:
        model = tiny_model(family, head)
    hf_rfa.convert(model, hf_rfa.RFAConfig(**kwargs))
    if step is not None:
        assert hf_rfa.redraw(model, step) > 0
    if perturb:
        _perturb_learned(model)
    return model


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

    import torch
    import transformers

    jobs = json.load(open(sys.argv[1]))
    results = {}
    for name, job in jobs.items():
        auto = getattr(transformers, job["auto"])
        try:
            model = auto.from_pretrained(job["dir"], trust_remote_code=True).eval()
        except Exception as e:  # reported to the parent
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        data = torch.load(job["inputs"])
        with torch.no_grad():
            out = model(input_ids=data["ids"], attention_mask=data["mask"])
        out = out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out.logits
        results[name] = {
            "out": out,
            "rfa": {k: v for k, v in model.state_dict().items() if ".rfa." in k},
            "cls": type(model).__name__,
            "base": type(model).__mro__[1].__name__,
            "attn": model.config._attn_implementation,
            "rfa_modules": sum(1 for m in model.modules() if type(m).__name__ == "RFAAttention"),
            "hf_rfa_loaded": sorted(k for k in sys.modules if k == "hf_rfa" or k.startswith("hf_rfa.")),
        }
        if job["auto"] == "AutoModelForCausalLM":
            with torch.no_grad():
                gen = model.generate(data["ids"][:1], max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
            results[name]["cache"] = type(gen.past_key_values).__name__
            results[name]["key_copies"] = [getattr(getattr(layer, "state", None), "mem_kf", None) is not None for layer in gen.past_key_values.layers]
            results[name]["tokens"] = gen.sequences
    torch.save(results, sys.argv[2])
    '''
)


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """Export every case, load all of them in one isolated child process; returns (models, inputs, results)."""
    tmp = tmp_path_factory.mktemp("export")
    models, inputs, jobs = {}, {}, {}
    for name, (family, _head, _kw, _step, _perturb, auto) in CASES.items():
        model = _build(name)
        ids, mask = batch(family)
        inputs[name] = (ids, mask)
        torch.save({"ids": ids, "mask": mask}, tmp / f"{name}.pt")
        export(model, tmp / name, base_model=f"tiny/{family}", metrics={"note": "unit test"})
        models[name] = model
        jobs[name] = {"dir": str(tmp / name), "auto": auto, "inputs": str(tmp / f"{name}.pt")}
    # a checkpoint that lost its rfa tensors must not load with uninitialised buffers
    export(models["llama_gqa_redraw3"], tmp / "missing", base_model="tiny/llama")
    weights = tmp / "missing" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if ".rfa." not in k}, weights, metadata={"format": "pt"})
    jobs["missing"] = {"dir": str(tmp / "missing"), "auto": "AutoModelForCausalLM", "inputs": str(tmp / "llama_gqa_redraw3.pt")}

    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp / "modules"), OMP_NUM_THREADS="2")
    proc = subprocess.run(
        [sys.executable, "-I", str(tmp / "child.py"), str(tmp / "jobs.json"), str(tmp / "results.pt")],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (tmp / "child_stderr.txt").write_text(proc.stderr)
    return models, inputs, torch.load(tmp / "results.pt"), tmp


def test_remote_load_warns_about_no_missing_kernel_source(remote):
    stderr = (remote[3] / "child_stderr.txt").read_text()
    assert "causal_cpu.cpp" not in stderr and "native CPU kernel unavailable" not in stderr, stderr[-2000:]


def test_remote_generate_uses_the_constant_memory_cache(remote):
    models, inputs, results, _ = remote
    # (the un-rotated memory keeps no copies of its keys through remote code either)
    assert results["llama_hedgehog_memory_distance"]["key_copies"] == [False] * models["llama_hedgehog_memory_distance"].config.num_hidden_layers
    for name in ("llama_gqa_favor_window_sinks", "gpt2_hedgehog_window", "llama_favor_memory", "llama_hedgehog_memory_distance"):
        assert results[name]["cache"] == "RFACache", results[name]
        ids = inputs[name][0][:1]
        with torch.no_grad():
            want = models[name].generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(results[name]["tokens"], want)


@pytest.mark.parametrize("name", list(CASES))
def test_remote_code_without_hf_rfa_gives_identical_outputs(remote, name):
    models, inputs, results, _ = remote
    res = results[name]
    assert "error" not in res, res.get("error")
    assert res["hf_rfa_loaded"] == []
    model = models[name]
    assert res["cls"] == "RFA" + type(model).__name__ and res["base"] == type(model).__name__
    assert res["attn"] == "rfa"
    assert res["rfa_modules"] == sum(1 for m in model.modules() if isinstance(m, hf_rfa.hf.attention.RFAAttention)) > 0
    ids, mask = inputs[name]
    with torch.no_grad():
        ref = output_of(CASES[name][0], model(input_ids=ids, attention_mask=mask))
    assert res["out"].shape == ref.shape
    assert torch.equal(res["out"], ref) or (res["out"] - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_remote_buffers_and_parameters_come_from_the_checkpoint(remote, name):
    models, _, results, _ = remote
    saved = _rfa_state(models[name])
    loaded = results[name]["rfa"]
    assert sorted(loaded) == sorted(saved) and saved
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k


def test_redrawn_projections_differ_from_a_fresh_draw(remote):
    """After redraw(3) the checkpoint holds step-3 projections, not what __init__ draws (step 0)."""
    models, _, results, _ = remote
    fresh = _build("llama_gqa_favor_window_sinks")
    omega = [k for k in results["llama_gqa_redraw3"]["rfa"] if k.endswith("omega")]
    assert omega
    for k in omega:
        assert not torch.equal(results["llama_gqa_redraw3"]["rfa"][k], fresh.state_dict()[k])
        assert int(results["llama_gqa_redraw3"]["rfa"][k.replace("omega", "step")]) == 3


def test_checkpoint_without_rfa_tensors_is_refused(remote):
    _, _, results, _ = remote
    assert "lacks" in results["missing"].get("error", ""), results["missing"]


def test_exported_folder_layout_and_config(remote):
    models, _, _, tmp = remote
    out = tmp / "llama_gqa_favor_window_sinks"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", MODELING_FILE} <= names
    assert set(bundle_sources()) <= names
    cfg = json.loads((out / "config.json").read_text())
    # a marked model type: where hf_rfa is not imported, only trust_remote_code=True loads it (never as softmax)
    assert cfg["model_type"] == "hf_rfa_llama"
    assert cfg["auto_map"] == {"AutoConfig": "modeling_hf_rfa.LlamaConfig", "AutoModelForCausalLM": "modeling_hf_rfa.RFALlamaForCausalLM"}
    assert cfg["rfa_config"] == models["llama_gqa_favor_window_sinks"].config.rfa_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    bert = json.loads((tmp / "bert_positive_redraw3" / "config.json").read_text())
    assert bert["auto_map"]["AutoModel"] == "modeling_hf_rfa.RFABertModel"
    cls = json.loads((tmp / "llama_cls_rfa_gate" / "config.json").read_text())
    assert [a for a in cls["auto_map"] if a != "AutoConfig"][0] == "AutoModelForSequenceClassification"


def test_transformers_copies_every_generated_file(remote):
    """transformers' own import follower reaches every bundled module from the modeling file."""
    from transformers.dynamic_module_utils import check_imports, get_relative_import_files

    _, _, _, tmp = remote
    out = tmp / "gpt2_hedgehog_window"
    followed = {Path(f).name for f in get_relative_import_files(str(out / MODELING_FILE))}
    assert followed == set(bundle_sources())
    for f in [MODELING_FILE, *followed]:
        check_imports(str(out / f))  # only installed packages imported


def test_bundle_is_the_declared_module_list():
    """The remote code is exactly BUNDLED_MODULES, which is the import closure of hf_rfa.hf.convert and hf_rfa.hf.cache;
    a bundled module importing an undeclared hf_rfa module is refused, naming the list."""
    from hf_rfa.hub import bundle

    assert bundle.import_closure() == sorted(bundle.BUNDLED_MODULES)
    assert set(bundle_sources()) == {bundle.flat_name(m) + ".py" for m in bundle.BUNDLED_MODULES}
    with pytest.raises(ValueError, match=r"hf_rfa\.hf\.(convert|cache) imports .*BUNDLED_MODULES"):
        bundle.bundle_sources([m for m in bundle.BUNDLED_MODULES if m != "hf_rfa.hf.attention"])


def test_bundled_sources_are_the_library_source():
    """Generated files equal hf_rfa's modules except for the header and intra-package imports."""
    files = bundle_sources()
    assert "hf_rfa_hf_convert.py" in files and "hf_rfa_feature_maps_learned.py" in files and "hf_rfa_ops_attention.py" in files
    sources = bundled_modules()
    assert set(sources) == set(files)
    for fname, text in files.items():
        assert text.startswith("# Generated by hf_rfa")
        assert _code_without_package_imports(text) == _code_without_package_imports(sources[fname].read_text()), fname
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and (node.module or node.names[0].name).startswith("hf_rfa_"), ast.unparse(node)


def _code_without_package_imports(source: str) -> str:
    """AST dump of a module with its relative imports removed (what must be identical)."""

    class Strip(ast.NodeTransformer):
        def visit_ImportFrom(self, node):
            return None if node.level else node

    return ast.dump(Strip().visit(ast.parse(source)))


def test_model_card(remote):
    _, _, _, tmp = remote
    text = (tmp / "llama_gqa_favor_window_sinks" / "README.md").read_text()
    _, front, body = text.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "tiny/llama"
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"hf_rfa", "linear-attention", "random-feature-attention"} <= set(meta["tags"])
    assert "trust_remote_code=True" in body and "hf_rfa.from_pretrained" in body
    assert "| `window`: exact-softmax local window W (0: none; >= N: exact softmax) | 4 |" in body
    # every RFAConfig field is explained by its own dataclass help text (no second copy to drift)
    for f in dataclasses.fields(hf_rfa.RFAConfig):
        assert f"| `{f.name}`: {f.metadata['help'].replace('|', chr(92) + '|')} |" in body, f.name
    assert "| note | unit test |" in body
    assert "<this-repo>" not in body and str(tmp / "llama_gqa_favor_window_sinks") in body
    bert = yaml.safe_load((tmp / "bert_positive_redraw3" / "README.md").read_text().split("---\n", 2)[1])
    assert bert["pipeline_tag"] == "feature-extraction"


def test_metrics_table_only_reports_given_numbers():
    assert "No quality measurements" in metrics_table(None)
    table = metrics_table({"wikitext ppl": {"softmax": 10.25, "rfa": 11.5}, "lambada acc": {"rfa": 0.5}})
    assert "| wikitext ppl | 10.25 | 11.5 |" in table and "| lambada acc |  | 0.5 |" in table
    with pytest.raises(ValueError, match=r"metrics\['ppl'\]\['rfa'\]"):
        metrics_table({"ppl": {"rfa": [1.0]}})
    with pytest.raises(ValueError, match=r"metrics\['ppl'\]"):
        metrics_table({"ppl": float("nan")})


def test_hf_rfa_from_pretrained_loads_the_export(remote):
    models, inputs, _, tmp = remote
    loaded = hf_rfa.from_pretrained(str(tmp / "gpt2_hedgehog_window"))
    ids, mask = inputs["gpt2_hedgehog_window"]
    with torch.no_grad():
        a = loaded(input_ids=ids, attention_mask=mask).logits
        b = models["gpt2_hedgehog_window"](input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a, b)


def test_export_errors(tmp_path):
    plain = tiny_model("gpt2")
    with pytest.raises(ValueError, match="rfa_config"):
        export(plain, tmp_path / "a")
    model = hf_rfa.convert(tiny_model("gpt2"), hf_rfa.RFAConfig(num_features=8))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("")
    with pytest.raises(ValueError, match="out_dir"):
        export(model, tmp_path / "b")
    with pytest.raises(ValueError, match="auto_class"):
        export(model, tmp_path / "c", auto_class="AutoModelForMaskedLM")
    with pytest.raises(ValueError, match="tags"):
        export(model, tmp_path / "d", tags=["ok", ""])
    with pytest.raises(ValueError, match=r"metrics\['ppl'\]"):
        export(model, tmp_path / "e", metrics={"ppl": None})


def test_export_refuses_feature_maps_from_outside_hf_rfa(tmp_path):
    from hf_rfa.feature_maps import registry
    from hf_rfa.feature_maps.learned import EluFeatures

    name = "elu-test-export-outside"
    hf_rfa.register_feature_map(name)(type("OutsideElu", (EluFeatures,), {"__module__": "my_package.maps"}))
    try:
        model = hf_rfa.convert(tiny_model("gpt2"), hf_rfa.RFAConfig(feature_map=name))
        with pytest.raises(ValueError, match="feature_map"):
            export(model, tmp_path / "out")
    finally:
        registry._REGISTRY.pop(name)


def test_push_to_hub_uploads_the_exported_folder():
    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8))
    seen = {}

    def fake_upload(self, *, repo_id, folder_path, **kwargs):
        seen.update(repo_id=repo_id, kwargs=kwargs, files=sorted(os.listdir(folder_path)))
        seen["config"] = json.loads((Path(folder_path) / "config.json").read_text())
        seen["card"] = (Path(folder_path) / "README.md").read_text()
        return "commit-info"

    with mock.patch("huggingface_hub.HfApi.create_repo") as create, mock.patch("huggingface_hub.HfApi.upload_folder", fake_upload):
        result = hf_rfa.push_to_hub(model, "me/tiny-llama-rfa", base_model="tiny/llama", private=True)
    assert result == "commit-info"
    create.assert_called_once()
    assert create.call_args.args[0] == "me/tiny-llama-rfa" and create.call_args.kwargs["private"] is True
    assert seen["repo_id"] == "me/tiny-llama-rfa" and seen["kwargs"]["repo_type"] == "model"
    assert {"config.json", "model.safetensors", "README.md", MODELING_FILE, "hf_rfa_hf_convert.py"} <= set(seen["files"])
    assert "auto_map" in seen["config"] and yaml.safe_load(seen["card"].split("---\n")[1])["base_model"] == "tiny/llama"
    assert 'from_pretrained("me/tiny-llama-rfa", trust_remote_code=True)' in seen["card"]
    with pytest.raises(ValueError, match="repo_id"):
        push_to_hub(model, "")


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def test_export_saves_tokenizer_and_sentence_transformers_files(tmp_path):
    """A sentence-transformers folder (MiniLM-like) exports with its tokenizer, modules.json,
    sentence_bert_config.json and 1_Pooling/."""
    src = tmp_path / "src"
    tiny_model("bert").save_pretrained(src)
    _tiny_tokenizer().save_pretrained(src)
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    (src / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    model = hf_rfa.convert(tf.AutoModel.from_pretrained(src), hf_rfa.RFAConfig(feature_map="positive", num_features=8))
    out = export(model, tmp_path / "out")
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        assert (out / name).read_text() == (src / name).read_text(), name
    tok = tf.AutoTokenizer.from_pretrained(out)
    assert tok("w1 w5 zz")["input_ids"] == _tiny_tokenizer()("w1 w5 zz")["input_ids"]


def test_export_without_tokenizer_warns(tmp_path, caplog):
    model = hf_rfa.convert(tiny_model("gpt2"), hf_rfa.RFAConfig(num_features=8))
    with caplog.at_level("WARNING", logger="hf_rfa.export"):
        export(model, tmp_path / "out")
    assert any("no tokenizer" in r.getMessage() for r in caplog.records)


def test_model_card_metadata_through_huggingface_hub(tmp_path):
    from huggingface_hub import ModelCard

    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8))
    metrics = {"perplexity @64 (100 held-out tokens)": {"converted": 12.5, "original": 10.0}, "note": {"converted": "x"}}
    out = export(model, tmp_path / "out", base_model="tiny/llama", metrics=metrics, license="apache-2.0", repo_id="me/tiny", dataset_name="wikitext")
    card = ModelCard.load(out / "README.md")
    assert card.data.license == "apache-2.0" and card.data.base_model == "tiny/llama"
    results = {(r.metric_name, r.metric_value, r.dataset_name) for r in card.data.eval_results}
    assert results == {("perplexity @64 (100 held-out tokens) [converted]", 12.5, "wikitext"),
                       ("perplexity @64 (100 held-out tokens) [original]", 10.0, "wikitext")}
    assert 'from_pretrained("me/tiny", trust_remote_code=True)' in card.text


def test_push_failure_keeps_the_folder_and_says_what_to_do():
    from hf_rfa.hub.export import PushError

    model = hf_rfa.convert(tiny_model("llama"), hf_rfa.RFAConfig(num_features=8))

    def offline(*args, **kwargs):
        raise OSError("Connection refused")

    with mock.patch("huggingface_hub.HfApi.create_repo", offline):
        with pytest.raises(PushError, match="hf upload me/tiny") as err:
            push_to_hub(model, "me/tiny")
    folder = Path(err.value.folder)
    try:
        assert (folder / "model.safetensors").is_file() and (folder / MODELING_FILE).is_file()
    finally:
        import shutil

        shutil.rmtree(folder)


def test_model_card_describes_the_exact_memory():
    """The card's summary says what the memory keeps (and nothing about one when there is none)."""
    from hf_rfa.hub.model_card import render_model_card

    base = dict(feature_map="hedgehog", num_features=64, window=64, sinks=4)
    card = render_model_card(hf_rfa.RFAConfig(**base, memory=128, memory_score="feature_error"), "LlamaForCausalLM", "AutoModelForCausalLM")
    assert "an exact memory of at most 128 older keys per key-value head (the keys whose value the feature state recalls worst, re-chosen every 64 tokens)" in card
    by_norm = render_model_card(hf_rfa.RFAConfig(**base, memory=32, memory_every=16), "LlamaForCausalLM", "AutoModelForCausalLM")
    assert "at most 32 older keys per key-value head (the keys with the largest value norm, re-chosen every 16 tokens)" in by_norm
    assert "exact memory" not in render_model_card(hf_rfa.RFAConfig(**base), "LlamaForCausalLM", "AutoModelForCausalLM").split("## Usage")[0]
    per_layer = render_model_card(hf_rfa.RFAConfig(**base, memory=0, memory_per_layer=[0, 96, 512], memory_score="query_mass"), "LlamaForCausalLM", "AutoModelForCausalLM")
    assert "an exact memory of per-layer sizes of 0–512 older keys per key-value head (the keys their window's queries attended to most" in per_layer
