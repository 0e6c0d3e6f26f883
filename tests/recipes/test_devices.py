"""Device and precision of the conversion (hf_rfa.recipes.conversion.devices, loading, stages).

On the CPU: the checks of every option, float32 CPU defaults, bfloat16 frozen weights with float32
feature maps / LoRA, a tiny end-to-end run in bfloat16. ``cuda``-marked tests run the same on a GPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_rfa
from hf_rfa.cli import config_from_args
from hf_rfa.recipes.conversion import devices, pipeline, transfer
from hf_rfa.recipes.conversion.config import ConversionConfig
from hf_rfa.recipes.conversion.loading import load_model
from conversion_runs import word_text, word_tokenizer
from tiny_models import VOCAB, tiny_model

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dev")
    tiny_model("llama").save_pretrained(root / "llama")
    word_tokenizer().save_pretrained(root / "llama")
    (root / "cal.txt").write_text(word_text(2000, 0))
    (root / "eval.txt").write_text(word_text(2000, 1))
    return {"llama": str(root / "llama"), "cal": str(root / "cal.txt"), "eval": str(root / "eval.txt")}


def _args(tiny, out, *extra):
    return ["--model", tiny["llama"], "--output", str(out), "--preset", "favor+", "--feature-map", "hedgehog", "--num-features", "8", "--window", "4",
            "--sinks", "1", "--decay", "16", "--transfer-tokens", "128", "--lora-tokens", "64", "--context", "32", "--eval-contexts", "32",
            "--eval-tokens", "128", "--error-tokens", "32", "--generate-tokens", "4",
            "--no-progress", "--calibration-text", tiny["cal"], "--eval-text", tiny["eval"], *extra]


# --------------------------------------------------------------------------- option checks
@pytest.mark.parametrize(
    "field,value,allowed",
    [("dtype", "fp8", "bfloat16"), ("device_map", "balanced", "auto"), ("teacher_attn_implementation", "flex", "sdpa"), ("device", "tpu", "cuda")],
)
def test_bad_values_name_the_value_and_the_allowed_ones(field, value, allowed):
    with pytest.raises(ValueError) as e:
        ConversionConfig(model="m", **{field: value})
    msg = str(e.value)
    assert "\n" not in msg and repr(value) in msg and allowed in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        ConversionConfig(model="m", device="cuda")
    assert devices.check_device(None) == torch.device("cpu")


def test_flash_attention_needs_its_package():
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed")
    with pytest.raises(ValueError, match="flash_attn"):
        ConversionConfig(model="m", teacher_attn_implementation="flash_attention_2")


def test_flags_reach_the_config():
    cfg = config_from_args(["--model", "m", "--output", "o", "--calibration-text", "c", "--eval-text", "e", "--dtype", "bfloat16",
                            "--device", "cpu", "--teacher-attn-implementation", "eager", "--transfer-layerwise"])
    assert (cfg.dtype, cfg.device, cfg.teacher_attn_implementation, cfg.transfer_layerwise, cfg.device_map) == ("bfloat16", "cpu", "eager", True, None)
    assert cfg.torch_dtype is torch.bfloat16
    default = config_from_args(["--model", "m", "--output", "o", "--calibration-text", "c", "--eval-text", "e"])
    assert (default.dtype, default.device, default.device_map, default.teacher_attn_implementation) == ("float32", None, None, "sdpa")


# --------------------------------------------------------------------------- loading and mixed precision
def test_cpu_defaults_load_float32_sdpa(tiny):
    model, _, kind = load_model(tiny["llama"])
    assert kind == "causal-lm" and {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.config._attn_implementation == "sdpa"
    eager, _, _ = load_model(tiny["llama"], attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"


def test_loads_ask_for_no_hub_kernels(tiny, monkeypatch):
    """transformers swaps modules for Hub kernels on a GPU by default where `kernels` is installed
    (offline that fails before the model loads, seen on an H200): every load of the conversion
    asks for none, and the model keeps its stock modules."""
    import transformers

    seen = []
    original = transformers.PreTrainedModel.from_pretrained.__func__
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(lambda cls, *a, **kw: seen.append(kw) or original(cls, *a, **kw)))
    model, _, _ = load_model(tiny["llama"])
    assert seen and all(kw.get("use_kernels") is False for kw in seen)
    assert not model.use_kernels


def test_bfloat16_weights_float32_trainables(tiny):
    model, _, _ = load_model(tiny["llama"], torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1, decay=16))
    devices.keep_trainable_float32(model)
    rfa = transfer.rfa_parameters(model)
    assert rfa and {p.dtype for p in rfa} == {torch.float32}
    assert devices.weight_dtype(model) is torch.bfloat16
    fast = not devices.needs_float32_compute(torch.device("cpu"), torch.bfloat16)
    assert devices.training_autocast("off", torch.device("cpu"), torch.bfloat16) is (torch.bfloat16 if fast else None)
    assert devices.training_autocast("off", torch.device("cpu"), torch.float32) is None
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    stream = iter([(ids, None)] * 4)
    res = transfer.attention_transfer(model, stream, 80, progress=False, autocast=devices.training_autocast("auto", torch.device("cpu"), torch.bfloat16))
    assert res.steps == 1 and res.autocast == ("bf16" if fast else None) and {p.dtype for p in rfa} == {torch.float32}
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in rfa)


@pytest.mark.slow
def test_bfloat16_conversion_end_to_end(tiny, tmp_path):
    """--dtype bfloat16: the stages train under bf16 autocast, the LoRA merge and the export work,
    and the perplexity after training is finite and close to the float32 run's."""
    r16 = pipeline.run(config_from_args(_args(tiny, tmp_path / "bf16", "--dtype", "bfloat16")))
    r32 = pipeline.run(config_from_args(_args(tiny, tmp_path / "fp32")))
    fast = not devices.needs_float32_compute(torch.device("cpu"), torch.bfloat16)
    assert r16["stages"]["transfer"].get("autocast") == ("bf16" if fast else None)  # else bf16 storage, float32 matmuls
    auto32 = devices.training_autocast("auto", torch.device("cpu"), torch.float32)  # float32 on an AVX2-only CPU, bf16 where it is fast
    assert r32["stages"]["transfer"].get("autocast") == ("bf16" if auto32 is not None else None)
    p16 = {r["variant"]: r["perplexity"] for r in r16["rows"]}
    p32 = {r["variant"]: r["perplexity"] for r in r32["rows"]}
    assert p16.keys() == p32.keys()
    for k in p32:
        assert abs(p16[k] / p32[k] - 1) < 0.05, (k, p16[k], p32[k])
    rep = json.loads((tmp_path / "bf16" / "report.json").read_text())
    assert rep["config"]["dtype"] == "bfloat16"
    model, _, _ = load_model(str(tmp_path / "bf16"))
    assert hf_rfa.rfa_config_of(model).window == 4


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_cuda_conversion_bfloat16(tiny, tmp_path):
    """The same tiny conversion on a CUDA device with bf16 weights: every stage runs on the GPU."""
    report = pipeline.run(config_from_args(_args(tiny, tmp_path / "gpu", "--device", "cuda", "--dtype", "bfloat16")))
    assert report["stages"]["transfer"]["autocast"] == "bf16" and report["stages"]["lora"]["tokens"] >= 64
    assert all(r["perplexity"] == r["perplexity"] and r["perplexity"] < 1e4 for r in report["rows"])


