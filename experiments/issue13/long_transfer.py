"""Issue 13 probe (session 11): does attention transfer at a long context let the recipe beat the
equal-state window (window-only W128 + the same LoRA)?

Runs ``conversion/convert.py`` with ``make main``'s flags (``conversion/main_job.py`` DEFAULT)
except: attention transfer at ``--context`` (default 4096) instead of 1024, no window-only
baselines (they do not depend on the transfer: take them from run ``smollm2_main_job_s11``, whose
LoRA — 32,768 tokens @4096, stream seed 7 — is the one used here too), no copy/passkey. The
recipe's rows are comparable with that run's W128 + LoRA row (20.57 / 14.00 / 14.66).

    PYTHONPATH=. NT=2 .venv/bin/python experiments/issue13/long_transfer.py --output /tmp/lt4096
"""
import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "conversion"))

p = argparse.ArgumentParser()
p.add_argument("--context", default="4096")
p.add_argument("--transfer-tokens", default="131072")
p.add_argument("--output", required=True)
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))

import convert  # noqa: E402
import main_job  # noqa: E402

drop = {"--baseline-windows", "--copy-gaps", "--copy-draws", "--passkey-lengths", "--passkey-trials", "--context", "--transfer-tokens"}
args = main_job.without(main_job.DEFAULT, drop) + [
    "--context", a.context, "--transfer-tokens", a.transfer_tokens, "--no-window-only-baseline",
] + main_job.asset_args(a.output)
print(" ".join(args), flush=True)
convert.main(args)
