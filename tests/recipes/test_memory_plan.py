"""The meta-device memory plan (hf_rfa.recipes.conversion.memory_plan, hf-rfa-convert --dry-run)."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

from hf_rfa.cli import config_from_args, convert_main
from hf_rfa.recipes.conversion import memory_plan, plan_check
from hf_rfa.recipes.conversion.config import ConversionConfig
from tiny_models import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA3_8B = os.path.join(ROOT, "tests", "fixtures", "llama-3-8b", "config.json")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan") / "llama"
    tiny_model("llama").save_pretrained(d)
    return str(d)


def _cfg(model, **kw):
    base = dict(model=model, output="o", calibration_text="c", eval_text="e", rfa=ConversionConfig(model="m").rfa)
    return ConversionConfig(**{**base, **kw})


def test_weights_and_counts_match_the_real_model(tiny_llama):
    """Nothing is loaded, yet the counts equal the real model's (tied weights once) and the
    weights row is parameters × bytes (bf16: half of float32's frozen part)."""
    real = tiny_model("llama")
    n = sum(p.numel() for p in real.parameters())
    p32 = memory_plan.plan(_cfg(tiny_llama), runtime_bytes=0)
    p16 = memory_plan.plan(_cfg(tiny_llama, dtype="bfloat16"), runtime_bytes=0)
    assert p32.counts["frozen"] == n
    maps = p32.counts["feature maps"]
    assert p32.parts["eval"]["weights"] == 4 * n + 4 * maps
    assert p16.parts["eval"]["weights"] == 2 * n + 4 * maps
    assert p32.peak > p16.peak > 0


def test_layerwise_holds_one_layer_of_captures(tiny_llama):
    kw = dict(rfa=ConversionConfig(model="m").rfa.__class__(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    full = memory_plan.plan(_cfg(tiny_llama, **kw), runtime_bytes=0)
    one = memory_plan.plan(_cfg(tiny_llama, transfer_layerwise=True, **kw), runtime_bytes=0)
    layers = 2
    assert full.parts["transfer"]["captures"] == layers * one.parts["transfer"]["captures"] > 0


def test_processes_split_the_batch_and_fsdp_the_weights(tiny_llama):
    one = memory_plan.plan(_cfg(tiny_llama, batch_size=4), processes=1, runtime_bytes=0)
    ddp = memory_plan.plan(_cfg(tiny_llama, batch_size=4), processes=2, runtime_bytes=0)
    fsdp = memory_plan.plan(_cfg(tiny_llama, batch_size=4), processes=2, sharding="fsdp", runtime_bytes=0)
    assert ddp.parts["lora"]["activations"] < one.parts["lora"]["activations"]
    # FSDP: the training stages hold 1/N of the weights, gradients and optimizer state, plus the
    # units gathered at once (the root's own tensors and two decoder layers); evaluation runs on
    # the gathered model (full weights)
    w = one.parts["eval"]["weights"]
    assert ddp.parts["eval"]["weights"] == fsdp.parts["eval"]["weights"] == w
    real = tiny_model("llama")
    layer = sum(p.numel() for p in real.model.layers[0].parameters())
    root = real.num_parameters() - sum(p.numel() for p in real.model.layers.parameters())
    for stage in ("transfer", "lora"):
        assert ddp.parts[stage]["weights"] == w and "gathered units" not in ddp.parts[stage]
        assert fsdp.parts[stage]["weights"] == w // 2
        maps = fsdp.counts["feature maps"] // real.config.num_hidden_layers  # a layer's maps are in its unit
        assert fsdp.parts[stage]["gathered units"] == 4 * (root + 2 * (layer + maps))
        assert fsdp.parts[stage]["optimizer"] == ddp.parts[stage]["optimizer"] // 2
    assert fsdp.sharding == "fsdp" and ddp.sharding == "ddp"


def test_the_plan_follows_an_fsdp_launch(tiny_llama, monkeypatch):
    """Under ``accelerate launch`` with an FSDP config (``ACCELERATE_USE_FSDP``) or with
    ``--fsdp``, several processes plan the FSDP weights; one process has nothing to shard."""
    from hf_rfa.recipes.conversion import distributed

    distributed.use_fsdp(None)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert memory_plan.plan(_cfg(tiny_llama, batch_size=2), processes=2, runtime_bytes=0).sharding == "ddp"
    assert memory_plan.plan(_cfg(tiny_llama, batch_size=2, fsdp=True), processes=2, runtime_bytes=0).sharding == "fsdp"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    p = memory_plan.plan(_cfg(tiny_llama, batch_size=2), processes=2, runtime_bytes=0)
    assert p.sharding == "fsdp" and "(fsdp)" in p.markdown()
    assert memory_plan.plan(_cfg(tiny_llama), processes=1, runtime_bytes=0).sharding == "none"


def test_a_plan_that_does_not_fit_is_refused_with_the_numbers(tiny_llama):
    p = memory_plan.plan(_cfg(tiny_llama), runtime_bytes=0)
    plan_check.check_fits(p, "cpu", available=p.peak)
    with pytest.raises(memory_plan.PlanDoesNotFit) as e:
        plan_check.check_fits(p, "cpu", available=p.peak // 2)
    msg = str(e.value)
    assert "\n" not in msg and "--dtype bfloat16" in msg and "MiB" in msg


def test_dry_run_accepts_a_config_file_and_loads_nothing(capsys):
    """The Llama-3-8B shapes: ~8.0 B parameters, 16 GB of bf16 weights, from config.json alone."""
    out = convert_main(["--model", LLAMA3_8B, "--dry-run", "--dtype", "bfloat16", "--context", "1024", "--device", "cpu"])
    text = capsys.readouterr().out
    assert "| part |" in text and "Peak:" in text
    cfg = json.loads(open(LLAMA3_8B).read())
    assert cfg["hidden_size"] == 4096 and cfg["num_key_value_heads"] == 8
    weights = out["parts"]["eval"]["weights"]
    assert 15.5e9 < weights < 16.3e9  # 8.03 B parameters × 2 bytes (+ the float32 feature maps)


def test_dry_run_flags_need_no_texts():
    cfg = config_from_args(["--model", "m", "--dry-run"])
    assert cfg.dry_run and cfg.model == "m"


@pytest.mark.slow
def test_a_config_folder_works_like_its_file():
    a = memory_plan.plan(_cfg(LLAMA3_8B, dtype="bfloat16", device="cpu"), runtime_bytes=0)
    b = memory_plan.plan(_cfg(os.path.dirname(LLAMA3_8B), dtype="bfloat16", device="cpu"), runtime_bytes=0)
    assert a.parts == b.parts and a.counts["frozen"] == 8_030_261_248


@pytest.mark.parametrize("flags", [dict(), dict(window_only_baseline=True), dict(baselines=True)])
def test_the_baseline_copy_is_planned_exactly_when_the_window_only_baseline_runs(tiny_llama, flags):
    """The window-only baseline merges its LoRA into the model and keeps the LoRA targets' weights
    to put back: planned with ``--window-only-baseline`` and with ``--baselines`` (which includes
    it), not without either, as the bytes of exactly those weights."""
    from transformers import AutoModelForCausalLM

    p = memory_plan.plan(_cfg(tiny_llama, **flags), runtime_bytes=0)
    runs = bool(flags)
    assert ("baseline copy" in p.parts["lora"]) == runs
    if runs:
        from hf_rfa.recipes.conversion.lora import target_weights

        saved = target_weights(AutoModelForCausalLM.from_pretrained(tiny_llama))
        assert p.parts["lora"]["baseline copy"] == sum(t.numel() * t.element_size() for t in saved.values.values())
        assert 0 < p.parts["lora"]["baseline copy"] < p.parts["lora"]["weights"] / 2


def test_a_distilled_lora_plans_the_teachers_hidden_states_and_logits(tiny_llama):
    """``lora_objective="distill"`` holds the teacher's final hidden states for the step and a chunk
    of its logits beside the student's: a "teacher" part of the LoRA stage, larger with the context,
    absent for the next-token objective; the other parts are the same."""
    plain = memory_plan.plan(_cfg(tiny_llama), runtime_bytes=0).parts["lora"]
    distill = memory_plan.plan(_cfg(tiny_llama, lora_objective="distill"), runtime_bytes=0).parts["lora"]
    longer = memory_plan.plan(_cfg(tiny_llama, lora_objective="distill", lora_context=2048), runtime_bytes=0).parts["lora"]
    assert "teacher" not in plain and distill["teacher"] > 0 and longer["teacher"] > distill["teacher"]
    assert {k: v for k, v in distill.items() if k != "teacher"} == plain
    with pytest.raises(ValueError, match=r"lora_objective must be one of \['next_token', 'distill'\], got 'kl'"):
        _cfg(tiny_llama, lora_objective="kl")

def test_autocast_training_of_float32_weights_plans_the_low_precision_weight_copy(tiny_llama):
    """Under bf16 autocast, float32 weights' matmuls keep a bf16 copy of each weight for the backward
    (a --quick SmolLM2 run on a CPU with bf16 units peaked 0.65 GiB above a plan without it): the LoRA
    stage counts it, and activations at 4 bytes; float32 training and bf16 weights have no such copy."""
    frozen = memory_plan.plan(_cfg(tiny_llama), runtime_bytes=0).counts["frozen"]
    auto = memory_plan.plan(_cfg(tiny_llama, train_autocast="bf16"), runtime_bytes=0)
    off = memory_plan.plan(_cfg(tiny_llama, train_autocast="off"), runtime_bytes=0)
    bf16 = memory_plan.plan(_cfg(tiny_llama, dtype="bfloat16", train_autocast="bf16"), runtime_bytes=0)
    assert auto.parts["lora"]["autocast copy"] == 2 * frozen
    assert "autocast copy" not in off.parts["lora"] and "autocast copy" not in bf16.parts["lora"]
    assert auto.parts["lora"]["activations"] < off.parts["lora"]["activations"]  # the matmuls' outputs saved in bf16
    from hf_rfa.recipes.conversion import devices

    if devices.training_autocast("bf16", torch.device("cpu"), torch.bfloat16) is not None:  # bf16 matrix units: bf16 compute
        assert bf16.parts["lora"]["activations"] < off.parts["lora"]["activations"]
    else:  # bf16 storage, float32 compute: float32 activations
        assert bf16.parts["lora"]["activations"] == off.parts["lora"]["activations"]


def _saved_in_decoder_layers(model_dir: str, cfg, n: int, autocast: bool) -> int:
    """Unique bytes the decoder layers of ``model_dir`` (converted with ``cfg.rfa``, LoRA attached
    as the LoRA stage does) save for the backward of one causal-LM loss at ``n`` tokens, counted by
    saved-tensor hooks (storages, each once; the parameters themselves excluded)."""
    import contextlib

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_rfa
    from hf_rfa.recipes.conversion import lora
    from hf_rfa.recipes.conversion.calibration import attn_implementation
    from hf_rfa.recipes.conversion.lm_loss import causal_lm_loss
    from hf_rfa.recipes.training.peft_utils import lora_config

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_rfa.convert(model, cfg.rfa_config())
    lora.register_train()
    peft = get_peft_model(model, lora_config(model, r=cfg.lora_r))
    peft.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    from hf_rfa.recipes.conversion.fsdp import decoder_layers

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *a: inside.__setitem__(0, False))
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with attn_implementation(model, lora.TRAIN_NAME), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        causal_lm_loss(model, ids, None, ids)
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_lora_layer_activations_are_what_the_decoder_layers_save(tmp_path, family, autocast):
    """The plan's LoRA activations per decoder layer (memory_plan._lora_layer) against the bytes the
    converted layers really save for the backward (saved-tensor hooks): the reference twin of the
    formula, on Llama-family layers (counting every tensor at 4 bytes and the op's features would
    give 1.9-2.7× the measured bytes). GPT-2's composite GELU saves about a quarter more than
    counted, and is left out."""
    from hf_rfa.recipes.conversion.calibration import rfa_layers
    from hf_rfa.recipes.conversion.memory_plan import _dims, _lora_layer, load_config

    model_dir = str(tmp_path / family)
    tiny_model(family).save_pretrained(model_dir)
    cfg = _cfg(model_dir, rfa=_recall_rfa())
    n = 512
    config = load_config(model_dir)
    g = _dims(config)
    feat = next(iter(rfa_layers(memory_plan.meta_model(config, cfg)[0]).values())).feature_map.feature_dim
    planned = g["L"] * _lora_layer(cfg, g, 1, n, 2 if autocast else 4, feat)
    measured = _saved_in_decoder_layers(model_dir, cfg, n, autocast)
    assert 0.85 * measured <= planned <= 1.15 * measured, (planned, measured)


def _recall_rfa():
    """The recall preset's attention settings (the main job's), memory off (a decode-time choice)."""
    from hf_rfa.presets import PRESETS

    return PRESETS["recall"].config(memory_score="value_norm")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux: the resident memory is read from /proc")
def test_measure_peak_rss_sees_an_allocation_inside_and_not_before():
    import gc

    from hf_rfa.recipes.conversion.host_memory import rss_now
    from hf_rfa.recipes.conversion.memory_plan import measure_peak_rss

    gc.collect()  # earlier tests' garbage, freed now rather than between the two blocks
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, freed before the measured block
    del big
    with measure_peak_rss() as quiet:
        pass
    with measure_peak_rss() as busy:
        before = rss_now()
        x = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched, held much longer than the sampling interval
        time.sleep(1.0)  # long enough for the sampling thread to get a CPU on a busy machine
        del x
    assert quiet[0] is not None and busy[0] is not None
    assert quiet[0] < before + 32 * 2**20  # the 64 MiB freed before the block are not seen
    assert busy[0] - before > 200 * 2**20  # the sampled peak holds the allocation, freed before the block ended



def _glibc():
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


@pytest.mark.skipif(_glibc() is None or not os.path.exists("/proc/self/statm"), reason="glibc on Linux: malloc_trim and /proc")
def test_free_heap_memory_leaves_the_resident_set_only_when_released():
    """Freed C heap memory below a live block stays resident (what inflated a bf16 conversion's
    RSS by 0.3-0.5 GiB between stages) until host_memory.release_free_memory gives it back."""
    import ctypes

    from hf_rfa.recipes.conversion.host_memory import release_free_memory, rss_now

    libc = _glibc()
    blocks = [libc.malloc(4096) for _ in range(40_000)]  # 160 MiB of heap (below the mmap threshold)
    for b in blocks:
        ctypes.memset(b, 1, 4096)  # touched: resident
    pin = libc.malloc(4096)  # a live block above them: the heap's top cannot shrink by itself
    held = rss_now()
    for b in blocks:
        libc.free(b)
    freed = rss_now()
    assert release_free_memory() is True
    released = rss_now()
    libc.free(pin)
    assert held - freed < 40 * 2**20, (held, freed)  # free() alone keeps (almost) all of it resident
    assert freed - released > 120 * 2**20, (freed, released)


def test_the_llama_3_8b_tables_of_the_gpu_page_are_the_current_plan():
    """docs/gpus.md's --dry-run tables for Llama-3-8B shapes (CUDA: no machine-dependent part) are
    what scripts/render_dry_run_docs.py writes from the plan today."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("render_dry_run_docs", os.path.join(root, "scripts", "render_dry_run_docs.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    blocks = [m.group(0) for m in mod.BLOCK.finditer(mod.PAGE.read_text())]
    assert len(blocks) == len(mod.TABLES)
    for block, (flags, env, name) in zip(blocks, mod.TABLES):
        if "cuda" in flags:
            assert block == mod.plan_markdown(flags, env, name), name


def test_casting_a_checkpoint_on_the_cpu_plans_what_is_read_at_once(tiny_llama, tmp_path):
    """Loading a float32 checkpoint as bf16 on the CPU: from a local safetensors folder the tensors
    are read and cast a few at a time (:func:`.loading.read_state_dict`), so the load stage holds
    the largest few in float32 next to the cast weights; from a checkpoint whose files are not a
    local safetensors folder, the whole file, mapped. Loaded in its own dtype, or onto a GPU (the
    plan counts device memory), there is no such stage."""
    from safetensors import safe_open
    from transformers.core_model_loading import GLOBAL_WORKERS

    bf16 = memory_plan.plan(_cfg(tiny_llama, dtype="bfloat16"), runtime_bytes=0)
    with safe_open(os.path.join(tiny_llama, "model.safetensors"), framework="pt") as h:
        sizes = sorted((math.prod(h.get_slice(k).get_shape()) for k in h.keys()), reverse=True)
    assert bf16.parts["load"]["checkpoint (read)"] == 4 * sum(sizes[:GLOBAL_WORKERS])
    assert bf16.parts["load"]["weights"] == bf16.parts["eval"]["weights"]
    assert "load" not in memory_plan.plan(_cfg(tiny_llama), runtime_bytes=0).parts
    assert "load" not in memory_plan.plan(_cfg(tiny_llama, dtype="bfloat16", device="cuda", dry_run=True), runtime_bytes=0).parts
    assert list(bf16.parts)[0] == "load" and "| part | load |" in bf16.markdown()
    config_only = tmp_path / "config.json"  # (a plan from a config alone: its checkpoint is mapped when loaded)
    config_only.write_text(open(os.path.join(tiny_llama, "config.json")).read())
    mapped = memory_plan.plan(_cfg(str(config_only), dtype="bfloat16"), runtime_bytes=0)
    assert mapped.parts["load"]["checkpoint (mapped)"] == 4 * mapped.counts["frozen"]

_TOKENIZER = """
import sys
from hf_rfa.recipes.conversion import plan_inputs
print(plan_inputs.tokenizer_bytes(sys.argv[1]), plan_inputs.tokenizer_bytes(sys.argv[2]))
"""


@pytest.mark.slow
def test_a_cpu_plan_counts_the_tokenizer_it_can_load_without_a_download(tiny_llama):
    """Loading SmolLM2's tokenizer (49k vocabulary, its merges, the modules it imports) adds tens of
    MiB to a process (measured in a fresh one: about 0.1 GiB); a folder without tokenizer files
    counts nothing. A dry run's CPU plan whose runtime it measures itself has the part; one given
    the runtime does not, unless given the tokenizer's too, nor does a run's own check."""
    import subprocess
    import sys

    from hf_rfa.assets import smollm2_path

    out = subprocess.run([sys.executable, "-c", _TOKENIZER, str(smollm2_path()), tiny_llama], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    real, none = map(int, out.stdout.split()[-2:])
    assert 20 * 2**20 < real < 200 * 2**20 and none == 0
    assert "tokenizer" in memory_plan.plan(_cfg(tiny_llama, dry_run=True)).parts["eval"]
    assert "tokenizer" not in memory_plan.plan(_cfg(tiny_llama, dry_run=True), runtime_bytes=0).parts["eval"]
    assert "tokenizer" not in memory_plan.plan(_cfg(tiny_llama)).parts["eval"]  # (a run's own check)
    assert memory_plan.plan(_cfg(tiny_llama), runtime_bytes=0, tokenizer=7).parts["eval"]["tokenizer"] == 7
