"""glibc's mmap threshold on the CPU (host_memory.map_large_blocks, --malloc-mmap-threshold)."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys

import pytest

from hf_rfa.recipes.conversion import host_memory, pipeline
from hf_rfa.recipes.conversion.config import ConversionConfig

# a mapped 16 MiB block freed (glibc raises its threshold to 16 MiB), then a 16 MiB block, a live
# 1 MiB block above it, and the 16 MiB block freed: the resident growth it leaves, in bytes
_PINNED_BLOCK = """
import ctypes, json, sys
from hf_rfa.recipes.conversion.host_memory import map_large_blocks, rss_now
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def block(n):
    b = libc.malloc(n)
    ctypes.memset(b, 1, n)  # touched: resident
    return b
was_set = map_large_blocks(int(sys.argv[1]))
libc.free(block(16 << 20))
before = rss_now()
big = block(16 << 20)
pin = block(1 << 20)
libc.free(big)
print(json.dumps({"set": was_set, "growth": rss_now() - before}))
"""


def _glibc() -> bool:
    try:
        return os.path.exists("/proc/self/statm") and hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallopt")
    except OSError:
        return False


def _pinned_growth(mib: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != host_memory.MMAP_THRESHOLD_ENV}
    out = subprocess.run([sys.executable, "-c", _PINNED_BLOCK, str(mib)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(), reason="glibc on Linux: mallopt and /proc")
def test_a_freed_large_block_leaves_the_resident_set_only_with_the_fixed_threshold():
    default = _pinned_growth(0)
    fixed = _pinned_growth(4)
    assert default["set"] is False and fixed["set"] is True
    assert default["growth"] > 12 * 2**20, default  # glibc's own threshold: the freed block stays resident
    assert fixed["growth"] < 4 * 2**20, fixed  # mapped on its own: unmapped when freed (the 1 MiB pin stays)


@pytest.mark.parametrize("bad", [-1, 33, 2.0, True, "4", None])
def test_bad_thresholds_are_refused_with_the_allowed_range(bad):
    with pytest.raises(ValueError, match=r"malloc_mmap_threshold must be an int MiB in \[0, 32\]"):
        host_memory.map_large_blocks(bad)
    with pytest.raises(ValueError, match=r"malloc_mmap_threshold must be an int MiB in \[0, 32\]"):
        ConversionConfig(model="m", malloc_mmap_threshold=bad)


def test_zero_and_the_users_environment_leave_glibc_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_mallopt", lambda: lambda *a: calls.append(a) or 1)
    assert host_memory.map_large_blocks(0) is False
    monkeypatch.setenv(host_memory.MMAP_THRESHOLD_ENV, "65536")
    assert host_memory.map_large_blocks(4) is False
    assert calls == []
    monkeypatch.delenv(host_memory.MMAP_THRESHOLD_ENV)
    assert host_memory.map_large_blocks(4) is True
    assert calls == [(-3, 4 * 2**20)]


def test_the_conversion_sets_it_on_the_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "map_large_blocks", lambda mib: calls.append(mib) or True)
    cfg = ConversionConfig(model="m", malloc_mmap_threshold=8)
    assert pipeline._map_large_blocks(cfg, "cpu") is True
    assert pipeline._map_large_blocks(cfg, "cuda:0") is False
    monkeypatch.setattr(pipeline, "default_device", lambda: "cpu")
    assert pipeline._map_large_blocks(cfg, None) is True
    assert pipeline._map_large_blocks(cfg, "auto") is True
    assert calls == [8, 8, 8]


def test_glibcs_own_threshold_is_named_as_beyond_the_plan(monkeypatch, caplog):
    """--malloc-mmap-threshold 0 on the CPU (the main job's): a warning that the peak can exceed
    the plan (which assumes the fixed threshold); none with the default."""
    import logging

    monkeypatch.delenv(host_memory.MMAP_THRESHOLD_ENV, raising=False)
    monkeypatch.setattr(host_memory, "_mallopt", lambda: lambda *a: 1)
    with caplog.at_level(logging.WARNING, logger=pipeline.logger.name):
        assert pipeline._map_large_blocks(ConversionConfig(model="m", malloc_mmap_threshold=0), "cpu") is False
        assert pipeline._map_large_blocks(ConversionConfig(model="m"), "cpu") is True
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "--malloc-mmap-threshold 0" in warned[0] and "memory plan" in warned[0]


class _Stop(Exception):
    """Raised in place of the model load: the commands' set-up is what these tests look at."""


@pytest.mark.parametrize("command,argv,cuda,forced,expected", [
    ("evaluate_main", ["--model", "m", "--text", "t.txt"], True, None, [4]),
    ("finetune_main", ["--model_name_or_path", "m", "--train_file", "t.txt", "--output_dir", "o"], False, None, [4]),
    ("train_accelerate_main", ["--model_name_or_path", "m", "--train_file", "t.txt", "--output_dir", "o"], False, None, [4]),
    ("train_accelerate_main", ["--model_name_or_path", "m", "--train_file", "t.txt", "--output_dir", "o"], True, None, []),
    ("train_accelerate_main", ["--model_name_or_path", "m", "--train_file", "t.txt", "--output_dir", "o"], True, "1", [4]),
])
def test_the_training_and_evaluation_commands_set_it_on_the_cpu_before_loading(monkeypatch, command, argv, cuda, forced, expected):
    """hf-rfa-evaluate (always on the CPU), hf-rfa-finetune and hf-rfa-train (on the CPU: no CUDA,
    ACCELERATE_USE_CPU) fix the 4 MiB threshold before the model loads; not on CUDA. (With CUDA
    faked, TrainingArguments' parsing itself queries the device: hf-rfa-finetune's rule is the
    next test's.)"""
    import torch

    from hf_rfa import cli
    from hf_rfa.recipes import training
    from hf_rfa.recipes.conversion import pipeline as conv_pipeline

    calls = []
    monkeypatch.setattr(host_memory, "map_large_blocks", lambda mib: calls.append(mib) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if forced is None:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_USE_CPU", forced)

    def stop(*a, **k):
        assert calls == expected  # set (or not) before anything is loaded
        raise _Stop

    monkeypatch.setattr(conv_pipeline, "load_model", stop)
    monkeypatch.setattr(training, "run_trainer", stop)
    monkeypatch.setattr(training, "train", stop)
    monkeypatch.setattr(cli, "_end_process_group", lambda: None)
    with pytest.raises(_Stop):
        getattr(cli, command)(argv)


def test_a_training_command_is_on_the_cpu_when_told_or_without_cuda(monkeypatch):
    import torch

    from hf_rfa import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli._no_cuda(True) is True and cli._no_cuda(False) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli._no_cuda(False) is True
