"""Issue 13 probe (session 13): cheaper or better attention transfer at the main job's budget.

Runs ``conversion/convert.py`` with ``make main``'s flags (``conversion/main_job.py`` DEFAULT)
without the window-only baselines and copy/passkey (they do not depend on the transfer: rows of run
``smollm2_main_job_s11``), plus the flags given after ``--`` (e.g. ``--transfer-schedule cosine``,
``--transfer-query-blocks 2``, ``--lora-tokens 0`` to stop after the transfer's rows). Appends one
JSON line (flags, stages, perplexity rows) to ``transfer_schedule.jsonl``.

    PYTHONPATH=. NT=2 .venv/bin/python experiments/issue13/transfer_schedule.py --output /tmp/ts1 -- --transfer-schedule cosine --lora-tokens 0
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "conversion"))

argv = sys.argv[1:]
extra = argv[argv.index("--") + 1 :] if "--" in argv else []
argv = argv[: argv.index("--")] if "--" in argv else argv
p = argparse.ArgumentParser()
p.add_argument("--output", required=True)
p.add_argument("--jsonl", default=str(Path(__file__).with_name("transfer_schedule.jsonl")))
a = p.parse_args(argv)
torch.set_num_threads(int(os.environ.get("NT", "2")))

import convert  # noqa: E402
import main_job  # noqa: E402

drop = {"--baseline-windows", "--copy-gaps", "--copy-draws", "--passkey-lengths", "--passkey-trials"}
drop |= {x for x in extra if x.startswith("--")}
args = main_job.without(main_job.DEFAULT, drop) + extra + ["--no-window-only-baseline"] + main_job.asset_args(a.output)
print(" ".join(args), flush=True)
convert.main(args)
rep = json.loads((Path(a.output) / "report.json").read_text())
rows: dict = {}
for r in rep["rows"]:
    if "perplexity" in r:
        rows.setdefault(r["variant"], {})[f"ppl@{r['context']}"] = round(r["perplexity"], 3)
line = {"probe": "transfer_schedule.py -- " + " ".join(extra), "stages": rep.get("stages"), "rows": rows}
with open(a.jsonl, "a") as f:
    f.write(json.dumps(line) + "\n")
print(json.dumps(line, indent=1))
