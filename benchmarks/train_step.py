"""One training step of SmolLM2-135M, original vs converted: tokens/s and peak RSS.

    .venv/bin/python benchmarks/train_step.py                  # N = 1024, 2048, 4096; fp32 and bf16 (~20 min idle)
    .venv/bin/python benchmarks/train_step.py --long           # + N = 8192 (both) and 16384 (converted only)
    .venv/bin/python benchmarks/train_step.py --n 1024 2048 --dtypes fp32
    .venv/bin/python benchmarks/train_step.py --n 16384 --dtypes fp32-ckpt --models converted

Batch 1, ``model(ids, labels=ids).loss.backward()``, all parameters trainable, ``model.train()``;
converted = ``--recipe``: ``main`` (default; the main job's recipe, Hedgehog m=64 +
window 64 + 4 sinks + decay on un-rotated q/k; rows in ``results/train_step_recipe.*``) or
``favor256`` (FAVOR+ m=256 + window 256 + 4 sinks, the first recipe of
the training-speed table; rows in ``results/train_step.*``). Each case (model, N,
dtype) runs in its own subprocess (so its peak RSS, ``resource.getrusage``, is its own): load,
convert, one warm-up step, ``--steps`` measured steps (tokens/s = N / the fastest one). ``bf16``
runs the step under ``torch.autocast("cpu", dtype=torch.bfloat16)`` (what Trainer's ``--bf16``
does). For each (N, dtype) the original and the converted case run one after the other, so their
ratio is measured under the same machine load (the load average is recorded with each case).
``--mmap-threshold BYTES`` runs both with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed (peak RSS then
counts live tensors, not freed blocks glibc keeps in its heap; slower), in rows of their own.
``--release-loss`` keeps only ``loss.detach()`` after each backward (what Trainer's ``training_step``
does) instead of the loss with its spent graph, which the plain loop ``loss = model(...).loss;
loss.backward()`` keeps alive during the next step's forward (its small leftover objects split
glibc's heap and raise peak RSS, more for the converted model), in rows of their own.
Cases of the original beyond ``--original-max`` are skipped (the default, 8192: the original's
16,384-token step does not fit this 23 GiB machine next to other jobs); ``--long`` adds the long
cases (8192 and, converted only, 16384). A case that fails (e.g. killed for memory) is recorded as
such. Results are merged into ``<out>.json`` (so runs can be split) and rendered as ``<out>.md``
(with the command lines that produced them) and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
def _preset(name: str) -> dict:
    from hf_rfa.presets import get_preset

    return get_preset(name).config().to_dict()


#: converted recipes (``--recipe``): ``main`` is the recall preset (``make main``'s attention);
#: ``favor256`` the first recipe of the training-speed table (``benchmarks/results/train_step.md``)
RECIPES = {
    "main": _preset("recall"),
    "favor256": dict(feature_map="favor+", num_features=256, window=256, sinks=4, seed=0),
}
RECIPE_NAMES = {
    "main": "Hedgehog m=64 (128 features) + window 64 + 4 sinks + decay half-life 128 on un-rotated q/k (the recall preset)",
    "favor256": "FAVOR+ m=256 + window 256 + 4 sinks",
}
#: where each recipe's rows are merged by default
DEFAULT_OUT = {"main": RESULTS / "train_step_recipe", "favor256": RESULTS / "train_step"}


#: the default lengths, and what ``--long`` adds (16384: converted only, see ``--original-max``)
SHORT_N = [1024, 2048, 4096]
LONG_N = [8192, 16384]


def one_case(model_kind: str, n: int, dtype: str, threads: int, steps: int = 1, recipe: str = "main", release_loss: bool = False) -> dict:
    """Runs in the child process: load, (convert), warm-up step, ``steps`` measured steps.
    ``release_loss``: after each backward keep only ``loss.detach()`` (Trainer's ``training_step``
    does this) instead of the loss with its spent graph, which the plain loop ``loss =
    model(...).loss; loss.backward()`` keeps alive until the next step's loss replaces it."""
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM

    import hf_rfa
    from hf_rfa.assets.models import smollm2_path

    try:  # if memory runs out, the kernel's OOM killer takes this case first, not a neighbour's job
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    if model_kind == "converted":
        model = hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPES[recipe]))
    model.train()
    if dtype.endswith("-ckpt"):  # transformers' activation checkpointing: each layer recomputed in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = dtype.endswith("-compile")
    if compiled:  # regional compilation: each decoder layer torch.compile'd whole (one graph serves all 30)
        if model_kind == "converted":
            hf_rfa.compile_layers(model)  # fullgraph; traces the hybrid's recomputing backward too
        else:
            for layer in model.model.layers:
                layer.compile(fullgraph=True)
    for p in model.parameters():
        p.requires_grad_(True)
    ids = torch.randint(10, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    times, cpu = [], []
    for _ in range(1 + steps):  # warm-up, measured
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype.startswith("bf16")):
            # compiled: no KV cache (its per-layer state would recompile the graph for every layer)
            loss = model(input_ids=ids, labels=ids, **({"use_cache": False} if compiled else {})).loss
        loss.backward()
        if release_loss:
            loss = loss.detach()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    best = min(times[1:])
    warmup = times[0]  # with -compile: includes compiling
    # process CPU seconds of the step (all its threads): on a machine shared with other jobs, N /
    # cpu_seconds (threads=1) tracks the compute cost when wall time does not
    return {"model": model_kind, "n": n, "dtype": dtype, "threads": threads, "seconds": best, "cpu_seconds": min(cpu[1:]), "tok_per_cpu_s": n / min(cpu[1:]), "tok_s": n / best, "peak_rss_gib": rss / 2**30, "loss": float(loss), "warmup_seconds": warmup, "load_avg_1m": os.getloadavg()[0], "release_loss": release_loss}


