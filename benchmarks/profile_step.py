"""Where a training step's time goes: ``torch.profiler`` over one forward + backward of SmolLM2-135M,
original or converted (``train_step.py``'s recipes), batch 1, after a warm-up step.

    .venv/bin/python benchmarks/profile_step.py --model converted --n 1024 --threads 1
    .venv/bin/python benchmarks/profile_step.py --model original --n 1024 --threads 1
    .venv/bin/python benchmarks/profile_step.py --model converted --n 1024 --threads 2 --dtype bf16

Prints tokens/s of the profiled step (the profiler's overhead included: compare the two models
in the same run of the machine, not with ``train_step.py``'s rows) and the operators by self CPU
time; ``--top`` rows.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("original", "converted"), default="converted")
    p.add_argument("--n", type=int, default=1024, help="tokens")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--recipe", default="main", help="train_step.py's RECIPES key")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16: the step under torch.autocast('cpu', dtype=torch.bfloat16), as Trainer's --bf16")
    a = p.parse_args(argv)
    if a.n < 2 or a.threads < 1 or a.top < 1:
        raise ValueError(f"need n >= 2, threads >= 1, top >= 1; got n={a.n}, threads={a.threads}, top={a.top}")
    torch.set_num_threads(a.threads)
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    import hf_rfa
    from hf_rfa import assets
    from train_step import RECIPES

    if a.recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {a.recipe!r}")
    model = AutoModelForCausalLM.from_pretrained(str(assets.smollm2_path()), dtype=torch.float32)
    if a.model == "converted":
        hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPES[a.recipe]))
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, a.n), generator=torch.Generator().manual_seed(0))
    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = model(ids, labels=ids).loss
        loss.backward()

    step()  # warm-up
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        dt = time.perf_counter() - t
    print(f"{a.model} ({a.recipe if a.model == 'converted' else 'softmax'}), {a.dtype}, N={a.n}, {a.threads} thread(s): {dt:.2f} s, {a.n / dt:.0f} tok/s (profiled)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
