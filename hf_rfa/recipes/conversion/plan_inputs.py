"""What the memory plan (:mod:`.memory_plan`) reads beside the model's config: whether a spec is a
``config.json`` alone, the checkpoint's tensor sizes (safetensors headers) and stored dtype, and the
resident memory its tokenizer adds (measured in a fresh process). Nothing here loads weights."""

from __future__ import annotations

import logging
import math
import os

import torch

logger = logging.getLogger(__name__)


def config_file(spec: str) -> bool:
    """Whether ``spec`` names a ``config.json`` alone (no checkpoint files with it to read)."""
    return os.path.isfile(spec) and spec.endswith(".json")


def tensor_sizes(spec: str) -> list[int]:
    """The element counts of the checkpoint's safetensors tensors, from their headers: a local
    folder's (a GGUF file: its converted folder) or a Hub id's in the Hugging Face cache, else the
    Hub's headers of them (nothing downloaded); [] where there are none to read."""
    from safetensors import safe_open

    from .loading import checkpoint_files, resolve_checkpoint

    if config_file(spec):
        return []
    files = checkpoint_files(resolve_checkpoint(spec))
    sizes = []
    for f in files:
        with safe_open(f, framework="pt") as h:
            sizes += [math.prod(h.get_slice(k).get_shape()) for k in h.keys()]
    if files or os.path.exists(spec):
        return sizes
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(spec)
    except Exception as e:  # noqa: BLE001 (no connection, gated, not safetensors: the upper bound stands)
        logger.debug("%s: safetensors headers not available (%s)", spec, e)
        return []
    return [math.prod(t.shape) for m in meta.files_metadata.values() for t in m.tensors.values()]


_TOKENIZER_RSS = """
import sys
from transformers import AutoTokenizer
rss = lambda: int(open("/proc/self/statm").read().split()[1])
before = rss()
try:
    tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
except Exception:
    sys.exit(3)
print((rss() - before) * int(sys.argv[2]))
"""


def tokenizer_bytes(spec: str) -> int:
    """The resident memory that loading the model's tokenizer adds to a process that has imported
    transformers: the tokenizer (a fast tokenizer's vocabulary and merges) and the modules loading
    it imports (``tokenizers``, the model's tokenizer class, the chat template's engine), about
    0.1 GiB for SmolLM2. Measured by loading it in a fresh Python process (a few seconds; in this
    one, modules already imported and memory freed earlier would hide it) from the folder, the
    ``config.json``'s folder or the Hugging Face cache (nothing downloaded); 0 where it is not at
    hand or cannot be measured."""
    import subprocess
    import sys

    from .loading import resolve_checkpoint

    if not os.path.exists("/proc/self/statm"):
        return 0
    path = os.path.dirname(spec) or "." if config_file(spec) else resolve_checkpoint(spec)
    if not has_tokenizer(path):
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", _TOKENIZER_RSS, path, str(os.sysconf("SC_PAGE_SIZE"))],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        logger.debug("%s: tokenizer not measured (%s)", spec, e)
        return 0
    if out.returncode != 0:
        logger.debug("%s: no tokenizer at hand (exit %d)", spec, out.returncode)
        return 0
    return max(0, int(out.stdout.split()[-1]))


def has_tokenizer(path: str) -> bool:
    """Whether a folder, or a Hub id in the Hugging Face cache, has a tokenizer's files."""
    names = ("tokenizer_config.json", "tokenizer.json")
    if os.path.isdir(path):
        return any(os.path.isfile(os.path.join(path, n)) for n in names)
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(path, n), str) for n in names)


def checkpoint_dtype(config) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in, from its config (``dtype``, formerly
    ``torch_dtype``; float32 when it names none)."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32


__all__ = ["checkpoint_dtype", "config_file", "has_tokenizer", "tensor_sizes", "tokenizer_bytes"]
