"""Optional compiled CPU kernels for causal inference (``causal_cpu.cpp``, one extension).

- :func:`causal_positive`: the whole causal scan of a FAVOR+/positive/FAVOR++ feature map in C++:
  one task per (batch, key/value head), chunk after chunk on cache-resident buffers, with MKL's
  ``sgemm`` and ``vsExp`` (linked into PyTorch's x86 builds) and no per-op dispatch. Same chunkwise
  math as the pure-PyTorch inference form (``scan._causal_scan_into`` with
  ``causal_infer.causal_block_into``), which stays its reference twin.
- :func:`causal_band`: the exact part of a causal hybrid (local window + sinks), one task per
  (batch, key/value head, query chunk); twin of ``hybrid.exact_local``. Used for every feature
  map, since it does not involve features.

Both are tested against their twins in ``tests/ops/test_native.py``; speed in
``benchmarks/results/speed.md``.

It is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja, ~1 min, cached
under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``; ``scripts/setup.sh`` builds it
ahead) and used only when

- it is enabled: :func:`set_native` or the environment variable ``HF_RFA_NATIVE`` (``1``/``0``;
  default on), and the opt-in ``torch.compile`` kernels (``hf_rfa.set_compile``) are off,
- no autograd graph is recorded, tensors are on the CPU and computed in float32 (bf16/fp16 inputs
  are read as they are and converted chunk by chunk),
- it compiled and this PyTorch build exports ``sgemm`` (x86 builds with MKL).

With fewer (batch × kv head) scans than 2 × threads, :func:`causal_positive` splits each scan into
segments (their state increments first, in parallel, then every segment from its incoming state),
so a model with few kv heads still uses every thread.

Anything else (no compiler, a build error, GPUs, training) takes the PyTorch path; a failed build is
logged once as a warning and not retried in the process. The build folder must be private, a
library is loaded only when verified, and waiting for another process's build times out
(:mod:`.build`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import kernels
from .... import compat
from . import build

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("causal_cpu.cpp")
_STATE: dict = {"enabled": os.environ.get("HF_RFA_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off"), "module": None, "failed": None}
_LOCK = threading.Lock()


def set_native(enabled: bool) -> None:
    """Use (True, the default) or bypass (False) the compiled CPU kernel in this process."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}")
    _STATE["enabled"] = enabled


def native_enabled() -> bool:
    """Whether :func:`set_native` / ``HF_RFA_NATIVE`` allow the compiled kernel."""
    return _STATE["enabled"]


#: compiler and linker flags of the build (part of the build key)
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def _torch_dir() -> str:
    """The folder PyTorch is installed in (its headers, which the build includes, are there)."""
    return str(Path(torch.__file__).resolve().parent)


