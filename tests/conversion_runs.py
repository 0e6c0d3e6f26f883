"""Tiny models and texts the conversion tests run on: a tiny Llama / GPT-2 / BERT with a word-level
tokenizer saved to a folder (:func:`tiny_folders`; the module-scoped ``tiny_dir`` fixture, which a test
module imports to use), the conversion flags a tiny model runs in seconds (:func:`conversion_args`) and
the installed console scripts (:func:`installed_command`)."""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest

from tiny_models import VOCAB, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def conversion_script(name: str):
    """conversion/<name>.py loaded by path (conversion/ is not put on sys.path: its evaluate.py
    would shadow the ``evaluate`` package)."""
    spec = importlib.util.spec_from_file_location(f"conversion_{name}", os.path.join(ROOT, "conversion", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORDS = [f"w{i}" for i in range(VOCAB - 3)]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", unk_token="[UNK]", eos_token="[PAD]")


def word_text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    # a little structure (repeated phrases) so that attention is not uniform
    phrases = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(20)]
    return "\n".join(" ".join(rng.choice(phrases) for _ in range(8)) for _ in range(n // 48 + 1))


def tiny_folders(root) -> dict:
    """Folders of a tiny Llama, GPT-2 and BERT (+ tokenizer) and calibration/eval text files in ``root``."""
    tok = word_tokenizer()
    out = {}
    for fam in ("llama", "gpt2", "bert"):
        m = tiny_model(fam)
        d = root / fam
        m.save_pretrained(d)
        tok.save_pretrained(d)
        out[fam] = str(d)
    (root / "cal.txt").write_text(word_text(3000, 0))
    (root / "eval.txt").write_text(word_text(3000, 1))
    (root / "sent.txt").write_text("\n".join(" ".join(random.Random(i).choice(WORDS) for _ in range(12)) for i in range(40)))
    out["cal"], out["eval"], out["sent"] = str(root / "cal.txt"), str(root / "eval.txt"), str(root / "sent.txt")
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Folders of a tiny Llama, GPT-2 and BERT (+ tokenizer) and calibration/eval text files."""
    return tiny_folders(tmp_path_factory.mktemp("tiny"))


def installed_command(command: str) -> str:
    """The installed console script (``[project.scripts]``) beside this interpreter."""
    path = os.path.join(os.path.dirname(sys.executable), command)
    if not os.path.exists(path):
        pytest.skip(f"{command} is not installed beside {sys.executable}")
    return path


def conversion_args(tiny, fam, output, *extra):
    """The family's preset (encoder for BERT, recall else: GPT-2 without rotary embeddings reads
    rotated q/k) with budgets and lengths a tiny model runs in seconds."""
    text = ["--calibration-text", tiny["sent"], "--eval-text", tiny["sent"]] if fam == "bert" else ["--calibration-text", tiny["cal"], "--eval-text", tiny["eval"]]
    preset = ["--preset", "encoder", "--encoder-max-length", "128", "--encoder-pack-tokens", "0"] if fam == "bert" else [
        "--preset", "recall", "--transfer-queries", "8", "--lora-context", "32", "--memory-after-training", "0"]
    if fam == "gpt2":
        preset += ["--feature-input", "rotated"]
    return ["--model", tiny[fam], "--output", str(output), *preset, "--feature-map", "hedgehog", "--num-features", "8", "--window", "4", "--sinks", "1",
            "--transfer-tokens", "256", "--lora-tokens", "0", "--context", "32", "--eval-contexts", "32", "--eval-tokens", "256",
            "--error-tokens", "64", "--random-num-features", "16", "--no-progress", *text, *extra]
