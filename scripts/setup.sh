#!/usr/bin/env bash
# One-time set-up on a fresh machine (no GPU, no Hub needed): a virtualenv in .venv with the
# CPU build of PyTorch and hf_rfa installed in editable mode with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "WARNING: Location" || true
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "WARNING: Location" || true
# the optional compiled CPU kernel (g++ and ninja; about a minute once, cached): built now rather
# than inside the first attention call. Its absence is not an error (the PyTorch path is used).
.venv/bin/python -m hf_rfa.ops.backends.native || true
.venv/bin/python -c "import torch, transformers, hf_rfa; print('ready: torch', torch.__version__, 'transformers', transformers.__version__, 'hf_rfa', hf_rfa.__version__)"
