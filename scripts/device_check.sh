#!/usr/bin/env bash
# The GPU device check (at most 8 minutes on one H200: every step has its own time limit): the suite's CUDA tests, then
# benchmarks/device_check.py (twin errors of each GPU backend in fp32 and bf16, one SmolLM2-shaped
# layer and the whole model vs SDPA, decoding tokens/s). Markdown tables go into OUTDIR.
#
#     scripts/device_check.sh OUTDIR [--cpu-smoke]
#
# Set-up on a bare machine that has PyTorch with CUDA: hf_rfa is used from this checkout
# (PYTHONPATH; no install needed); fla-core, for the `fla` backend, is installed when missing from
# $FLA_WHEELS (a folder of wheels) or the package index, if either is reachable — otherwise the
# fla rows say it is not installed. Every step is time-limited and a failed step is recorded in
# OUTDIR/summary.md; the script still exits 0 once OUTDIR is written. The limits can be set from the
# environment: CUDA_TESTS_SECONDS (170), BENCH_SECONDS (250) and BENCH_BUDGET (190, the benchmarks'
# own budget after which their remaining rows are skipped).
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: scripts/device_check.sh OUTDIR [--cpu-smoke]" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd) || { echo "cannot write $1" >&2; exit 1; }
shift
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
{
  echo "# Device check"
  echo
  $PY -c "import torch; print('Device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'); print(); print('torch', torch.__version__)"
} >"$SUMMARY" 2>&1

step() {  # step NAME SECONDS COMMAND...: run, log to OUTDIR/NAME.log, note the outcome
  local name=$1 secs=$2
  shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local how="ok"
  [ $rc -eq 124 ] && how="failed: over its ${secs} s limit"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && how="failed: exit $rc (see $name.log)"
  echo "- $name: $how ($((SECONDS - t0)) s)" >>"$SUMMARY"
}

if [ "${1:-}" != "--cpu-smoke" ]; then
  if ! $PY -c "import fla" 2>/dev/null; then
    if [ -n "${FLA_WHEELS:-}" ]; then
      step install_fla 60 $PY -m pip install -q --no-deps --no-index --find-links "$FLA_WHEELS" fla-core
    else
      step install_fla 60 $PY -m pip install -q --no-deps --retries 0 --timeout 5 fla-core
    fi
  fi
  $PY -c "import fla" 2>/dev/null && echo "- fla-core: installed" >>"$SUMMARY" || echo "- fla-core: not installed (the fla rows say so)" >>"$SUMMARY"
  # a test module whose optional imports (lm_eval, evaluate, ...) are missing here must not stop the CUDA tests
  step cuda_tests "${CUDA_TESTS_SECONDS:-170}" $PY -m pytest tests -m cuda -q -p no:cacheprovider --continue-on-collection-errors
  tail -n 3 "$OUT/cuda_tests.log" | sed 's/^/    /' >>"$SUMMARY"
fi
step benchmarks "${BENCH_SECONDS:-250}" $PY benchmarks/device_check.py --out "$OUT" --budget "${BENCH_BUDGET:-190}" "$@"
echo "device check: tables in $OUT"
exit 0