def run_case(model_kind: str, n: int, dtype: str, threads: int, timeout: float, steps: int = 1, recipe: str = "main", mmap_threshold: int | None = None, release_loss: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", model_kind, str(n), dtype, "--threads", str(threads), "--steps", str(steps), "--recipe", recipe] + (["--release-loss"] if release_loss else [])
    env = dict(os.environ)
    if mmap_threshold is not None:  # glibc: a fixed threshold (no dynamic raise), see --mmap-threshold
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    case = {"model": model_kind, "n": n, "dtype": dtype, "mmap_threshold": mmap_threshold, "release_loss": release_loss}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timeout > {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
        return {**case, "error": why}
    return {**json.loads(lines[-1]), "mmap_threshold": mmap_threshold}


def _mmap(r: dict) -> int:
    """A row's fixed mmap threshold (0: glibc's default allocator)."""
    return r.get("mmap_threshold") or 0


def _key(r: dict) -> tuple:
    return (r["model"], r["n"], r["dtype"], _mmap(r), bool(r.get("release_loss")))


def render(results: list[dict]) -> str:
    """Markdown table: one row per (N, dtype), original vs converted."""
    by = {_key(r): r for r in results}
    rows = sorted({_key(r)[1:] for r in results})  # (N, dtype, mmap threshold, loss released)

    def cell(r, field, fmt):
        if r is None:
            return "—"
        return r.get("error", "failed") if field not in r else fmt.format(r[field])

    out = ["| N | dtype | threads | original tok/s | converted tok/s | ratio | original peak RSS GiB | converted peak RSS GiB | RSS ratio | load avg (orig / conv) | tok per CPU-s (orig / conv = ratio) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        n, dt, mt, rl = row
        o, c = by.get(("original", *row)), by.get(("converted", *row))
        ok = o is not None and c is not None and "tok_s" in o and "tok_s" in c
        ratio = f"{c['tok_s'] / o['tok_s']:.2f}×" if ok else "—"
        mratio = f"{c['peak_rss_gib'] / o['peak_rss_gib']:.2f}×" if ok else "—"
        load = f"{cell(o, 'load_avg_1m', '{:.1f}')} / {cell(c, 'load_avg_1m', '{:.1f}')}"
        cpu_ok = ok and "tok_per_cpu_s" in o and "tok_per_cpu_s" in c
        cpu_cells = f"{o['tok_per_cpu_s']:.1f} / {c['tok_per_cpu_s']:.1f} = {c['tok_per_cpu_s'] / o['tok_per_cpu_s']:.2f}×" if cpu_ok else "—"
        thr = "/".join(sorted({str(r["threads"]) for r in (o, c) if r is not None and "threads" in r})) or "—"
        label = dt + (f", MALLOC_MMAP_THRESHOLD_={mt}" if mt else "") + (", loss released after backward" if rl else "")
        out.append(f"| {n} | {label} | {thr} | {cell(o, 'tok_s', '{:.0f}')} | {cell(c, 'tok_s', '{:.0f}')} | {ratio} | {cell(o, 'peak_rss_gib', '{:.1f}')} | {cell(c, 'peak_rss_gib', '{:.1f}')} | {mratio} | {load} | {cpu_cells} |")
    return "\n".join(out)


def plot(results: list[dict], path: Path, recipe: str = "main") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for model in ("original", "converted"):
        for dt, style in (("fp32", "-o"), ("bf16", "--s"), ("fp32-ckpt", ":^"), ("bf16-ckpt", ":v"), ("fp32-compile", "-.d")):
            pts = sorted((r["n"], r) for r in results if r["model"] == model and r["dtype"] == dt and not _mmap(r) and not r.get("release_loss") and "tok_s" in r)
            if pts:
                a1.plot([n for n, _ in pts], [r["tok_s"] for _, r in pts], style, label=f"{model} {dt}")
                a2.plot([n for n, _ in pts], [r["peak_rss_gib"] for _, r in pts], style, label=f"{model} {dt}")
    for ax, title in ((a1, "training tokens/s (fwd+bwd)"), (a2, "peak RSS (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M, batch 1, original vs converted ({RECIPE_NAMES[recipe].split(' (')[0]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "N", "DTYPE"), help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, nargs="+", default=None, help=f"token counts (default {SHORT_N}, with --long also {LONG_N})")
    ap.add_argument("--long", action="store_true", help=f"add the long cases N = {LONG_N} (an hour or more on 2 cores)")
    ap.add_argument("--steps", type=int, default=1, help="measured steps per case after the warm-up (the fastest counts)")
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16", "fp32-ckpt", "bf16-ckpt", "fp32-compile"], help="fp32-ckpt / bf16-ckpt: fp32 / bf16 autocast with transformers' gradient checkpointing (model.gradient_checkpointing_enable); fp32-compile: fp32 with every decoder layer torch.compile'd whole (converted: hf_rfa.compile_layers; original: layer.compile(fullgraph=True); both use_cache=False; the warm-up step compiles)")
    ap.add_argument("--models", nargs="+", default=["original", "converted"], choices=["original", "converted"])
    ap.add_argument("--original-max", type=int, default=8192, help="largest N run for the original model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--recipe", default="main", help=f"converted recipe, one of {sorted(RECIPES)} (default main: the main job's)")
    ap.add_argument("--out", type=Path, default=None, help="results stem (default: benchmarks/results/train_step_recipe for main, train_step for favor256)")
    ap.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES", help="run both models' cases with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (a fixed threshold: allocations above it are mmap'ed and returned on free, instead of glibc raising the threshold up to 32 MiB and keeping freed blocks in its heap); rows are kept apart from the default allocator's")
    ap.add_argument("--release-loss", action="store_true", help="after each backward keep only loss.detach(), as Trainer's training_step does, instead of the loss with its spent graph (which the plain loop `loss = model(...).loss; loss.backward()` keeps alive while the next step's forward runs); rows are kept apart")
    ap.add_argument("--render-only", action="store_true", help="rewrite the .md/.png from the .json, run nothing")
    args = ap.parse_args(argv)
    if args.recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {args.recipe!r}")
    if args.out is None:
        args.out = DEFAULT_OUT[args.recipe]
    if args.child:
        model, n, dt = args.child
        print(json.dumps(one_case(model, int(n), dt, args.threads, args.steps, args.recipe, args.release_loss)), flush=True)
        return
    if args.steps < 1:
        raise ValueError(f"steps must be >= 1, got {args.steps}")
    ns = args.n if args.n is not None else SHORT_N + (LONG_N if args.long else [])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    store = args.out.with_suffix(".json")
    results = json.loads(store.read_text()) if store.is_file() else []
    runs_file = args.out.with_suffix(".runs.json")
    runs = json.loads(runs_file.read_text()) if runs_file.is_file() else []
    command = "python benchmarks/train_step.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if not args.render_only:
        runs.append({"command": command.strip(), "load_avg_start": os.getloadavg()[0]})
    for n in ns if not args.render_only else []:
        for dt in args.dtypes:
            for model in args.models:
                if model == "original" and n > args.original_max:
                    continue
                r = run_case(model, n, dt, args.threads, args.timeout, args.steps, args.recipe, args.mmap_threshold, args.release_loss)
                print(json.dumps(r), flush=True)
                results = [x for x in results if _key(x) != _key(r)] + [r]
                store.write_text(json.dumps(results, indent=1))
    if not args.render_only:
        runs[-1]["load_avg_end"] = os.getloadavg()[0]
    runs_file.write_text(json.dumps(runs, indent=1))
    table = render(results)
    cmds = "\n".join(f"    {r['command']}    # load average {r['load_avg_start']:.1f} -> {r.get('load_avg_end', float('nan')):.1f}" + (f"; {r['note']}" if r.get("note") else "") for r in runs)
    args.out.with_suffix(".md").write_text(
        "# Training step: original vs converted SmolLM2-135M\n\n"
        "`benchmarks/train_step.py`, batch 1, fwd+bwd with labels=ids, all parameters trainable, threads per row, "
        f"fastest measured step after a warm-up; converted = {RECIPE_NAMES[args.recipe]} (`--recipe {args.recipe}`); peak RSS of the case's own process; "
        "bf16 = `torch.autocast(\"cpu\", dtype=torch.bfloat16)`; fp32-ckpt / bf16-ckpt = fp32 / bf16 autocast with `model.gradient_checkpointing_enable()` (each decoder layer recomputed in backward); fp32-compile = fp32 with each decoder layer compiled whole (regional `torch.compile`, `fullgraph=True`: converted by `hf_rfa.compile_layers`, original by `layer.compile(fullgraph=True)`; both with `use_cache=False`; the warm-up step compiles, its seconds are `warmup_seconds` in the .json; the earliest rows compiled with graph breaks). Original and converted of a row ran back to back (the ratio is measured "
        "under one machine load; the 1-minute load average of each case is in the .json). Produced by (2-core machine; a load above "
        "the thread count means other jobs shared it; then the wall-clock tokens/s understate both models, and tokens per CPU-second of "
        "the process — one thread — track the compute cost better):\n\n" + cmds + "\n\n" + table + "\n"
    )
    plot(results, args.out.with_suffix(".png"), args.recipe)
    print(table)


if __name__ == "__main__":
    main()
