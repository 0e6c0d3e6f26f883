"""Two processes over gloo (``accelerate launch``) convert what one process converts with the same
global batch (hf_rfa.recipes.conversion.distributed)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from hf_rfa.recipes.conversion import distributed
from conversion_runs import word_text, word_tokenizer  # the tiny word-level tokenizer and text
from tiny_models import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_one_process_is_a_no_op():
    ids = torch.arange(12).view(3, 4)
    assert distributed.processes().world == 1 and distributed.processes().is_main
    assert distributed.shard(ids, None)[0] is ids and distributed.global_tokens(7) == 7
    assert list(distributed.window_indices(3)) == [0, 1, 2]
    assert distributed.gather_window_sums({0: (1.0, 2), 1: (3.0, 4)}, 2) == [(1.0, 2), (3.0, 4)]
    distributed.check_batch(3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _convert(args: list[str], processes: int, fsdp: bool = False) -> subprocess.CompletedProcess:
    """``conversion/convert.py`` in one process, or under ``accelerate launch`` on 2 CPU processes
    over gloo (``fsdp``: launched as an FSDP run with the shipped FSDP configs' settings,
    ``--use_fsdp --fsdp_version 2 --fsdp_cpu_ram_efficient_loading true``, which set
    ``ACCELERATE_USE_FSDP`` as ``training/configs/fsdp_*.yaml`` do: every process still loads the
    whole checkpoint itself)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("ACCELERATE_USE_FSDP", None)
    script = os.path.join(ROOT, "conversion", "convert.py")
    if processes == 1:
        cmd = [sys.executable, script, *args]
    else:
        env["ACCELERATE_USE_CPU"] = "1"
        mode = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_cpu_ram_efficient_loading", "true"] if fsdp else ["--multi_gpu"]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *mode, "--num_processes", str(processes), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), script, *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _tiny_llama(tmp_path) -> str:
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    word_tokenizer().save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


def _one_two_fsdp(tmp_path, flags: list[str], fsdp_only: list[str] = ()) -> tuple[dict, dict, dict]:
    """The reports of one conversion of a tiny Llama (hedgehog, window 4 + 1 sink, LoRA 256 tokens,
    global batch 2, float32 training, ``flags`` on top) run in one process, in two, and in two under
    FSDP (with ``fsdp_only`` too), written under ``tmp_path`` / one, two, fsdp."""
    (tmp_path / "cal.txt").write_text(word_text(2000, 0))
    (tmp_path / "eval.txt").write_text(word_text(2000, 1))
    args = ["--model", _tiny_llama(tmp_path), "--preset", "favor+", "--feature-map", "hedgehog", "--num-features", "8", "--window", "4", "--sinks", "1",
            "--lora-tokens", "256", "--batch-size", "2", "--context", "32", "--eval-contexts", "32", "--error-tokens", "32", "--train-autocast", "off",
            "--generate-tokens", "0", "--no-progress", "--calibration-text", str(tmp_path / "cal.txt"), "--eval-text", str(tmp_path / "eval.txt"), *flags]
    _convert([*args, "--output", str(tmp_path / "one")], 1)
    _convert([*args, "--output", str(tmp_path / "two")], 2)
    _convert([*args, "--output", str(tmp_path / "fsdp"), *fsdp_only], 2, fsdp=True)
    return tuple(json.loads((tmp_path / d / "report.json").read_text()) for d in ("one", "two", "fsdp"))


