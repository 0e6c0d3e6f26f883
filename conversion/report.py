"""Render the results page (``docs/results.md``) from the ``report.json`` of conversion runs.

    python conversion/report.py [LABEL=]RUN [[LABEL=]RUN ...] [--out docs/results.md] [--note TEXT | --note @FILE]

Each RUN is an output folder of ``conversion/convert.py`` / ``main_job.py`` or a copy of its
``report.json``. The repository keeps those of the current runs in ``conversion/results/runs/``,
named ``<model>-<preset>_v<version>.json``; ``python conversion/report.py --docs`` regenerates
``docs/results.md`` from them and ``conversion/results/NOTE.md`` (a test checks that it does, byte
for byte). A summary table of every run's final
variant comes first. For every run
the table lists every variant measured (context, perplexity and its ratio to the original, or
embedding cosine / accuracy), the evaluation tokens, and the tokens and minutes of training, then
the per-layer error summary, the generation sample and the command that reproduces the run.
A figure that carries its 95% confidence interval (``perplexity_ci95`` of a row, ``second_ci95`` of
a copy gap, ``mean_ci95`` of a passkey length; :mod:`hf_rfa.recipes.intervals`) is shown as
``value [lo, hi]``, and "× original" with its interval paired over the windows both rows read
(from the rows' ``window_nll``); reports written before the intervals existed show the value alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex

#: the committed runs, the page's introduction and the page, relative to the repository root
RUNS_GLOB = os.path.join("conversion", "results", "runs", "*.json")
NOTE_FILE = os.path.join("conversion", "results", "NOTE.md")
DOCS_PAGE = os.path.join("docs", "results.md")
DOCS_COMMAND = "python conversion/report.py --docs"


_FLAGS = [
    "feature_map", "num_features", "window", "sinks", "transfer_tokens", "transfer_minutes", "lora_tokens", "lora_minutes",
    "calibration_text", "train_text", "eval_text", "context", "lora_context", "eval_tokens", "error_tokens", "eval_sentences",
    "random_num_features", "transfer_queries", "transfer_lr", "lora_lr", "eval_twin_max", "seed", "copy_draws", "passkey_trials",
]


_NOT_REPRODUCED = {"model", "output", "overwrite", "progress", "push_to_hub", "eval_contexts", *_FLAGS}


def _parser_defaults() -> dict:
    """``dest -> (default, is_bool)`` of every ``conversion/convert.py`` flag."""
    from hf_rfa.cli import convert_parser

    out = {}
    for a in convert_parser()._actions:
        if a.dest == "help" or not a.option_strings or type(a).__name__ == "_StoreFalseAction":
            continue
        out[a.dest] = (a.default, a.nargs == "?")
    return out


def _quote(arg: str) -> str:
    """``shlex.quote``, leaving a leading ``~/`` (a path under the home folder) for the shell to expand."""
    return "~/" + shlex.quote(arg[2:]) if arg.startswith("~/") else shlex.quote(arg)


def _current_keys(cfg: dict) -> dict:
    """A run's config in today's flags: runs that recorded ``hybrid_mix`` (the command line then added
    that option to Hedgehog hybrids) carry it in ``feature_map_options``, where presets put it now."""
    cfg = dict(cfg)
    if cfg.pop("hybrid_mix", False) and cfg.get("feature_map") == "hedgehog" and (cfg.get("window") or cfg.get("sinks")):
        cfg["feature_map_options"] = {**(cfg.get("feature_map_options") or {}), "hybrid_mix": True}
    return cfg


def command_of(cfg: dict) -> str:
    """The ``conversion/convert.py`` command line that reproduces a run's config: the main flags
    always, every other flag whose value differs from today's default (nothing a run set is lost)."""
    cfg = _current_keys(cfg)
    parts = ["python", "conversion/convert.py", "--model", cfg["model"], "--output", cfg["output"]]
    for k in _FLAGS:
        v = cfg.get(k)
        if v is not None:
            parts += [f"--{k.replace('_', '-')}", str(v)]
    parts += ["--eval-contexts", *map(str, cfg["eval_contexts"])]
    for k, (default, is_bool) in _parser_defaults().items():
        if k in _NOT_REPRODUCED or k not in cfg:
            continue
        v, flag = cfg[k], f"--{k.replace('_', '-')}"
        if k == "feature_map_options":
            if v != json.loads(default or "{}"):
                parts += [flag, json.dumps(v, sort_keys=True)]
        elif k == "layers":
            if v:
                parts += [flag, ",".join(map(str, v))]
        elif is_bool:
            if bool(v) != bool(default):
                parts.append(flag if v else f"--no-{k.replace('_', '-')}")
        elif isinstance(v, (list, tuple)):
            if list(v) != list(default or []):
                parts += [flag, *map(str, v)]
        elif v is not None and v != default:
            parts += [flag, str(v)]
    return " ".join(_quote(p) for p in parts)


