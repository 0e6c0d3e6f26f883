"""The tables, goals and plots of ``benchmarks/speed.py`` from its results (``speed_results.json``):
:func:`write_tables` (``speed_tables.md``), :func:`evaluate_targets`, :func:`plot` (``speed_*.png``).

Renders a kept results file again (e.g. after a change to the tables)::

    .venv/bin/python benchmarks/speed_report.py benchmarks/results/speed_full/speed_results.json --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the benchmarked shape: batch, heads, head dim
B, H, D = 1, 12, 64


def fmt_ms(x):
    return "—" if x is None else (f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}")


def fmt_mb(b):
    return "—" if b is None else f"{b / 2**20:.0f}"


def write_tables(res: dict, out: Path) -> str:
    lines = ["# hf_rfa vs SDPA: speed and memory", ""]
    env = res["env"]
    lines += [
        f"Command: `{env['command']}`  ",
        f"Device: {env['device']} ({env['cpu']}), torch {env['torch']}, threads {env['threads']}, "
        f"compiled kernels {'on' if env.get('compile') else 'off'}, "
        f"native CPU kernel {'used for causal inference' if env.get('native_kernel') else 'off'}, "
        f"checkpointed blocks {'on' if env.get('checkpoint_blocks') else 'off'}, "
        f"load average at start {env['loadavg_start']}, at end {env.get('loadavg_end', '?')}.  ",
        f"B={B}, H={H}, d={D}, favor+ (m features), chunk_size={env['chunk_size']}. Times are medians of "
        "interleaved repetitions (ms); speed-up = SDPA time / hf_rfa time.",
        "",
        "## Matmul throughput of this machine (same run)",
        "",
        "| dtype | GFLOP/s |",
        "|---|---|",
    ]
    for k, v in res["matmul_gflops"].items():
        lines.append(f"| {k} | {v:.0f} |")
    lines.append("")
    groups: dict = {}
    for r in res["timings"]:
        groups.setdefault((r["dtype"], r["causal"], r["backward"]), []).append(r)
    for (dt, causal, bwd), rows in groups.items():
        ms = sorted({r["m"] for r in rows})
        ns = sorted({r["n"] for r in rows})
        lines += [f"## {dt}, {'causal' if causal else 'bidirectional'}, {'forward+backward' if bwd else 'forward'}", ""]
        head = "| N | SDPA ms | " + " | ".join(f"rfa m={m} ms | speed-up m={m}" for m in ms)
        if causal and not bwd:
            head += " | " + " | ".join(f"rfa m={m} GFLOP/s (% of fp32 mm)" for m in ms)
        lines += [head + " |", "|" + "---|" * head.count("|")]
        for n in ns:
            by_m = {r["m"]: r for r in rows if r["n"] == n}
            any_r = next(iter(by_m.values()))
            sd = any_r["sdpa_s"]
            cells = [str(n), fmt_ms(sd) if sd is not None else (any_r["sdpa_note"] or "—")]
            for m in ms:
                r = by_m.get(m)
                cells.append(fmt_ms(r["rfa_s"]) if r else "—")
                cells.append(f"{sd / r['rfa_s']:.2f}×" if r and sd is not None else "—")
            if causal and not bwd:
                peak = res["matmul_gflops"]["fp32"]
                for m in ms:
                    r = by_m.get(m)
                    cells.append(f"{r['rfa_gflops']:.0f} ({100 * r['rfa_gflops'] / peak:.0f}%)" if r else "—")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if res.get("memory"):
        lines += [
            "## Peak extra memory (MiB)",
            "",
            f"Method: {res['memory_method']}",
            "",
            "| dtype | mode | pass | N | m | hf_rfa MiB | SDPA MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["memory"]:
            cell = lambda x: fmt_mb(x.get("extra_bytes")) if "extra_bytes" in x else x.get("error", "—")  # noqa: E731
            lines.append(
                f"| {r['dtype']} | {'causal' if r['causal'] else 'bidir'} | {'fwd+bwd' if r['backward'] else 'fwd'} | {r['n']} | {r['m']} | {cell(r['rfa'])} | {cell(r['sdpa'])} |"
            )
        lines.append("")
    lines += ["## Targets (fp32, causal, favor+, m=256)", ""]
    for t in res.get("targets", []):
        lines.append(f"- {t}")
    lines.append("")
    text = "\n".join(lines)
    (out / "speed_tables.md").write_text(text)
    return text


def evaluate_targets(res: dict) -> list[str]:
    out = []
    rows = {(r["dtype"], r["m"], r["causal"], r["backward"], r["n"]): r for r in res["timings"]}

    def speedup(bwd, n):
        r = rows.get(("fp32", 256, True, bwd, n))
        return None if r is None or r["sdpa_s"] is None else r["sdpa_s"] / r["rfa_s"]

    for bwd, goal in ((False, 5.0), (True, 3.0)):
        s = speedup(bwd, 16384)
        label = "forward+backward" if bwd else "forward"
        out.append(f"N=16384 {label} ≥ {goal:.0f}× SDPA: " + ("not measured" if s is None else f"{s:.2f}× — {'MET' if s >= goal else 'NOT met'}"))
    ns = sorted(n for (dt, m, c, bwd, n) in rows if (dt, m, c, bwd) == ("fp32", 256, True, False))
    cross = None
    for n in ns:
        s = speedup(False, n)
        if s is not None and s >= 1.0:
            cross = n
            break
    out.append("crossover (forward, first N where hf_rfa ≤ SDPA time) ≤ 2048: " + ("not reached" if cross is None else f"N={cross} — {'MET' if cross <= 2048 else 'NOT met'}"))
    mem = [r for r in res.get("memory", []) if (r["dtype"], r["m"], r["causal"], r["backward"], r["n"]) == ("fp32", 256, True, False, 65536)]
    if mem and "extra_bytes" in mem[0]["rfa"]:
        gb = mem[0]["rfa"]["extra_bytes"] / 2**30
        out.append(f"N=65536 forward extra memory < 2 GiB: {gb:.2f} GiB — {'MET' if gb < 2 else 'NOT met'}")
    else:
        out.append("N=65536 forward extra memory < 2 GiB: not measured")
    best = max((r["rfa_gflops"] for k, r in rows.items() if k[:4] == ("fp32", 256, True, False) and "rfa_gflops" in r), default=None)
    peak = res["matmul_gflops"]["fp32"]
    out.append(
        "≥ 50% of measured fp32 matmul throughput (causal forward): "
        + ("not measured" if best is None else f"best {best:.0f} GFLOP/s = {100 * best / peak:.0f}% of {peak:.0f} — {'MET' if best >= 0.5 * peak else 'NOT met'}")
    )
    return out


def _log_axes(ax, ylabel: str, legend_size: int) -> None:
    """Log–log axes over N with a grid and a legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(plt, fig, path: Path) -> str:
    """Write ``fig`` to ``path`` and close it; returns the file's name."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path.name


def plot(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    groups: dict = {}
    for r in res["timings"]:
        groups.setdefault((r["dtype"], r["causal"], r["backward"]), []).append(r)
    fig, axes = plt.subplots(2, 4, figsize=(20, 9), squeeze=False)
    for ax, ((dt, causal, bwd), rows) in zip(axes.flat, sorted(groups.items(), key=lambda kv: (kv[0][0] != "fp32", not kv[0][1], kv[0][2]))):
        for m in sorted({r["m"] for r in rows}):
            rr = sorted((r for r in rows if r["m"] == m), key=lambda r: r["n"])
            ax.plot([r["n"] for r in rr], [r["rfa_s"] for r in rr], "o-", label=f"hf_rfa favor+ m={m}")
        rr = sorted((r for r in rows if r["m"] == max(r2["m"] for r2 in rows) and r["sdpa_s"] is not None), key=lambda r: r["n"])
        ax.plot([r["n"] for r in rr], [r["sdpa_s"] for r in rr], "s--k", label="SDPA")
        ax.set_title(f"{dt} {'causal' if causal else 'bidir'} {'fwd+bwd' if bwd else 'fwd'}")
        _log_axes(ax, "seconds (median)", 8)
    files.append(_save(plt, fig, out / "speed_time.png"))

    fig, ax = plt.subplots(figsize=(8, 5))
    for (dt, causal, bwd), rows in sorted(groups.items()):
        rr = sorted((r for r in rows if r["m"] == 256 and r["sdpa_s"] is not None), key=lambda r: r["n"])
        if rr:
            ax.plot([r["n"] for r in rr], [r["sdpa_s"] / r["rfa_s"] for r in rr], "o-", label=f"{dt} {'causal' if causal else 'bidir'} {'fwd+bwd' if bwd else 'fwd'}")
    ax.axhline(1.0, color="k", lw=0.8)
    _log_axes(ax, "speed-up over SDPA (m=256)", 8)
    files.append(_save(plt, fig, out / "speed_speedup.png"))

    if res.get("memory"):
        fig, ax = plt.subplots(figsize=(8, 5))
        keys = sorted({(r["dtype"], r["causal"], r["backward"]) for r in res["memory"]})
        for dt, causal, bwd in keys:
            rr = sorted((r for r in res["memory"] if (r["dtype"], r["causal"], r["backward"]) == (dt, causal, bwd)), key=lambda r: r["n"])
            lab = f"{dt} {'causal' if causal else 'bidir'} {'fwd+bwd' if bwd else 'fwd'}"
            pts = [(r["n"], r["rfa"]["extra_bytes"] / 2**20) for r in rr if "extra_bytes" in r["rfa"]]
            if pts:
                ax.plot(*zip(*pts), "o-", label="hf_rfa " + lab)
            pts = [(r["n"], r["sdpa"]["extra_bytes"] / 2**20) for r in rr if "extra_bytes" in r["sdpa"]]
            if pts:
                ax.plot(*zip(*pts), "s--", label="SDPA " + lab)
        _log_axes(ax, "peak extra memory (MiB)", 7)
        files.append(_save(plt, fig, out / "speed_memory.png"))
    return files


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a speed_results.json written by benchmarks/speed.py")
    ap.add_argument("--out", type=Path, required=True, help="folder for speed_tables.md and the plots")
    args = ap.parse_args(argv)
    res = json.loads(args.results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    res["targets"] = evaluate_targets(res)
    plot(res, args.out)
    print(write_tables(res, args.out))


if __name__ == "__main__":
    main()