@pytest.mark.slow
def test_two_processes_with_and_without_fsdp_equal_one(tmp_path):
    """Tiny Llama, hedgehog + decay, attention transfer then LoRA, global batch 2, float32 training
    (``--train-autocast off``: on a CPU with bf16 matrix hardware ``auto`` trains under bf16
    autocast, where splitting a batch changes the rounding): one process, two processes (rows split,
    gradients all-reduced) and two processes under FSDP (the training stages sharded, gradients
    reduce-scattered) give feature-map, decay and (merged) LoRA weights within 1e-5, evaluation figures
    equal where the weights are the same and within 1e-6 relative after training; under FSDP each process stored half of the parameters while it trained.
    The FSDP run also takes --activation-checkpointing, and its LoRA loss is the chunked one."""
    from safetensors.torch import load_file

    one, two, fsdp = _one_two_fsdp(tmp_path, ["--decay", "16", "--transfer-tokens", "256", "--eval-tokens", "512"], fsdp_only=["--activation-checkpointing"])
    assert two["processes"] == fsdp["processes"] == 2 and "processes" not in one
    assert fsdp["fsdp"] is True and "fsdp" not in two
    # every run's LoRA loss is the chunked one (lm_loss; under FSDP a forward method of the root unit);
    # the FSDP run also recomputes its decoder layers (activation checkpointing): the same training
    assert one["stages"]["lora"]["chunked_loss"] and two["stages"]["lora"]["chunked_loss"] and fsdp["stages"]["lora"]["chunked_loss"]
    assert fsdp["stages"]["lora"]["activation_checkpointing"] and "activation_checkpointing" not in one["stages"]["lora"]
    w1 = load_file(tmp_path / "one" / "model.safetensors")
    assert any(".rfa." in k for k in w1)
    trained = [k for k in w1 if ".rfa." in k or "self_attn" in k]
    for name, other in (("two", two), ("fsdp", fsdp)):
        for a, b in zip(one["rows"], other["rows"], strict=True):
            assert a["variant"] == b["variant"] and a["eval_tokens"] == b["eval_tokens"] and a["window_tokens"] == b["window_tokens"], name
            if a["variant"].startswith("original") or "untrained" in a["variant"]:
                # the same weights in every run: the sharded evaluation, gathered in window order, is exact
                assert (a["perplexity"], a["window_nll"], a["perplexity_ci95"]) == (b["perplexity"], b["window_nll"], b["perplexity_ci95"]), name
            else:
                # trained weights agree within 1e-5, not bit for bit (a two-row batch's gradient and the average
                # of two one-row gradients add in another order): figures within 1e-6 relative
                assert b["perplexity"] == pytest.approx(a["perplexity"], rel=1e-6, abs=0), name
                assert b["window_nll"] == pytest.approx(a["window_nll"], rel=1e-6, abs=0), name
        for stage in ("transfer", "lora"):
            assert (one["stages"][stage]["tokens"], one["stages"][stage]["steps"]) == (other["stages"][stage]["tokens"], other["stages"][stage]["steps"])
        w = load_file(tmp_path / name / "model.safetensors")
        assert w.keys() == w1.keys()  # the same format: full tensors, written once
        for k in w1:
            torch.testing.assert_close(w[k], w1[k], rtol=0, atol=1e-5 if k in trained else 0, msg=f"{name}: {k}")
    for stage in ("transfer", "lora"):
        s = fsdp["stages"][stage]["fsdp"]
        assert s["processes"] == 2 and abs(s["local_parameters"] - s["parameters"] / 2) <= 0.05 * s["parameters"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # written once, by the main process


@pytest.mark.slow
def test_distillation_lora_on_two_processes_with_and_without_fsdp_equals_one(tmp_path):
    """``--lora-objective distill`` (the teacher: the same weights with the adapters off, exact
    softmax, one more forward per step): one process, two (DDP) and two under FSDP (the teacher's
    forward and the student's loss in one forward method of the sharded root) merge the same LoRA
    weights within 1e-5 and give the same perplexity within 1e-6 relative; the stage records it."""
    from safetensors.torch import load_file

    one, two, fsdp = _one_two_fsdp(tmp_path, ["--transfer-tokens", "0", "--lora-objective", "distill", "--eval-tokens", "256"])
    assert fsdp["fsdp"] is True and one["stages"]["lora"]["objective"] == two["stages"]["lora"]["objective"] == fsdp["stages"]["lora"]["objective"] == "distill"
    assert one["stages"]["lora"]["loss_first"] > 0 and one["stages"]["lora"]["steps"] == 4
    w1 = load_file(tmp_path / "one" / "model.safetensors")
    for name, other in (("two", two), ("fsdp", fsdp)):
        assert other["stages"]["lora"]["loss_first"] > 0, name  # (each process records the loss of its own rows)
        for a, b in zip(one["rows"], other["rows"], strict=True):
            assert b["perplexity"] == pytest.approx(a["perplexity"], rel=1e-6, abs=0), (name, a["variant"])
        w = load_file(tmp_path / name / "model.safetensors")
        for k in w1:
            torch.testing.assert_close(w[k], w1[k], rtol=0, atol=1e-5, msg=f"{name}: {k}")


_WORKER = """
import json, os, sys
import torch
sys.path.insert(0, {tests!r})
import hf_rfa
from hf_rfa.recipes.conversion import calibration, distributed, fsdp
from tiny_models import tiny_model

m = tiny_model("llama")
hf_rfa.convert(m, hf_rfa.RFAConfig(feature_map="hedgehog", num_features=8, window=4, sinks=1, decay=16.0, seed=0))
before = {{k: v.clone() for k, v in m.state_dict().items()}}
ids = (torch.arange(32).view(1, 32) * 7) % 60 + 2
ref = calibration.capture(m, ids)
p = distributed.processes()
with fsdp.sharded(m) as work:
    s = fsdp.storage(work)
    units = sum(fsdp.is_sharded(x) for x in work.modules())
    plain = sum(q.numel() for q in m.parameters())
    caps = calibration.capture(work, ids)
    cap_diff = max((getattr(caps[i], t) - getattr(ref[i], t)).abs().max().item() for i in ref for t in ("q", "k", "v", "out"))
back = max((v - before[k]).abs().max().item() for k, v in m.state_dict().items())
out = dict(s, units=units, plain=plain, cap_diff=cap_diff, layers=sorted(caps), back=back)
open(os.path.join({out!r}, "rank%d.json" % p.rank), "w").write(json.dumps(out))
"""


@pytest.mark.slow
def test_fsdp_shards_the_weights_and_the_teacher_captures_still_work(tmp_path):
    """Two CPU processes over gloo: inside :func:`fsdp.sharded` each process stores about half of
    the parameters (its shards; the plain model's tensors are released), the copy has one FSDP unit
    per decoder layer plus the root, the teacher capture of the sharded copy equals the plain
    model's, and on exit the plain model has its full weights back."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER.format(tests=os.path.join(ROOT, "tests"), out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()), str(script)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    total = tiny_model("llama").num_parameters()
    for s in ranks:
        assert s["processes"] == 2 and s["parameters"] > total  # the converted layers' maps on top
        assert abs(s["local_parameters"] - s["parameters"] / 2) <= 0.05 * s["parameters"]
        assert s["plain"] == 0  # the plain model's tensors were released while the copy was sharded
        assert s["units"] == 2 + 1  # two decoder layers and the root
        assert s["layers"] == [0, 1] and s["cap_diff"] == 0.0
        assert s["back"] == 0.0
    assert ranks[0]["local_parameters"] + ranks[1]["local_parameters"] == ranks[0]["parameters"]


def test_fsdp_follows_the_launcher_and_the_flag(monkeypatch):
    """FSDP is asked for by ``accelerate launch`` with an FSDP config (``ACCELERATE_USE_FSDP``) or
    by ``--fsdp``; it is active only with several processes; it cannot combine with a device map."""
    from hf_rfa.recipes.conversion.config import ConversionConfig

    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    try:
        distributed.use_fsdp(None)
        assert not distributed.fsdp_requested()
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        assert distributed.fsdp_requested() and not distributed.fsdp_active()  # one process: nothing to shard over
        monkeypatch.delenv("ACCELERATE_USE_FSDP")
        distributed.use_fsdp(True)
        assert distributed.fsdp_requested()
    finally:
        distributed.use_fsdp(None)
    from hf_rfa.cli import config_from_args

    base = ["--model", "m", "--output", "o", "--calibration-text", "c", "--eval-text", "e"]
    assert config_from_args([*base, "--fsdp"]).fsdp is True and config_from_args(base).fsdp is False
    with pytest.raises(ValueError, match="device_map"):
        ConversionConfig(model="m", fsdp=True, device_map="auto")


def _limit_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo processes: rank 0 is over a 0-second limit at once, rank 1 has no limit."""
    import torch.distributed as dist

    from hf_rfa.recipes.conversion.budget import BudgetNotReached, TransferResult, check_limit

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    distributed._STATE[:] = [distributed.Processes(rank, 2)]
    res, msg = TransferResult(tokens=4, steps=1), "no stop"
    try:
        for _ in range(3):  # a training loop: a gradient all-reduce, then the limit check, each step
            distributed.all_reduce_grads([torch.nn.Parameter(torch.ones(2))])
            check_limit("lora", res, 100, 0.0 if rank == 0 else float("inf"), 0.0 if rank == 0 else None)
            res.steps += 1
    except BudgetNotReached as e:
        msg = f"stopped at step {res.steps}: {e}"
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(msg)
    dist.destroy_process_group()


def test_a_safety_limit_in_one_process_stops_every_process_at_the_same_step(tmp_path):
    """The wall-clock limit is decided together (distributed.any_process): without that, rank 1 (no
    limit reached) would wait forever in its next all-reduce while rank 0 raised."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_limit_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p.is_alive() for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not any(alive), "a process hung after the other hit its safety limit"
    msgs = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert msgs[0].startswith("stopped at step 1: lora hit its safety limit"), msgs
    assert msgs[1].startswith("stopped at step 1: lora: another process hit its safety limit"), msgs
