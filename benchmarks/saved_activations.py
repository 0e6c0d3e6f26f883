"""What a SmolLM2-135M training step keeps for backward, original vs converted.

    .venv/bin/python benchmarks/saved_activations.py --n 4096 [--recipe main|favor256] [--autocast bf16]

Batch 1, ``model(ids, labels=ids).loss`` under ``torch.autograd.graph.saved_tensors_hooks``,
``model.train()``, the forward under ``torch.autocast("cpu", bfloat16)`` with ``--autocast bf16``
(backward outside it, as Trainer runs it), converted = a recipe of ``train_step.py`` (``--recipe``: ``main``, the main
job's, default; ``favor256``: FAVOR+ m=256 + window 256 + 4 sinks). Reports the bytes of the distinct storages saved for backward (a tensor saved by several
ops, or a view of a saved storage, counts once) and the process's peak RSS after one backward, then
the saved storages whose (shape, dtype) count differs between the two models. Both models run in
this one process, one after the other (so the second peak RSS includes the first's high-water
mark: use ``train_step.py`` for peak memory).
"""

from __future__ import annotations

import argparse
import collections
import logging
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import RECIPES  # noqa: E402  (the converted recipes, shared with train_step.py)

logger = logging.getLogger("saved_activations")


def saved_storages(kind: str, n: int, recipe: str = "main", autocast: bool = False) -> dict[int, tuple[int, tuple, str]]:
    """``{storage pointer: (bytes, a saved shape, dtype)}`` of one forward of ``kind``; runs its backward."""
    from transformers import AutoModelForCausalLM

    import hf_rfa
    from hf_rfa.assets.models import smollm2_path

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    if kind == "converted":
        model = hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPES[recipe]))
    model.train()
    ids = torch.randint(10, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    seen: dict[int, tuple[int, tuple, str]] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape), str(t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return seen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--recipe", default="main", help="converted recipe of train_step.py: main (default) or favor256")
    ap.add_argument("--autocast", default="off", help="off (default: float32) or bf16 (the forward under bf16 autocast)")
    args = ap.parse_args(argv)
    if args.autocast not in ("off", "bf16"):
        raise ValueError(f"autocast must be one of ['bf16', 'off'], got {args.autocast!r}")
    if args.recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {args.recipe!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    counts = {}
    for kind in ("original", "converted"):
        seen = saved_storages(kind, args.n, args.recipe, args.autocast == "bf16")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
        logger.info("%s N=%d autocast %s: saved storages %.3f GiB, process peak RSS so far %.2f GiB", kind, args.n, args.autocast, sum(v[0] for v in seen.values()) / 2**30, rss)
        counts[kind] = collections.Counter((shape, dt, nb) for nb, shape, dt in seen.values())
    for key in sorted(set(counts["original"]) | set(counts["converted"]), key=lambda k: -k[2]):
        a, b = counts["original"][key], counts["converted"][key]
        if a != b:
            logger.info("shape %s %s (%d bytes): original %d, converted %d (converted − original: %.2f MiB)", key[0], key[1], key[2], a, b, (b - a) * key[2] / 2**20)


if __name__ == "__main__":
    main()
