"""Rewrite the ``--dry-run`` tables of ``docs/gpus.md`` from the current memory plan.

    .venv/bin/python scripts/render_dry_run_docs.py           # rewrite docs/gpus.md in place
    .venv/bin/python scripts/render_dry_run_docs.py --check   # exit 1 if a table is out of date

Each table in the page starts with a ``*Memory plan per process: <name>, ...*`` line and ends with
the ``Decode cache per sequence`` line; :data:`TABLES` gives, in page order, the flags each one is
the plan of (the page's ``$RECIPE`` included) and the name shown for its model (the SmolLM2 plan
reads the offline copy's config; the Llama-3-8B plans the config in ``tests/fixtures``). CPU
plans put the measured ``runtime`` (this process's resident memory) and ``tokenizer`` in, rounded
to 50 and 8 MiB so the page does not change with every run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "gpus.md"
RECIPE = ["--preset", "recall", "--eval-contexts", "1024", "4096", "8192"]
LLAMA = str(ROOT / "tests" / "fixtures" / "llama-3-8b")
#: (flags, environment, shown model name), in the page's order
TABLES = [
    (["--model", "SMOLLM2", "--device", "cpu", "--dtype", "float32"], {}, "SmolLM2-135M-Instruct"),
    (["--model", "SMOLLM2", "--device", "cpu", "--dtype", "bfloat16"], {}, "SmolLM2-135M-Instruct"),
    (["--model", LLAMA, "--device", "cuda", "--dtype", "bfloat16"], {}, "Llama-3-8B shapes"),
    (["--model", LLAMA, "--device", "cuda", "--dtype", "bfloat16", "--transfer-layerwise"], {}, "Llama-3-8B shapes"),
    (["--model", LLAMA, "--device", "cuda", "--dtype", "bfloat16", "--transfer-layerwise", "--activation-checkpointing"], {}, "Llama-3-8B shapes"),
    (["--model", LLAMA, "--device", "cuda", "--dtype", "bfloat16", "--batch-size", "8"], {"WORLD_SIZE": "8"}, "Llama-3-8B shapes"),
    (["--model", LLAMA, "--device", "cuda", "--dtype", "bfloat16", "--batch-size", "8"], {"WORLD_SIZE": "8", "ACCELERATE_USE_FSDP": "true"}, "Llama-3-8B shapes"),
]
BLOCK = re.compile(r"^\*Memory plan per process: .*?^Decode cache per sequence: [^\n]*$", re.S | re.M)


def plan_markdown(flags: list[str], env: dict[str, str], name: str, cpu_gib_step: float = 50 / 1024) -> str:
    from hf_rfa.cli import config_from_args
    from hf_rfa.recipes.conversion import distributed, memory_plan, plan_inputs
    from hf_rfa.assets.models import smollm2_path

    flags = [str(smollm2_path()) if f == "SMOLLM2" else f for f in flags]
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    distributed.use_fsdp(None)
    try:
        cfg = config_from_args([*flags, *RECIPE, "--dry-run"])
        runtime = tokenizer = None
        if cfg.device == "cpu":  # the process's own memory and the tokenizer's, rounded so the page is stable
            step = int(cpu_gib_step * 2**30)
            runtime = round(memory_plan.rss_now() / step) * step
            tokenizer = round(plan_inputs.tokenizer_bytes(cfg.model) / 2**23) * 2**23
        p = memory_plan.plan(cfg, runtime_bytes=runtime, tokenizer=tokenizer)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    p.model = name
    text = p.markdown()
    head, rest = text.split("\n", 1)
    return f"*{head}*\n{rest}"


def render(page: str) -> str:
    blocks = list(BLOCK.finditer(page))
    if len(blocks) != len(TABLES):
        raise ValueError(f"{PAGE.name} has {len(blocks)} plan tables, expected {len(TABLES)}")
    plan_markdown(*TABLES[0])  # imports everything a plan does first: every CPU table then sees the same runtime
    out, last = [], 0
    for m, (flags, env, name) in zip(blocks, TABLES):
        out += [page[last : m.start()], plan_markdown(flags, env, name)]
        last = m.end()
    return "".join(out) + page[last:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report whether the page is up to date (exit 1 if not)")
    args = ap.parse_args(argv)
    page = PAGE.read_text()
    new = render(page)
    if args.check:
        return int(new != page)
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
