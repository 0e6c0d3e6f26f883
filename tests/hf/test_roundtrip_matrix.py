"""Every way to save a converted model × every way to load it: the converted logits, or a loud error.

Save paths: ``save_pretrained``, a Trainer checkpoint, PEFT's ``save_pretrained`` (a stock LoRA
config, and one that trains the ``rfa`` modules), :func:`hf_rfa.export`. Load paths:
:func:`hf_rfa.from_pretrained`, ``AutoModelForCausalLM`` (with hf_rfa imported, with
``trust_remote_code=True``, and both in a process where hf_rfa cannot be imported),
``AutoPeftModelForCausalLM`` (with and without hf_rfa). A cell that loads must reproduce the
converted model's logits; a cell may instead raise. Loading as softmax is never allowed — except
the one case hf_rfa cannot reach: a PEFT adapter whose base was converted in memory, loaded where
hf_rfa is not imported (its saving warns; checked below).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_rfa
from tiny_models import batch, tiny_model

MODELS = {
    "favor_redrawn": dict(feature_map="favor+", num_features=16, window=3, sinks=1),
    "hedgehog_trained": dict(feature_map="hedgehog", num_features=8),
}
SAVES = ("save_pretrained", "trainer_checkpoint", "peft", "peft_rfa_trained", "export")
LOADS = ("hf_rfa", "auto", "auto_remote", "auto_peft", "child_auto", "child_remote", "child_peft")
#: cells that must load (the others may raise, but never give other logits)
MUST_LOAD = {(s, load) for s in ("save_pretrained", "trainer_checkpoint", "export") for load in ("hf_rfa", "auto", "auto_remote", "child_remote")} | {
    ("peft", "auto_peft"), ("peft", "auto"), ("peft_rfa_trained", "auto_peft"),
}
#: PEFT adapters whose base was converted in memory: without hf_rfa nothing reads their rfa files
UNREACHABLE = {(s, load) for s in ("peft", "peft_rfa_trained") for load in ("child_auto", "child_remote", "child_peft")}

CHILD = textwrap.dedent(
    r'''
    import importlib.abc, json, sys

    class BlockHfRfa(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "hf_rfa" or name.startswith("hf_rfa."):
                raise ImportError(f"hf_rfa is blocked in this process ({name})")

    sys.meta_path.insert(0, BlockHfRfa())
    import torch, transformers
    from peft import AutoPeftModelForCausalLM

    jobs = json.load(open(sys.argv[1]))
    data = torch.load(sys.argv[2])
    results = {}
    for key, (folder, how) in jobs.items():
        try:
            if how == "child_peft":
                model = AutoPeftModelForCausalLM.from_pretrained(folder)
            else:
                model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=how == "child_remote")
            with torch.no_grad():
                results[key] = model.eval()(input_ids=data["ids"], attention_mask=data["mask"]).logits
        except Exception as e:
            results[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    torch.save(results, sys.argv[3])
    '''
)


def _logits(model):
    ids, mask = batch("llama", n=12, b=2)
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits


def _converted(name, base_dir):
    model = hf_rfa.convert(AutoModelForCausalLM.from_pretrained(base_dir), hf_rfa.RFAConfig(**MODELS[name]))
    if name == "favor_redrawn":
        assert hf_rfa.redraw(model, 3) > 0
    else:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for key, p in model.named_parameters():
                if ".rfa." in key:
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _peft(model, rfa_trained: bool):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", modules_to_save=["rfa"] if rfa_trained else None)
    model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.requires_grad:  # stands in for training: LoRA B (and the rfa copies) move
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _save(how, model, folder):
    """Save ``model`` by ``how`` into ``folder``; returns (folder to load, the logits it must give)."""
    if how == "save_pretrained":
        model.save_pretrained(folder)
    elif how == "export":
        hf_rfa.export(model, folder)
    elif how == "trainer_checkpoint":
        ids, mask = batch("llama", n=12, b=2)
        rows = [{"input_ids": i, "attention_mask": m, "labels": i} for i, m in zip(ids, mask)]
        args = TrainingArguments(output_dir=str(folder), max_steps=1, learning_rate=0.0, save_steps=1, report_to=[], use_cpu=True,
                                 per_device_train_batch_size=2, logging_strategy="no", save_only_model=True, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=rows).train()
        folder = folder / "checkpoint-1"
    else:
        model = _peft(model, rfa_trained=how == "peft_rfa_trained")
        model.save_pretrained(folder)
    return folder, _logits(model)


def _load_here(how, folder):
    from peft import AutoPeftModelForCausalLM

    if how == "hf_rfa":
        return hf_rfa.from_pretrained(str(folder))
    if how == "auto_peft":
        return AutoPeftModelForCausalLM.from_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=how == "auto_remote")


@pytest.fixture(scope="module", params=["favor_redrawn", pytest.param("hedgehog_trained", marks=pytest.mark.slow)])
def matrix(request, tmp_path_factory):
    """One model's matrix (about 40 s; the learned-map model runs with the slow tests)."""
    names = [request.param]
    tmp = tmp_path_factory.mktemp("matrix")
    tiny_model("llama").save_pretrained(tmp / "base")
    softmax = _logits(AutoModelForCausalLM.from_pretrained(tmp / "base"))
    cells, wants, jobs, warned = {}, {}, {}, {}
    for name in names:
        for how in SAVES:
            handler = _Collect()
            logging.getLogger("hf_rfa").addHandler(handler)
            try:
                folder, want = _save(how, _converted(name, tmp / "base"), tmp / f"{name}-{how}")
            finally:
                logging.getLogger("hf_rfa").removeHandler(handler)
            warned[(name, how)] = handler.text
            wants[(name, how)] = want
            for load in LOADS:
                if load.startswith("child_"):
                    jobs[f"{name}|{how}|{load}"] = (str(folder), load)
                    continue
                try:
                    cells[(name, how, load)] = _logits(_load_here(load, folder))
                except Exception as e:  # noqa: BLE001 - a loud failure is an allowed outcome
                    cells[(name, how, load)] = f"{type(e).__name__}: {e}"
    ids, mask = batch("llama", n=12, b=2)
    torch.save({"ids": ids, "mask": mask}, tmp / "inputs.pt")
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    (tmp / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp / "modules"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-I", str(tmp / "child.py"), str(tmp / "jobs.json"), str(tmp / "inputs.pt"), str(tmp / "out.pt")],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key, value in torch.load(tmp / "out.pt").items():
        name, how, load = key.split("|")
        cells[(name, how, load)] = value
    return request.param, cells, wants, softmax, warned


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.text = ""

    def emit(self, record):
        self.text += record.getMessage() + "\n"


@pytest.mark.parametrize("how", SAVES)
@pytest.mark.parametrize("load", LOADS)
def test_cell_gives_the_converted_logits_or_fails_loudly(matrix, how, load):
    name, cells, wants, softmax, warned = matrix
    got, want = cells[(name, how, load)], wants[(name, how)]
    if (how, load) in UNREACHABLE:
        assert "not a converted checkpoint" in warned[(name, how)]  # the saving said so
        return
    if isinstance(got, str):
        assert (how, load) not in MUST_LOAD, f"{how} -> {load} should load: {got}"
        assert got.split(":")[0] not in ("TypeError", "AttributeError", "KeyError", "IndexError"), got  # an explained refusal
        return
    assert (want - softmax).abs().max() > 1e-3  # the converted model really is not softmax
    assert torch.allclose(got, want, atol=1e-5, rtol=0), f"{how} -> {load}: off by {(got - want).abs().max():.3g}"
