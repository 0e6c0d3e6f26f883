"""Tests of hf_rfa.recipes.training and the recipes in training/ (tiny models and data built in code).

Fast tests run the library in-process; tests marked ``slow`` launch the recipes as 1- and
2-process CPU runs (gloo) through ``accelerate launch`` / ``torchrun``.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import random
import socket
import subprocess
import sys

import pytest
import torch
import transformers as tf
import yaml

import hf_rfa
from hf_rfa.recipes.training import (
    DataArguments, LoopArguments, ModelArguments, RFAArguments, accuracy, apply_lora, build_model,
    load_tokenizer, perplexity, prepare, projection_fingerprint, save_final,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
ACCELERATE = os.path.join(os.path.dirname(PY), "accelerate")
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
from tolerances import DDP_LOSS_REL, FSDP_LOSS_REL, RESUME_LOSS_REL  # noqa: E402

WORDS = "good great fine awful bad poor the a movie film plot actor scene story very quite".split()


def _texts(n: int, seed: int) -> list[tuple[str, int]]:
    """Snippets whose label is given by one sentiment word: learnable by a tiny model."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        label = i % 2
        words = [r.choice(WORDS[6:]) for _ in range(r.randint(4, 12))]
        words.insert(r.randrange(len(words) + 1), r.choice(WORDS[:3] if label else WORDS[3:6]))
        out.append((" ".join(words), label))
    return out