@pytest.mark.cuda
def test_cuda_load_places_every_weight(tiny):
    model, _, _ = load_model(tiny["llama"], torch.bfloat16, "cuda")
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    assert {p.device.type for p in transfer.rfa_parameters(model)} == {"cuda"}
    ids = torch.randint(3, VOCAB, (1, 40))
    res = transfer.attention_transfer(model, iter([(ids, None)]), 40, progress=False, autocast=torch.bfloat16)
    assert res.steps == 1


def test_float32_compute_linear_matches_upcast_and_keeps_bf16_storage():
    """bf16 storage with float32 matmuls: forward and input gradient equal F.linear on the
    float32 upcast; the weight stays bf16 and gets no gradient."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8).to(torch.bfloat16).requires_grad_(False)
    ref_w, ref_b = lin.weight.float(), lin.bias.float()
    assert devices.float32_compute(torch.nn.Sequential(lin)) == 1 and isinstance(lin, devices.Float32ComputeLinear)
    x = torch.randn(3, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y = lin(x)
    assert y.dtype == torch.float32 and lin.weight.dtype == torch.bfloat16
    torch.testing.assert_close(y, torch.nn.functional.linear(x, ref_w, ref_b), rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.nn.functional.linear(x2, ref_w, ref_b).backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    assert lin.weight.grad is None
    lin.weight.requires_grad_(True)  # a trainable weight gets its gradient through the upcast
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, ref_w, ref_b), rtol=0, atol=0)


def test_device_map_auto_loads_and_trains(tiny):
    """--device-map auto (on a machine without GPUs every layer lands on the CPU): the model loads
    through Accelerate's placement, converts and trains its maps."""
    model, _, _ = load_model(tiny["llama"], torch.float32, device_map="auto")
    ref, _, _ = load_model(tiny["llama"])
    ids = torch.randint(3, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1))
    res = transfer.attention_transfer(model, iter([(ids, None)]), 24, progress=False)
    assert res.steps == 1 and res.losses[0] > 0