def _with_ci(value: float, ci: list | None, percent: bool = False) -> str:
    """``value [lo, hi]`` (two decimals, or whole percents), the value alone without an interval."""
    if percent:
        return f"{value:.0%}" + (f" [{ci[0]:.0%}, {ci[1]:.0%}]" if ci else "")
    return f"{value:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def _ratio(rep: dict, row: dict, ratio: float) -> str:
    """``× original`` of a row, with its paired interval over the windows both read where the report
    keeps the windows' sums (none for the original's own rows)."""
    from hf_rfa.recipes.intervals import paired_ratio_ci

    ref = next((r for r in rep["rows"] if r["variant"].startswith("original") and r.get("context") == row.get("context")), None)
    ci = paired_ratio_ci(row, ref, rep.get("config", {}).get("seed", 0)) if ref is not None and ref is not row else None
    return f"{ratio:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _minutes(r: dict) -> str:
    return f"{r['train_minutes']:.1f}" if "train_minutes" in r else ""


def _op(r: dict) -> str:
    return "sdpa" if r["variant"].startswith("original") else r.get("op", "chunked op")


def run_table(rep: dict) -> str:
    rows = rep["rows"]
    orig = {r.get("context"): r.get("perplexity") for r in rows if r["variant"].startswith("original")}
    if rep["kind"] == "causal-lm":
        head = "| variant | context | perplexity | × original | eval tokens | train tokens | train minutes | op |\n|---|---|---|---|---|---|---|---|"
        lines = [head]
        for r in rows:
            ratio = r["perplexity"] / orig[r["context"]] if orig.get(r["context"]) else float("nan")
            lines.append(
                f"| {r['variant']} | {r['context']} | {_with_ci(r['perplexity'], r.get('perplexity_ci95'))} | {_ratio(rep, r, ratio)} | {r['eval_tokens']} | "
                f"{r.get('train_tokens', '')} | {_minutes(r)} | {_op(r)} |"
            )
        return "\n".join(lines)
    head = "| variant | mean cosine | min cosine | accuracy | sentences | train tokens | train minutes |\n|---|---|---|---|---|---|---|"
    lines = [head]
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if "accuracy" in r else ""
        lines.append(
            f"| {r['variant']} | {r['cosine_mean']:.4f} | {r['cosine_min']:.4f} | {acc} | {r.get('sentences', '')} | "
            f"{r.get('train_tokens', '')} | {_minutes(r)} |"
        )
    return "\n".join(lines)


def long_range_table(rep: dict) -> str:
    """One row per variant: perplexity at every context, copy (second / first copy) at every gap,
    passkey accuracy at every length (empty where a variant was not measured)."""
    rows = [r for r in rep["rows"] if "context" in r]
    lr = {e["variant"]: e for e in rep.get("long_range", [])}
    variants = list(dict.fromkeys([r["variant"] for r in rows] + list(lr)))
    ctxs = sorted({r["context"] for r in rows})
    gaps = sorted({int(g) for e in lr.values() for g in e.get("copy", {})})
    lens = sorted({int(n) for e in lr.values() for n in ((e.get("passkey") or {}).get("mean") or {})})
    head = ["variant"] + [f"ppl @{c}" for c in ctxs] + [f"copy @{g}: 2nd (1st)" for g in gaps] + [f"passkey @{n}" for n in lens]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        ppl = {r["context"]: r for r in rows if r["variant"] == v}
        e = lr.get(v, {})
        cells = [v] + [_with_ci(ppl[c]["perplexity"], ppl[c].get("perplexity_ci95")) if c in ppl else "" for c in ctxs]
        for g in gaps:
            c = e.get("copy", {}).get(str(g))
            cells.append(f"{_with_ci(c['second'], c.get('second_ci95'))} ({c['first']:.1f})" if c else "")
        cells += [_passkey_cell(e.get("passkey") or {}, str(n)) for n in lens]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _passkey_cell(pk: dict, n: str) -> str:
    """Exact-match passkey accuracy at length ``n``, with the key accuracy (where a run measured it)
    in brackets where it differs; empty where not measured."""
    exact, key = (pk.get("mean") or {}).get(n), (pk.get("key_mean") or {}).get(n)
    if exact is None:
        return ""
    ci, key_ci = (pk.get("mean_ci95") or {}).get(n), (pk.get("key_mean_ci95") or {}).get(n)
    return _with_ci(exact, ci, percent=True) + (f" (key {_with_ci(key, key_ci, percent=True)})" if key is not None and key != exact else "")