def _tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[EOS]"]))
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", eos_token="[EOS]").save_pretrained(path)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, str]:
    """Tiny BERT / Llama / GPT-2 checkpoints with a word-level tokenizer, CSV and text files."""
    d = tmp_path_factory.mktemp("train_assets")
    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    models = {
        "bert": lambda: tf.BertModel(tf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, pad_token_id=0, **common)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0)),
        "gpt2_dropout": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=0)),  # dropout 0.1
    }
    out = {}
    for name, make in models.items():
        torch.manual_seed(0)
        make().save_pretrained(d / name)
        _tokenizer(str(d / name))
        out[name] = str(d / name)
    for split, n, seed in (("train", 64, 0), ("test", 32, 1)):
        with open(d / f"{split}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(_texts(n, seed))
        out[f"{split}_csv"] = str(d / f"{split}.csv")
    for split, n, seed in (("train", 200, 0), ("eval", 40, 2)):
        (d / f"{split}.txt").write_text("\n\n".join(t for t, _ in _texts(n, seed)))
        out[f"{split}_txt"] = str(d / f"{split}.txt")
    out["dir"] = str(d)
    return out


def _cls_args(assets, **rfa) -> tuple[ModelArguments, DataArguments, RFAArguments]:
    return (
        ModelArguments(model_name_or_path=assets["bert"]),
        DataArguments(task="classification", train_file=assets["train_csv"], validation_file=assets["test_csv"], max_seq_length=32),
        RFAArguments(rfa=hf_rfa.RFAConfig(**{"feature_map": "favor+", "num_features": 16, **rfa})),
    )


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: DataArguments(task="seq2seq", train_file="a.txt"), "task"),
        (lambda: DataArguments(task="causal-lm"), "dataset_name or train_file"),
        (lambda: DataArguments(task="causal-lm", train_file="a.xlsx"), "train_file"),
        (lambda: DataArguments(task="causal-lm", train_file="a.txt", max_seq_length=0), "max_seq_length"),
        (lambda: ModelArguments(model_name_or_path="m", lora_r=-1), "lora_r"),
        (lambda: RFAArguments(rfa="favor+"), "rfa must be an RFAConfig"),
        (lambda: RFAArguments(rfa=hf_rfa.RFAConfig(num_features=0)), "num_features"),
        (lambda: RFAArguments(redraw_interval=-2), "redraw_interval"),
        (lambda: LoopArguments(output_dir="o", learning_rate=0), "learning_rate"),
        (lambda: LoopArguments(output_dir="o", lr_scheduler_type="warp"), "lr_scheduler_type"),
        (lambda: LoopArguments(output_dir="o", gradient_accumulation_steps=0), "gradient_accumulation_steps"),
        (lambda: LoopArguments(output_dir="o", push_to_hub=True), "hub_model_id"),
    ],
    ids=["task", "no-data", "extension", "seq-len", "lora-r", "rfa-type", "num-features", "redraw", "lr", "scheduler", "accumulation", "hub-id"],
)
def test_bad_arguments_raise_value_error_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("command", ["finetune_command", "train_accelerate_command"])
def test_unreachable_hub_model_is_named_in_the_one_line_error(assets, tmp_path, monkeypatch, capsys, command):
    """A --model_name_or_path that cannot be fetched (offline, a typo) is one stderr line naming it,
    exit status 2 (transformers' own message names no model)."""
    from hf_rfa import cli

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cached files.\nCheck your connection.")

    monkeypatch.setattr(tf.AutoTokenizer, "from_pretrained", offline)
    monkeypatch.setattr(tf.AutoConfig, "from_pretrained", offline)
    steps = "--max_steps" if command == "finetune_command" else "--max_train_steps"
    argv = ["--model_name_or_path", "someone/no-such-model", "--task", "causal-lm", "--train_file", assets["train_txt"],
            "--max_seq_length", "16", steps, "1", "--output_dir", str(tmp_path / "run")]
    if command == "finetune_command":
        argv += ["--use_cpu", "true", "--report_to", "none"]
    assert getattr(cli, command)(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --model_name_or_path 'someone/no-such-model' could not be loaded: We couldn't connect" in last


def test_default_preset_on_a_model_it_does_not_fit_names_the_fix(assets):
    """The default preset (recall: un-rotated features, decay, memory) on a model without rotary
    embeddings names the flag that fixes it, as hf-rfa-convert does; BERT got "use decay=0", and
    with --decay 0 a second refusal about rotary embeddings."""
    with pytest.raises(ValueError, match=r"--feature_input unrotated \(preset recall's, the default\) needs rotary .*: use --preset encoder$"):
        build_model(ModelArguments(model_name_or_path=assets["bert"]), RFAArguments(), "classification", label_names=["neg", "pos"])
    with pytest.raises(ValueError, match=r"needs rotary .*GPT2LMHeadModel.*: use --feature_input rotated$"):
        build_model(ModelArguments(model_name_or_path=assets["gpt2"]), RFAArguments(), "causal-lm")
    rotated = RFAArguments(rfa=hf_rfa.RFAConfig.from_preset("recall", feature_input="rotated"))
    with pytest.raises(ValueError, match=r"^--decay needs causal attention, .*BertForSequenceClassification.*: use --preset encoder \(or --decay 0\)$"):
        build_model(ModelArguments(model_name_or_path=assets["bert"]), rotated, "classification", label_names=["neg", "pos"])
    assert hf_rfa.rfa_config_of(build_model(ModelArguments(model_name_or_path=assets["gpt2"]), rotated, "causal-lm")).feature_input == "rotated"


def test_blocks_inside_the_window_warn_and_are_refused_under_ddp(assets, caplog):
    """Causal-LM blocks no longer than the exact window train exact softmax: the learned maps get no
    gradient, which DDP turns into "Expected to have finished reduction in the prior iteration" in
    the Accelerate loop's second step; a warning alone, a ValueError naming the fix under DDP."""
    from hf_rfa.recipes.training.modeling import check_window

    rfa = RFAArguments(rfa=hf_rfa.RFAConfig.from_preset("recall", num_features=8, window=16, sinks=1, decay=16.0))
    model = build_model(ModelArguments(model_name_or_path=assets["llama"]), rfa, "causal-lm")
    with pytest.raises(ValueError, match=r"--window 16 >= --max_seq_length 16: .*use a --max_seq_length above 16$"):
        check_window(model, "causal-lm", 16, ddp=True)
    with caplog.at_level("WARNING", logger="hf_rfa.recipes.training.modeling"):
        check_window(model, "causal-lm", 16, ddp=False)
    assert any("feature maps get no gradient" in r.getMessage() for r in caplog.records)
    check_window(model, "causal-lm", 32, ddp=True)  # longer blocks reach the features: nothing to say
    lora = apply_lora(model, ModelArguments(model_name_or_path=assets["llama"], lora_r=4), "causal-lm")
    with pytest.raises(ValueError, match="DDP refuses"):
        check_window(lora, "causal-lm", 8, ddp=True)  # the maps train in LoRA's modules_to_save too


def test_metrics_are_offline_and_exact():
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    assert perplexity(0.0) == 1.0 and perplexity(1e6) == float("inf")
    with pytest.raises(ValueError, match="predictions"):
        accuracy([1, 2], [1])


# ----------------------------------------------------------------------------- data
def test_classification_data_dynamic_padding_and_labels(assets):
    _, data_args, _ = _cls_args(assets)
    tok = load_tokenizer(ModelArguments(model_name_or_path=assets["bert"]))
    data = prepare(data_args, tok)
    assert data.label_names == ["0", "1"] and len(data.train) == 64 and len(data.eval) == 32
    batch = data.collator([data.train[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["attention_mask"].shape and batch["labels"].tolist() == [0, 1, 0, 1]


def test_string_labels_and_json_lines(assets, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"sentence": t, "label": "pos" if y else "neg"}) for t, y in _texts(10, 0)))
    tok = load_tokenizer(ModelArguments(model_name_or_path=assets["bert"]))
    data = prepare(DataArguments(task="classification", train_file=str(path)), tok)
    assert data.label_names == ["neg", "pos"] and data.train["labels"][:2] == [0, 1]


def test_causal_lm_blocks(assets):
    tok = load_tokenizer(ModelArguments(model_name_or_path=assets["llama"]))
    data = prepare(DataArguments(task="causal-lm", train_file=assets["train_txt"], validation_file=assets["eval_txt"], max_seq_length=16), tok)
    row = data.train[0]
    assert len(row["input_ids"]) == 16 and row["labels"] == row["input_ids"] and len(data.eval) > 0


# ----------------------------------------------------------------------------- models
def test_build_model_converts_original_and_loads_converted(assets, tmp_path):
    model_args, data_args, rfa_args = _cls_args(assets)
    tok = load_tokenizer(model_args)
    model = build_model(model_args, rfa_args, "classification", tok, ["0", "1"])
    assert hf_rfa.rfa_config_of(model).feature_map == "favor+" and len(list(hf_rfa.model_feature_maps(model))) == 2
    model.save_pretrained(tmp_path / "conv")
    tok.save_pretrained(tmp_path / "conv")
    again = build_model(ModelArguments(model_name_or_path=str(tmp_path / "conv")), RFAArguments(rfa=None), "classification", tok, ["0", "1"])
    assert projection_fingerprint(again) == projection_fingerprint(model)
    x = tok(["good movie", "bad plot very"], padding=True, return_tensors="pt")
    torch.testing.assert_close(again.eval()(**x).logits, model.eval()(**x).logits)
    soft = build_model(model_args, RFAArguments(rfa=None), "classification", tok, ["0", "1"])
    assert hf_rfa.rfa_config_of(soft) is None and not list(hf_rfa.model_feature_maps(soft))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_lora_trains_feature_maps_and_saves_loadable_merged_model(assets, tmp_path, family):
    task = "classification" if family == "bert" else "causal-lm"
    model_args = ModelArguments(model_name_or_path=assets[family], lora_r=4)
    tok = load_tokenizer(model_args)
    model = build_model(model_args, RFAArguments(rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8)), task, tok, ["0", "1"])
    model = apply_lora(model, model_args, task)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trainable) and any(".rfa." in n and "weight_q" in n for n in trainable)
    assert not any(n.endswith("embed_tokens.weight") or n.endswith("wte.weight") for n in trainable)
    with torch.no_grad():  # move LoRA B and the feature maps away from their init so a lost merge shows
        for n, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in n or ".rfa." in n):
                p.add_(0.05 * torch.randn_like(p))
    x = tok(["good movie very", "the plot bad"], padding=True, return_tensors="pt")
    before = model.eval()(**x).logits
    save_final(model, tok, str(tmp_path / "final"))
    assert os.path.isfile(tmp_path / "final" / "adapter" / "adapter_config.json")
    cls = tf.AutoModelForSequenceClassification if task == "classification" else tf.AutoModelForCausalLM
    loaded = hf_rfa.from_pretrained(str(tmp_path / "final"), model_class=cls).eval()
    torch.testing.assert_close(loaded(**x).logits, before, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- configs
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "training", "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(path)
    assert cfg.distributed_type in {"NO", "MULTI_GPU", "FSDP", "DEEPSPEED"}
    if cfg.distributed_type == "FSDP":
        assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    if cfg.distributed_type == "DEEPSPEED":
        assert cfg.deepspeed_config["zero_stage"] in (2, 3)


@pytest.mark.parametrize("family, layer", [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block"), ("bert", "BertLayer")])
def test_fsdp_wrap_class_is_the_decoder_layer(assets, family, layer):
    with open(os.path.join(ROOT, "training", "configs", f"fsdp_{family}.yaml")) as f:
        cfg = yaml.safe_load(f)
    assert cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == layer
    model = tf.AutoModel.from_pretrained(assets[family])
    assert sum(type(m).__name__ == layer for m in model.modules()) == 2


# ----------------------------------------------------------------------------- recipes
def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(script: str, args: list[str], processes: int, timeout: int = 300) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    if processes == 1:
        cmd = [PY, os.path.join(ROOT, "training", script), *args]
    else:  # CPU processes under torchrun; ACCELERATE_USE_CPU makes Accelerate pick MULTI_CPU (gloo)
        env["ACCELERATE_USE_CPU"] = "1"
        cmd = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", _port(), os.path.join(ROOT, "training", script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]


def _results(out) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)


def _rel(a: list[float], b: list[float]) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert a.shape == b.shape
    return float(((a - b).abs() / b.abs()).max())


def _acc_args(assets, out, family="bert", **extra) -> list[str]:
    if family == "bert":
        data = ["--task", "classification", "--train_file", assets["train_csv"], "--validation_file", assets["test_csv"]]
    else:
        data = ["--task", "causal-lm", "--train_file", assets["train_txt"], "--validation_file", assets["eval_txt"], "--max_seq_length", "16"]
    args = ["--model_name_or_path", assets[family], *data, "--preset", "favor+", "--num_features", "16", "--redraw_interval", "2",
            "--max_train_steps", "6", "--learning_rate", "1e-3", "--disable_tqdm", "true", "--output_dir", str(out), "--seed", "0"]
    for k, v in extra.items():
        args += [f"--{k}", str(v)]
    return args


def test_accelerate_loop_single_process_resume_is_exact(assets, tmp_path):
    a = _acc_args(assets, tmp_path / "a", per_device_train_batch_size=8, gradient_accumulation_steps=2, checkpointing_steps=3)
    _launch("train_accelerate.py", a, 1)
    full = _results(tmp_path / "a")
    b = _acc_args(assets, tmp_path / "b", per_device_train_batch_size=8, gradient_accumulation_steps=2, resume_from_checkpoint=tmp_path / "a" / "step_3")
    _launch("train_accelerate.py", b, 1)
    resumed = _results(tmp_path / "b")
    assert full["completed_steps"] == resumed["completed_steps"] == 6 and resumed["redraw_step"] == 3
    assert _rel(resumed["losses"], full["losses"]) <= RESUME_LOSS_REL
    assert resumed["projection_fingerprints"] == full["projection_fingerprints"]
    model = hf_rfa.from_pretrained(str(tmp_path / "a" / "final"), model_class=tf.AutoModelForSequenceClassification)
    assert projection_fingerprint(model) == full["projection_fingerprints"][0]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_accelerate_two_processes_match_one_and_resume(assets, tmp_path, family):
    one, two, res = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    _launch("train_accelerate.py", _acc_args(assets, one, family, per_device_train_batch_size=8), 1)
    _launch("train_accelerate.py", _acc_args(assets, two, family, per_device_train_batch_size=4, checkpointing_steps=3), 2)
    r1, r2 = _results(one), _results(two)
    assert r2["num_processes"] == 2 and "MULTI_CPU" in r2["distributed_type"]
    assert _rel(r2["losses"], r1["losses"]) <= DDP_LOSS_REL
    # after 3 redraws (steps 2, 4, 6) both ranks hold the same projections, equal to the 1-process run
    assert r2["redraw_step"] == 3 and len(set(r2["projection_fingerprints"])) == 1
    assert r2["projection_fingerprints"][0] == r1["projection_fingerprints"][0]
    _launch("train_accelerate.py", _acc_args(assets, res, family, per_device_train_batch_size=4, resume_from_checkpoint=two / "step_3"), 2)
    r3 = _results(res)
    assert _rel(r3["losses"], r2["losses"]) <= RESUME_LOSS_REL and r3["final_loss"] == pytest.approx(r2["final_loss"], rel=RESUME_LOSS_REL)
    cls = tf.AutoModelForSequenceClassification if family == "bert" else tf.AutoModelForCausalLM
    assert projection_fingerprint(hf_rfa.from_pretrained(str(two / "final"), model_class=cls)) == r2["projection_fingerprints"][0]


def _trainer_args(assets, out, family, **extra) -> list[str]:
    full = _acc_args(assets, out, family)
    drop = {i for i, x in enumerate(full) if x in ("--max_train_steps", "--disable_tqdm")}
    a = [x for i, x in enumerate(full) if i not in drop and i - 1 not in drop]
    a += ["--max_steps", "6", "--do_train", "--do_eval", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
          "--disable_tqdm", "true", "--use_cpu", "true", "--data_seed", "0"]
    for k, v in extra.items():
        a += [f"--{k}", str(v)]
    return a


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [("bert", 0), ("llama", 4)], ids=["bert-full", "llama-lora"])
def test_trainer_two_processes_match_one(assets, tmp_path, family, lora):
    one, two = tmp_path / "one", tmp_path / "two"
    _launch("finetune.py", _trainer_args(assets, one, family, per_device_train_batch_size=8, lora_r=lora), 1)
    _launch("finetune.py", _trainer_args(assets, two, family, per_device_train_batch_size=4, lora_r=lora), 2)
    r1, r2 = _results(one), _results(two)
    assert r2["num_processes"] == 2 and r1["redraws"] == 3
    assert _rel(r2["losses"], r1["losses"]) <= DDP_LOSS_REL
    prints = {open(p).read() for p in glob.glob(str(two / "fingerprint_rank*.txt"))}
    assert len(prints) == 1 and prints == {r1["projection_fingerprint"]}
    metric = "eval_accuracy" if family == "bert" else "eval_perplexity"
    assert metric in r1 and metric in r2
    cls = tf.AutoModelForSequenceClassification if family == "bert" else tf.AutoModelForCausalLM
    assert projection_fingerprint(hf_rfa.from_pretrained(str(two / "final"), model_class=cls)) == r1["projection_fingerprint"]


@pytest.mark.slow
def test_fsdp2_cpu_gloo_step_matches_unsharded(assets, tmp_path):
    out = tmp_path / "fsdp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", _port(), os.path.join(ROOT, "training", "fsdp_cpu_check.py"),
           "--config", os.path.join(ROOT, "training", "configs", "fsdp_llama.yaml"), "--model_name_or_path", assets["llama"],
           "--train_file", assets["train_txt"], "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["fsdp_units"] == 2 and res["world_size"] == 2
    assert _rel(res["losses"], res["reference_losses"]) <= FSDP_LOSS_REL
    assert all(len(set(step)) == 1 for step in res["fingerprints"])
    assert len({step[0] for step in res["fingerprints"]}) == len(res["fingerprints"])  # each redraw changed them


@pytest.mark.slow
def test_fsdp2_cpu_gloo_chunked_loss_matches_the_unsharded_models_own(assets, tmp_path):
    """FSDP2 over gloo with the training commands' chunked loss (5 positions of logits at a time,
    the output head in the root unit): the losses of 3 steps equal the unsharded twin's with the
    model's own loss, and the head ran chunk by chunk (forward and the backward's recompute)."""
    out = tmp_path / "fsdp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_port", _port(), os.path.join(ROOT, "training", "fsdp_cpu_check.py"),
           "--config", os.path.join(ROOT, "training", "configs", "fsdp_llama.yaml"), "--model_name_or_path", assets["llama"],
           "--train_file", assets["train_txt"], "--out", str(out), "--chunked_loss", "--chunk_positions", "5"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["chunked_loss"] and res["world_size"] == 2
    assert _rel(res["losses"], res["reference_losses"]) <= FSDP_LOSS_REL
    calls = [tuple(c) for c in res["head_calls"]]
    assert calls and all(rows == 2 and positions <= 5 for rows, positions in calls)
    assert len(calls) == 3 * 2 * math.ceil(31 / 5), calls  # 3 steps × (forward + recompute) × chunks of 31 predicted positions


def test_deepspeed_is_reported_when_unavailable():
    """DeepSpeed configs only load here; running them needs `pip install deepspeed` and GPUs."""
    from accelerate.utils import is_deepspeed_available

    if is_deepspeed_available():
        pytest.skip("deepspeed installed: run training/run_deepspeed.sh on GPUs")
    readme = open(os.path.join(ROOT, "training", "README.md")).read()
    assert "DeepSpeed" in readme and "not installed" in readme


class _Payload:
    """Unpickling this runs code (what a crafted checkpoint file would do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_latest_checkpoint_skips_incomplete(tmp_path):
    from hf_rfa.recipes.training import latest_checkpoint
    from hf_rfa.recipes.training.loop import COMPLETE_FILE

    for n in (3, 6, 9):
        (tmp_path / f"step_{n}").mkdir()
    for n in (3, 6):
        (tmp_path / f"step_{n}" / COMPLETE_FILE).write_text(str(n))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_6")  # step_9: killed while saving


def test_train_state_json_rejects_bad_values(tmp_path):
    from hf_rfa.recipes.training import TrainState

    state = TrainState(completed_steps=3, losses=[1.5])
    state.save_json(str(tmp_path))
    other = TrainState()
    other.load_json(str(tmp_path))
    assert other == state
    for bad in ({"completed_steps": "3"}, {"evil": 1}, {"losses": ["x"]}, {"epoch": -1}):
        with pytest.raises(ValueError, match="train state"):
            other.load_state_dict(bad)


def test_resume_latest_never_unpickles_state_and_keeps_log_unique(assets, tmp_path):
    """Resume in the same folder after the run was 'killed' while saving step_6: latest picks the
    complete step_3; a planted custom_checkpoint pickle is refused (never loaded); once it is
    removed, log.jsonl lists each step once and the losses equal the uninterrupted run's."""
    import pickle

    out = tmp_path / "run"
    args = _acc_args(assets, out, per_device_train_batch_size=8, gradient_accumulation_steps=2, checkpointing_steps=3)
    _launch("train_accelerate.py", args, 1)
    full = _results(out)
    assert (out / "step_3" / "train_state.json").is_file() and not glob.glob(str(out / "step_*" / "custom_checkpoint_*.pkl"))
    os.remove(out / "step_6" / "COMPLETE")  # killed while saving step_6
    sentinel = tmp_path / "pwned"
    with open(out / "step_3" / "custom_checkpoint_0.pkl", "wb") as f:
        pickle.dump(_Payload(str(sentinel)), f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = subprocess.run([PY, os.path.join(ROOT, "training", "train_accelerate.py"), *args, "--resume_from_checkpoint", "latest"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and "never unpickles" in proc.stderr and not sentinel.exists()
    os.remove(out / "step_3" / "custom_checkpoint_0.pkl")
    _launch("train_accelerate.py", args + ["--resume_from_checkpoint", "latest"], 1)
    resumed = _results(out)
    with open(out / "log.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert _rel(resumed["losses"], full["losses"]) <= RESUME_LOSS_REL


def test_resume_with_dropout_is_exact(assets, tmp_path):
    """GPT-2's default dropout (0.1): the resumed run draws the same dropout masks (RNG states
    restored after the resumed data iterator is created)."""
    a = _acc_args(assets, tmp_path / "a", "gpt2_dropout", per_device_train_batch_size=4, checkpointing_steps=3)
    _launch("train_accelerate.py", a, 1)
    full = _results(tmp_path / "a")
    b = _acc_args(assets, tmp_path / "b", "gpt2_dropout", per_device_train_batch_size=4, resume_from_checkpoint=tmp_path / "a" / "step_3")
    _launch("train_accelerate.py", b, 1)
    resumed = _results(tmp_path / "b")
    assert _rel(resumed["losses"], full["losses"]) <= RESUME_LOSS_REL


def test_finetune_trains_without_do_train(assets, tmp_path):
    """``hf-rfa-finetune`` with neither --do_train nor --do_eval trains (TrainingArguments' do_train
    defaults to False: the command once trained nothing, saved nothing and said nothing)."""
    from hf_rfa import cli

    out = tmp_path / "run"
    argv = ["--model_name_or_path", assets["llama"], "--task", "causal-lm", "--train_file", assets["train_txt"], "--max_seq_length", "16",
            "--preset", "recall", "--num_features", "8", "--window", "4", "--sinks", "1", "--decay", "16", "--max_steps", "2",
            "--per_device_train_batch_size", "4", "--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
            "--disable_tqdm", "true", "--output_dir", str(out)]
    assert cli.finetune_command(argv) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["train_loss"] > 0 and len(res["losses"]) == 2 and (out / "final" / "config.json").is_file()
    assert hf_rfa.rfa_config_of(hf_rfa.from_pretrained(str(out / "final"), model_class=tf.AutoModelForCausalLM)).feature_input == "unrotated"


def test_trainer_reports_the_metric_flag_with_offline_fallback(assets, tmp_path):
    """``--metric accuracy f1``: evaluate.load fails offline (forced here), the offline metrics
    run on the Trainer's predictions and their values are reported as ``eval_<name>``."""
    from unittest import mock

    from hf_rfa.integrations import metrics as M
    from hf_rfa.recipes.training.trainer import run_trainer

    model_args, data_args, rfa_args = _cls_args(assets)
    data_args.metric = ["accuracy", "f1"]
    seen = {}

    def spy_f1(predictions, references, **kw):
        seen.update(p=predictions, r=references, kw=kw)
        return M.f1(predictions, references, **kw)

    args = tf.TrainingArguments(output_dir=str(tmp_path), do_train=False, do_eval=True, report_to=[], per_device_eval_batch_size=8, use_cpu=True)
    with mock.patch.object(M, "_evaluate_load", side_effect=FileNotFoundError("no Hub")), mock.patch.dict(M.OFFLINE_METRICS, {"f1": spy_f1}):
        res = run_trainer(model_args, data_args, rfa_args, args)
    assert len(seen["p"]) == len(seen["r"]) == 32 and seen["kw"] == {"average": "binary"}
    assert res["eval_f1"] == M.f1(seen["p"], seen["r"])["f1"]
    assert res["eval_accuracy"] == M.accuracy(seen["p"], seen["r"])["accuracy"]
    with pytest.raises(ValueError, match="metric must name"):
        DataArguments(task="classification", train_file=assets["train_csv"], metric=[])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trainer_chunked_loss_equals_the_models_own(assets, tmp_path, family, monkeypatch):
    """``--chunked_loss`` (default): Trainer's causal-LM training loss runs the head and the
    cross-entropy a few positions at a time (here 5, across 2 accumulated micro-batches of 4
    sequences): the same losses and the same trained weights as the model's own loss; the
    model's forward is its class's again afterwards, and evaluation keeps its own forward."""
    from hf_rfa.recipes.conversion import lm_loss
    from hf_rfa.recipes.training.trainer import run_trainer

    monkeypatch.setattr(lm_loss, "LOSS_CHUNK_BYTES", 4 * 32 * 4 * 5)  # 5 positions of a 4-sequence batch
    calls = []
    real = lm_loss._chunk_nll
    monkeypatch.setattr(lm_loss, "_chunk_nll", lambda head, hidden, target: calls.append(hidden.shape) or real(head, hidden, target))
    results, weights = {}, {}
    for chunked in (False, True):
        out = tmp_path / str(chunked)
        model_args = ModelArguments(model_name_or_path=assets[family], lora_r=4, chunked_loss=chunked)
        data_args = DataArguments(task="causal-lm", train_file=assets["train_txt"], validation_file=assets["eval_txt"], max_seq_length=16)
        rfa_args = RFAArguments(rfa=hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
        args = tf.TrainingArguments(output_dir=str(out), do_train=True, do_eval=True, max_steps=2, per_device_train_batch_size=4,
                                    gradient_accumulation_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                    disable_tqdm=True, seed=0, data_seed=0)
        results[chunked] = run_trainer(model_args, data_args, rfa_args, args)
        weights[chunked] = hf_rfa.from_pretrained(str(out / "final"), model_class=tf.AutoModelForCausalLM).state_dict()
        assert bool(calls) == chunked == results[chunked]["chunked_loss"]
    # 2 steps x 2 micro-batches x 15 predicted positions in chunks of 5, each run again in the backward
    assert len(calls) == 2 * 2 * 3 * 2 and {tuple(shape[:2]) for shape in calls} == {(4, 5)}
    assert _rel(results[True]["losses"], results[False]["losses"]) <= 1e-6
    assert results[True]["eval_loss"] == pytest.approx(results[False]["eval_loss"], rel=1e-6)
    assert weights[True].keys() == weights[False].keys()
    for k in weights[True]:
        torch.testing.assert_close(weights[True][k], weights[False][k], rtol=1e-5, atol=1e-6, msg=k)


def test_accelerate_loop_chunked_loss_equals_the_models_own(assets, tmp_path):
    """hf-rfa-train's ``--chunked_loss`` (default) gives the losses and the trained weights of the
    model's own loss (tiny Llama, LoRA, 2 accumulated micro-batches); results.json says it ran."""
    runs = {}
    for chunked in ("false", "true"):
        out = tmp_path / chunked
        _launch("train_accelerate.py", _acc_args(assets, out, "llama", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                                 max_train_steps=2, lora_r=4, chunked_loss=chunked), 1)
        runs[chunked] = (_results(out), hf_rfa.from_pretrained(str(out / "final"), model_class=tf.AutoModelForCausalLM).state_dict())
    assert runs["true"][0]["chunked_loss"] is True and runs["false"][0]["chunked_loss"] is False
    assert _rel(runs["true"][0]["losses"], runs["false"][0]["losses"]) <= 1e-6
    for k, v in runs["true"][1].items():
        torch.testing.assert_close(v, runs["false"][1][k], rtol=1e-5, atol=1e-6, msg=k)