def _build_name() -> str:
    """Extension name keyed on the source, the PyTorch version and installation folder, the flags
    and the CPU (built with ``-march=native``: a cache shared between different CPUs must not reuse
    a binary). Identical sources share one build whichever checkout they come from; different ones
    coexist. The installation folder is in the key because the build's include paths name it:
    two virtual environments sharing one build folder would otherwise rebuild it each time the
    other one had loaded it (about a minute each)."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_torch_dir().encode())
    h.update(" ".join(CFLAGS + ("|",) + LDFLAGS).encode())
    h.update(platform.machine().encode())
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    h.update(flags.encode())
    return f"hf_rfa_native_{h.hexdigest()[:12]}"


def _ninja_on_path() -> bool:
    """torch's builder runs ``ninja`` from PATH; a pip-installed ninja (``pip install ninja``,
    in the test extras) lives next to the interpreter, which is not on PATH when a venv's python is
    run directly: add its folder."""
    if shutil.which("ninja"):
        return True
    for folder in (os.path.dirname(sys.executable), getattr(_import_ninja(), "BIN_DIR", None)):
        if folder and os.path.exists(os.path.join(folder, "ninja")):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return True
    return False


def _import_ninja():
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return None
    return ninja


def _staged_source(name: str) -> Path:
    """The source copied into the build folder: the build then names the same path from every
    checkout, so torch/ninja see no change and never rebuild when another checkout loads it."""
    staged = compat.extension_build_dir(name) / _SOURCE.name
    data = _SOURCE.read_bytes()
    if not staged.is_file() or staged.read_bytes() != data:
        tmp = staged.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, staged)
    return staged


def load(verbose: bool = False):
    """The compiled module (built on first call), or None when it cannot be built or used here."""
    if _STATE["module"] is not None or _STATE["failed"] is not None:
        return _STATE["module"]
    with _LOCK:
        if _STATE["module"] is None and _STATE["failed"] is None:
            if not _SOURCE.is_file():  # e.g. the remote code of an export: no C++ source shipped
                _STATE["failed"] = f"{_SOURCE.name} not present"
                logger.debug("hf_rfa: %s not present; using the PyTorch path", _SOURCE.name)
                return None
            try:
                from torch.utils.cpp_extension import load as _load

                if not _ninja_on_path():
                    raise RuntimeError("ninja not found (pip install ninja)")
                name = _build_name()
                folder = compat.extension_build_dir(name)
                build.check_folder(folder)
                with build.build_lock(folder, build.lock_timeout()):
                    build.drop_unverified(folder)
                    logger.info("hf_rfa: loading the native CPU kernel %s (built once, about a minute)", name)
                    mod = _load(
                        name=name,
                        sources=[str(_staged_source(name))],
                        extra_cflags=list(CFLAGS),
                        extra_ldflags=list(LDFLAGS),
                        build_directory=str(folder),
                        verbose=verbose,
                    )
                    build.record(folder, Path(mod.__file__))
                if not mod.available():
                    raise RuntimeError("this PyTorch build exports no sgemm (no MKL)")
                _STATE["module"] = mod
            except Exception as e:  # noqa: BLE001 - any build/load problem means: use the PyTorch path
                _STATE["failed"] = f"{type(e).__name__}: {e}"
                logger.warning("hf_rfa: native CPU kernel unavailable, using the PyTorch path (%s)", str(e).splitlines()[0] if str(e) else type(e).__name__)
    return _STATE["module"]


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a call on ``device`` computing in ``dtype`` would run the compiled kernel (builds it
    on first use). Not while the opt-in ``torch.compile`` kernels (:mod:`.kernels`) are on: those
    then take the PyTorch forms they compile."""
    if not _STATE["enabled"] or device.type != "cpu" or dtype != torch.float32 or torch.compiler.is_compiling() or kernels.compile_enabled():
        return False
    return load() is not None


def _inputs(xq: torch.Tensor, xk: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None):
    """``(module, xq, xk, v, key_mask)`` as the kernels take them: unit inner stride, one dtype,
    the mask as a bool tensor (empty when None)."""
    mod = load()
    if mod is None:
        raise RuntimeError(f"hf_rfa native kernel unavailable: {_STATE['failed']}")
    xq, xk, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (xq, xk, v))
    if not (xq.dtype == xk.dtype == v.dtype):
        xk, v = xk.to(xq.dtype), v.to(xq.dtype)
    km = key_mask.to(torch.bool).contiguous() if key_mask is not None else torch.empty(0, dtype=torch.bool)
    return mod, xq, xk, v, km


@dataclass(frozen=True)
class KernelRun:
    """How a kernel runs a call: the query ``chunk`` length, the exponent ``floor`` (no exp below
    it), and for :func:`causal_positive` ``eps`` (normalise the output with this floor of the
    denominator; None: return numerator and denominator) and ``segments`` (see there)."""

    chunk: int
    floor: float
    eps: float | None = None
    segments: int = 0