# --------------------------------------------------------------------------- casting while loading
def test_a_cast_load_reads_tensor_by_tensor_and_equals_transformers_own(tiny, monkeypatch):
    """bf16 from a float32 folder: the weights come from ``read_state_dict`` (read, not mapped) and
    are bit for bit transformers' own bf16 load, with the same config, generation config and name;
    loaded in the stored dtype nothing is cast and the mapped file is used as before."""
    import transformers

    from hf_rfa.recipes.conversion import loading

    used = []
    real = loading.read_state_dict
    monkeypatch.setattr(loading, "read_state_dict", lambda files, dtype: used.append(real(files, dtype)) or used[-1])
    ours, _, _ = load_model(tiny["llama"], torch.bfloat16)
    assert used and used[-1] is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.bfloat16, use_kernels=False)
    a, b = ours.state_dict(), ref.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours.config.to_dict() == ref.config.to_dict() and ours.name_or_path == ref.name_or_path == tiny["llama"]
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    tied = lambda m: m.get_output_embeddings().weight is m.get_input_embeddings().weight  # noqa: E731
    assert tied(ours) == tied(ref)
    used.clear()
    load_model(tiny["llama"])
    assert used == [None]


def _hub_cache(root, repo: str, folder: str):
    """A Hugging Face cache holding ``folder`` as the snapshot of Hub model ``repo`` at ``main``."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    shutil.copytree(folder, base / "snapshots" / commit)
    return base / "snapshots" / commit


_HUB_LOAD = """
import json, sys, torch
from hf_rfa.recipes.conversion import loading, plan_inputs
read = []
real = loading.read_state_dict
loading.read_state_dict = lambda files, dtype: read.append(files) or real(files, dtype)
model, _, _ = loading.load_model(sys.argv[1], torch.bfloat16)
torch.save(model.state_dict(), sys.argv[2])
print(json.dumps({"read": read, "name": model.name_or_path, "generation": model.generation_config.to_dict(),
                  "sizes": plan_inputs.tensor_sizes(sys.argv[1]), "missing": loading.checkpoint_files("org/not-cached", fetch=True),
                  "missing_sizes": plan_inputs.tensor_sizes("org/not-cached"), "sharded": loading.checkpoint_files("org/tiny-sharded")}))
"""


def test_a_cast_load_of_a_hub_id_reads_its_cached_snapshot(tiny, tmp_path):
    """A Hub id loaded as bf16 from its float32 files in the Hugging Face cache (offline): read
    tensor by tensor from the snapshot's files, bit for bit transformers' own bf16 load, keeping the
    Hub id as its name; the plan takes the tensor sizes from the same headers; a sharded snapshot
    gives the shards its index names. An id neither cached
    nor reachable has no files to read (transformers' own load and the mapped plan stand)."""
    import subprocess
    import sys

    import transformers
    from safetensors import safe_open

    snapshot = _hub_cache(tmp_path / "hub", "org/tiny-llama", tiny["llama"])
    tiny_model("llama").save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    sharded = _hub_cache(tmp_path / "hub", "org/tiny-sharded", tmp_path / "sharded")
    shards = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _HUB_LOAD, "org/tiny-llama", str(tmp_path / "sd.pt")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["read"] == [[str(snapshot / "model.safetensors")]] and got["name"] == "org/tiny-llama"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.bfloat16, use_kernels=False)
    ours, theirs = torch.load(tmp_path / "sd.pt"), ref.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert got["generation"] == ref.generation_config.to_dict()
    with safe_open(str(snapshot / "model.safetensors"), framework="pt") as h:
        sizes = sorted(int(torch.Size(h.get_slice(k).get_shape()).numel()) for k in h.keys())
    assert sorted(got["sizes"]) == sizes
    assert got["missing"] == [] and got["missing_sizes"] == []
    assert len(shards) > 1 and got["sharded"] == [str(sharded / name) for name in shards]


_PEAK = """
import sys, torch
from hf_rfa.recipes.conversion import loading
if sys.argv[2] == "mapped":
    loading.read_state_dict = lambda files, dtype: None
model, _, _ = loading.load_model(sys.argv[1], torch.bfloat16)
assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak from /proc")
def test_a_cast_load_does_not_hold_the_float32_file(tmp_path):
    """A 151 MB float32 checkpoint loaded as bf16: read tensor by tensor, the process peaks lower by
    at least half the file than with the file mapped while it is cast (each in a fresh process;
    measured: 115 MiB lower, the file is 147 MiB)."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1000, hidden_size=768, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=12,
                      num_key_value_heads=12, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    word_tokenizer().save_pretrained(tmp_path / "m")
    peaks = {}
    for how in ("mapped", "read"):
        out = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "m"), how], capture_output=True, text=True, check=True)
        peaks[how] = int(out.stdout.strip().splitlines()[-1])
    file_kib = os.path.getsize(tmp_path / "m" / "model.safetensors") // 1024
    assert peaks["read"] < peaks["mapped"] - file_kib // 2, (peaks, file_kib)