def _has_intervals(rep: dict) -> bool:
    """Whether a report carries intervals (runs written before them do not)."""
    return any(r.get("perplexity_ci95") for r in rep.get("rows", [])) or any(
        c.get("second_ci95") for e in rep.get("long_range", []) for c in e.get("copy", {}).values())


def load_run(spec: str) -> tuple[str, dict]:
    """``[LABEL=]PATH`` → (label, report); PATH is a run folder or a report.json file."""
    label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    file = os.path.join(path, "report.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"run {spec!r}: no report.json at {file}")
    with open(file, encoding="utf-8") as f:
        rep = json.load(f)
    if not label:
        base = os.path.basename(os.path.normpath(path))
        label = base[: -len(".json")] if base.endswith(".json") else base
    return label, rep


def baseline_variant(rep: dict) -> str | None:
    """The run's window-only baseline at the same window, sinks (and memory) and training budget:
    ``report["baseline_variant"]`` where the report names it, else, for older reports, the last row
    named ``window-only: window W + sinks S…`` with the run's own W and S (None: not measured)."""
    if "baseline_variant" in rep:
        return rep["baseline_variant"]
    cfg = rep.get("config", {})
    rfa = cfg.get("rfa", cfg)  # older reports: the RFA fields at the top level
    if not (rfa.get("window") or rfa.get("sinks")):
        return None
    head = f"window-only: window {rfa.get('window')} + sinks {rfa.get('sinks')}"
    names = [r["variant"] for r in rep["rows"] if r["variant"] == head or r["variant"].startswith((head + " ", head + ","))]
    return names[-1] if names else None


def summary_table(runs: list[tuple[str, dict]]) -> str:
    """One row per run and context: the run's last (most trained) variant against the original, and
    its window-only baseline (:func:`baseline_variant`; "not measured" where the run has none)."""
    lines = [
        "| run | final variant | context | perplexity | × original | window-only, same budget | train tokens | train minutes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    enc = ["| run | final variant | mean cosine | window-only, same budget | accuracy | train tokens | train minutes |", "|---|---|---|---|---|---|---|"]
    for label, rep in runs:
        rows = rep["rows"]
        base = baseline_variant(rep)
        if rep["kind"] == "causal-lm":
            orig = {r["context"]: r["perplexity"] for r in rows if r["variant"].startswith("original")}
            wo = {r["context"]: r for r in rows if r["variant"] == base}
            last = {}
            for r in rows:
                if not r["variant"].startswith("original"):
                    last[r["context"]] = r
            for ctx, r in sorted(last.items()):
                ratio = _ratio(rep, r, r["perplexity"] / orig[ctx] if orig.get(ctx) else float("nan"))
                b = _with_ci(wo[ctx]["perplexity"], wo[ctx].get("perplexity_ci95")) if ctx in wo else "not measured"
                lines.append(f"| {label} | {r['variant']} | {ctx} | {_with_ci(r['perplexity'], r.get('perplexity_ci95'))} | {ratio} | {b} | {r.get('train_tokens', 0)} | {_minutes(r) or '0'} |")
        else:
            r = [x for x in rows if not x["variant"].startswith("original")][-1]
            acc = f"{r['accuracy']:.3f}" if "accuracy" in r else ""
            b = next((f"{x['cosine_mean']:.4f}" for x in rows if x["variant"] == base), "not measured")
            enc.append(f"| {label} | {r['variant']} | {r['cosine_mean']:.4f} | {b} | {acc} | {r.get('train_tokens', 0)} | {_minutes(r) or '0'} |")
    out = "\n".join(lines)
    if len(enc) > 2:
        out += "\n\n" + "\n".join(enc)
    return out


def render(specs: list[str], note: str = "", command: str | None = None) -> str:
    """The Markdown of the results page; ``command``: the command line recorded in its header
    (default: the one that renders ``specs`` with ``note``)."""
    runs = [load_run(s) for s in specs]
    cmd = command or "python conversion/report.py " + " ".join(specs) + (" --note ..." if note else "")
    out = ["# Conversion results", "", f"Generated by `{cmd}` from the runs' `report.json`.", ""]
    if note:
        out += [note, ""]
    out += ["## Summary (final variant of every run)", "", summary_table(runs), ""]
    for label, rep in runs:
        cfg = rep["config"]
        out += [f"## {label}: `{cfg['model']}` ({rep['kind']})", ""]
        out += [run_table(rep), ""]
        if rep.get("long_range"):
            out += ["Long range (copy: perplexity of the second copy of a 256-token passage, first copy in brackets, "
                    "mean over the run's seeded draws; passkey: greedy exact-match accuracy, mean over depths 10/50/90%; \"key\": the same trials without the answer's leading space token, shown where it differs"
                    + ("; [lo, hi]: 95% bootstrap interval over windows / draws / trials" if _has_intervals(rep) else "") + "):", "", long_range_table(rep), ""]
        st = rep.get("stages", {})
        for name, s in st.items():
            out.append(f"- {name}: {s['tokens']} tokens, {s['steps']} steps, {s['minutes']:.1f} min, loss {s['loss_first']:.4g} → {s['loss_last']:.4g}")
        if "layer_errors" in rep:
            means = {k: sum(e["relative_error"] for e in v) / len(v) for k, v in rep["layer_errors"].items()}
            out.append("- mean per-layer attention-output error vs softmax: " + "; ".join(f"{k}: {v:.3f}" for k, v in means.items()))
        if "text_tokens" in rep:
            out.append(f"- text tokens: {rep['text_tokens']}")
        if "generation" in rep:
            g = rep["generation"]
            out.append(f"- greedy generation after {g['prompt']!r}: {g['text']!r}")
        m = rep.get("machine")  # reports of older runs do not name it
        where = f" ({m.get('gpu') or m['cpu']}, {m['threads']} threads)" if m else ""
        out.append(f"- wall time of the whole run: {rep.get('minutes_total', float('nan')):.1f} min{where}")
        out += ["", "```", rep.get("command") or command_of(cfg), "```", ""]
    return "\n".join(out)


def docs_page(root: str = ".") -> str:
    """``docs/results.md``: every committed run (:data:`RUNS_GLOB`, sorted) under the introduction
    of :data:`NOTE_FILE`, read from the repository at ``root``."""
    specs = sorted(glob.glob(os.path.join(root, RUNS_GLOB)))
    if not specs:
        raise ValueError(f"no committed runs match {os.path.join(root, RUNS_GLOB)}")
    with open(os.path.join(root, NOTE_FILE), encoding="utf-8") as f:
        note = f.read().strip()
    return render(specs, note, DOCS_COMMAND) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run folders or report.json files, each optionally LABEL=PATH")
    p.add_argument("--docs", action="store_true", help=f"regenerate {DOCS_PAGE} from the committed runs (run from the repository root)")
    p.add_argument("--out", default=None, help=f"markdown file to write (default: {DOCS_PAGE} with --docs, else stdout only)")
    p.add_argument("--note", default="", help="markdown paragraph after the title (or @FILE)")
    a = p.parse_args(argv)
    if a.docs == bool(a.runs):
        p.error("give either RUN paths or --docs")
    if a.docs:
        text, out = docs_page(), a.out or DOCS_PAGE
    else:
        note = a.note
        if note.startswith("@"):
            with open(note[1:], encoding="utf-8") as f:
                note = f.read().strip()
        text, out = render(a.runs, note) + "\n", a.out
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