def causal_positive(
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor | None, float, float],
    keys: tuple[torch.Tensor | None, torch.Tensor | None],
    state: tuple[torch.Tensor, torch.Tensor],
    run: KernelRun,
    dest: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the kernel. ``xq [B,H,N,D]``, ``xk [B,Hkv,N,D]``, ``v [B,Hkv,N,Dv]`` (float32, bfloat16
    or float16; raw, the map's ``params = (W [F,D], bias [F] | None, coef, c0)`` hold the scale):
    features ``exp(x Wᵀ + bias − max)`` with log scale ``max + coef·‖x‖² + c0``. ``keys =
    (key_mask [B,N] bool, lk_add [B,Hkv,N])`` (each or None); ``state = (S [B,Hkv,F,Dv+1], ref
    [B,Hkv])`` (float32, contiguous) is the incoming state and is updated in place; ``run``: the
    chunk length, exponent floor, ``eps`` and ``segments`` (:class:`KernelRun`).

    Returns ``(out, mt, lq)``: with ``eps``, ``out [B,H,N,Dv]`` normalised and ``mt = lq = None``;
    without, ``out [B,H,N,Dv+1]`` (numerator, denominator), ``mt [B,Hkv,N]`` (running key max) and
    ``lq [B,H,N]`` (query log scales): the output's log scale is ``mt + lq``. ``dest``: a
    contiguous float32 tensor of ``B·H·N·Dv`` elements to write the normalised output into.
    ``run.segments``: split each scan into this many segments (0: automatic — one per scan when there
    are at least 2 × threads scans, else enough for 2 × threads parallel pieces). The segments'
    state increments are computed in parallel first (keys only), combined in order, then every
    segment runs from its incoming state: more parallelism for few kv heads, at the cost of the
    keys' features and state products twice.
    """
    (key_mask, lk_add), (S, ref), eps = keys, state, run.eps
    mod, xq, xk, v, km = _inputs(xq, xk, v, key_mask)
    b, h, n, _ = xq.shape
    hkv, dv = xk.shape[1], v.shape[-1]
    W, bias, coef, c0 = params
    f32 = {"dtype": torch.float32, "device": xq.device}
    empty = torch.empty(0, **f32)
    la = lk_add.to(torch.float32).contiguous() if lk_add is not None else empty
    bias_t = bias.to(torch.float32).contiguous() if bias is not None else empty
    if eps is not None:
        usable_dest = dest is not None and dest.dtype == torch.float32 and dest.is_contiguous() and dest.numel() == b * h * n * dv
        out, mt, lq = (dest if usable_dest else torch.empty(b, h, n, dv, **f32)), empty, empty
    else:
        out, mt, lq = torch.empty(b, h, n, dv + 1, **f32), torch.empty(b, hkv, n, **f32), torch.empty(b, h, n, **f32)
    mod.causal_positive(xq, xk, v, W.to(torch.float32).contiguous(), bias_t, float(coef), float(c0), km, la, S, ref, int(run.chunk), -1.0 if eps is None else float(eps), float(run.floor), out, mt, lq, int(run.segments))
    if eps is not None and dest is not None and out is not dest:
        out = dest.copy_(out.view(dest.shape))
    return out, (mt if eps is None else None), (lq if eps is None else None)


def causal_band(
    xq: torch.Tensor,
    xk: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None,
    window: int,
    sinks: tuple[torch.Tensor | None, torch.Tensor | None] | None,
    run: KernelRun,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact part of a causal hybrid (twin of ``hybrid.exact_local`` with ``causal=True``): query t
    sees keys t−W < s ≤ t that are real (``key_mask [B,N]`` bool) and the sinks ``sinks =
    (sink_pos [B,S] int64, sink_ok [B,S] whether each exists)`` (or None) at positions ≤ t − W,
    with scores ``scale·q·k``, in chunks of ``run.chunk`` queries with exponents floored at
    ``run.floor``. ``xq [B,H,N,D]``, ``xk [B,Hkv,N,D]``, ``v [B,Hkv,N,Dv]`` raw
    (float32/bfloat16/float16).

    Returns float32 ``(num [B,H,N,Dv], den [B,H,N], ls [B,H,N])``: the Partial with each row's
    max visible score as log scale (NEG where nothing is visible).
    """
    sink_pos, sink_ok = sinks if sinks is not None else (None, None)
    mod, xq, xk, v, km = _inputs(xq, xk, v, key_mask)
    b, h, n, _ = xq.shape
    dv = v.shape[-1]
    f32 = {"dtype": torch.float32, "device": xq.device}
    num, den, ls = torch.empty(b, h, n, dv, **f32), torch.empty(b, h, n, **f32), torch.empty(b, h, n, **f32)
    sp = sink_pos.to(torch.int64).contiguous() if sink_pos is not None else torch.empty(0, dtype=torch.int64)
    so = sink_ok.to(torch.bool).contiguous() if sink_ok is not None else torch.empty(0, dtype=torch.bool)
    mod.causal_band(xq, xk, v, float(scale), km, int(window), sp, so, int(run.chunk), float(run.floor), num, den, ls)
    return num, den, ls


def main() -> None:
    """``python -m hf_rfa.ops.backends.native``: build the kernel now (set-up scripts) and report."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mod = load()
    print("hf_rfa native CPU kernel:", "ready" if mod is not None else f"unavailable ({_STATE['failed']})")


if __name__ == "__main__":
    main()
