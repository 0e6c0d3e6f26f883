"""Speed and memory of ``hf_rfa.random_feature_attention`` against PyTorch's SDPA.

One command::

    .venv/bin/python benchmarks/speed.py            # full run (N = 256 … 65536)
    .venv/bin/python benchmarks/speed.py --quick    # N ≤ 4096, fewer repetitions
    .venv/bin/python benchmarks/speed.py --max-n 16384 --device cuda

Measures, for B=1, H=12, d=64, favor+ with m ∈ {64, 256}, fp32 and bf16, causal and
bidirectional, forward and forward+backward:

- wall time: hf_rfa and ``torch.nn.functional.scaled_dot_product_attention`` are run
  *alternately* in the same process (rfa, sdpa, rfa, sdpa, …) and the median of the repetitions
  is reported. SDPA sizes whose predicted time (from the previous N, ×4 per doubling) exceeds
  ``--sdpa-limit-s`` are skipped and marked as such.
- peak extra memory (``--mem-n`` sizes): each case runs once in a fresh subprocess; on CPU the
  number is the process's peak resident set size during the call minus its
  resident set size just before the call (inputs already allocated, kernels warmed up on a tiny
  problem; the peak counter VmHWM is reset just before the call), i.e. everything the call allocated at its high-water mark, including the output and,
  for forward+backward, the gradients of q, k, v. On CUDA it is
  ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
- the machine's matmul throughput (fp32, bf16; square matmuls) in the same run, and the fraction
  of the fp32 throughput that hf_rfa's causal forward reaches, counting the FLOPs of
  :func:`rfa_causal_flops` (formula in its docstring).

Writes ``speed_tables.md``, ``speed_results.json`` and ``speed_*.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

import hf_rfa
from hf_rfa.ops.backends import native

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed_report import B, D, H, evaluate_targets, plot, write_tables  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
def rfa_causal_flops(n: int, m: int, d: int = D, dv: int = D, heads: int = H, batch: int = B, chunk: int = 64, block: int = 512, native: bool = False) -> float:
    """FLOPs of hf_rfa's causal favor+ forward (multiply-add = 2 FLOPs), F = m features:

    per head and token: features 2·(2·d·m) (q and k projections) + intra-chunk 2·C·F (scores,
    full C×C tile) + 2·C·(Dv+1) (tile × [v, 1]) + inter-chunk 2·F·(Dv+1) (queries × prefix state)
    + state increments 2·F·(Dv+1) (φ(k)ᵀ [v, 1]); the PyTorch form (``native=False``) also
    combines chunk states per block: 2·L·F·(Dv+1)/C (the [L, L] decay matrix × chunk
    increments, L = block/C chunks per block), the compiled kernel carries the state chunk by
    chunk instead. Elementwise work (exp, max, scaling) is not counted.
    """
    f, c = m, chunk
    lpb = 0 if native else max(1, block // c)
    per_tok = 4 * d * m + 2 * c * f + 2 * c * (dv + 1) + 4 * f * (dv + 1) + 2 * lpb * f * (dv + 1) / c
    return float(per_tok) * n * heads * batch


def sdpa_flops(n: int, causal: bool, d: int = D, heads: int = H, batch: int = B) -> float:
    """Useful FLOPs of exact attention: 4·N²·d per head (QKᵀ and PV), halved when causal."""
    return 4.0 * n * n * d * heads * batch * (0.5 if causal else 1.0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_throughput(dtype: torch.dtype, device: str, size: int, reps: int) -> float:
    """Median FLOP/s of a square ``size``×``size`` matmul."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        ts.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(ts)


# ---------------------------------------------------------------------------------------------
def make_inputs(n: int, dtype: torch.dtype, device: str, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    return q, k, v


def make_call(impl: str, q, k, v, fm, causal: bool, backward: bool, chunk_size: int, checkpoint_blocks: bool = False):
    """A zero-argument function running one forward (or forward+backward) of ``impl``."""
    go = torch.randn_like(q) if backward else None

    def fwd():
        if impl == "rfa":
            return hf_rfa.random_feature_attention(q, k, v, fm, causal=causal, chunk_size=chunk_size, checkpoint_blocks=checkpoint_blocks)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    if not backward:

        def call():
            with torch.no_grad():
                return fwd()

        return call

    def call_bwd():
        for x in (q, k, v):
            x.grad = None
        out = fwd()
        out.backward(go)
        return out

    return call_bwd


def release_memory() -> None:
    """Give freed heap memory back to the OS (glibc keeps large freed arenas otherwise, which
    would crowd out the memory subprocesses)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_timed(call, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
def memory_worker(spec: dict) -> dict:
    """Run one case once (in this fresh process) and return its peak extra memory in bytes."""
    device = spec["device"]
    torch.set_num_threads(spec["threads"])
    hf_rfa.set_compile(bool(spec.get("compile", False)))
    native.set_native(not spec.get("no_native", False))
    dtype = DTYPES[spec["dtype"]]
    fm = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=spec["m"]).to(device)
    # warm up kernels on a tiny problem so that library initialisation is not counted
    qs, ks, vs = make_inputs(64, dtype, device, spec["backward"])
    make_call(spec["impl"], qs, ks, vs, fm, spec["causal"], spec["backward"], spec["chunk_size"], spec.get("checkpoint_blocks", False))()
    del qs, ks, vs
    q, k, v = make_inputs(spec["n"], dtype, device, spec["backward"])
    call = make_call(spec["impl"], q, k, v, fm, spec["causal"], spec["backward"], spec["chunk_size"], spec.get("checkpoint_blocks", False))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        return {"extra_bytes": torch.cuda.max_memory_allocated() - before, "method": "cuda.max_memory_allocated"}
    def status_kb(key: str) -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith(key + ":"))

    rss_before = status_kb("VmRSS") * 1024
    try:  # reset the peak-RSS counter (Linux: writing 5 to clear_refs resets VmHWM)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        method = "VmHWM (reset before the call) - VmRSS before the call"
    except OSError:
        method = "ru_maxrss - VmRSS before the call (peak counter could not be reset)"
    call()
    peak = status_kb("VmHWM") * 1024 if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"extra_bytes": peak - rss_before, "method": method}


def measure_memory(spec: dict, timeout_s: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-worker", json.dumps(spec)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout > {timeout_s:.0f}s"}
    if res.returncode != 0:
        tail = (res.stderr or "").strip().splitlines()[-1:] or [f"exit {res.returncode}"]
        return {"error": ("out of memory" if res.returncode in (-9, 137) else tail[0])[:120]}
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
def bench_group(dtype_name: str, m: int, causal: bool, backward: bool, ns: list[int], args, sdpa_cache: dict, log) -> list[dict]:
    """Time rfa (and SDPA, unless cached from another m) for every N, interleaved."""
    device, dtype = args.device, DTYPES[dtype_name]
    fm = hf_rfa.build_feature_map("favor+", head_dim=D, num_features=m).to(device)
    rows = []
    prev = {"rfa": None, "sdpa": None}
    for n in ns:
        q, k, v = make_inputs(n, dtype, device, backward)
        skey = (dtype_name, causal, backward, n)
        impls = ["rfa"]
        sdpa_note = ""
        if skey in sdpa_cache:
            pass
        elif prev["sdpa"] is not None and prev["sdpa"][1] * (n / prev["sdpa"][0]) ** 2 > args.sdpa_limit_s:
            sdpa_cache[skey] = {"skipped": f"skipped: predicted {prev['sdpa'][1] * (n / prev['sdpa'][0]) ** 2:.0f}s > {args.sdpa_limit_s:.0f}s"}
        else:
            impls.append("sdpa")
        calls = {impl: make_call(impl, q, k, v, fm, causal, backward, args.chunk_size, args.checkpoint_blocks) for impl in impls}
        reps = args.reps if n <= args.many_reps_max_n else max(1, args.reps_large)
        times = {impl: [] for impl in impls}
        for impl in impls:  # warm-up (skipped when one call is known to be slow)
            if prev[impl] is None or prev[impl][1] < 2.0:
                run_timed(calls[impl], device)
        for _ in range(reps):
            for impl in impls:
                times[impl].append(run_timed(calls[impl], device))
        t_rfa = statistics.median(times["rfa"])
        prev["rfa"] = (n, t_rfa)
        if "sdpa" in impls:
            sdpa_cache[skey] = {"time": statistics.median(times["sdpa"]), "times": times["sdpa"]}
        s = sdpa_cache.get(skey, {})
        if "time" in s:
            prev["sdpa"] = (n, s["time"])
        row = {
            "dtype": dtype_name, "m": m, "causal": causal, "backward": backward, "n": n,
            "rfa_s": t_rfa, "rfa_times": times["rfa"], "sdpa_s": s.get("time"), "sdpa_note": s.get("skipped", sdpa_note),
        }
        if causal and not backward:
            row["rfa_gflops"] = rfa_causal_flops(n, m, chunk=args.chunk_size, native=args.native) / t_rfa / 1e9
        rows.append(row)
        log(
            f"{dtype_name} m={m} {'causal' if causal else 'bidir'} {'fwd+bwd' if backward else 'fwd'} N={n}: "
            f"rfa {t_rfa * 1e3:.1f} ms, sdpa {('%.1f ms' % (s['time'] * 1e3)) if 'time' in s else s.get('skipped', '-')}"
        )
        del q, k, v, calls
        release_memory()
    return rows


def _environment(args, argv, threads: int) -> dict:
    """The run's command, device, CPU name (``/proc/cpuinfo``), torch, threads, load and settings."""
    env = {
        "command": "python benchmarks/speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": threads,
        "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "chunk_size": args.chunk_size,
        "compile": args.compile,
        "checkpoint_blocks": args.checkpoint_blocks,
        "native_kernel": args.native,
    }
    try:
        with open("/proc/cpuinfo") as fh:
            env["cpu"] = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return env


def _memory_table(args, timings: list[dict], ms: list[int], threads: int, log) -> tuple[list[dict], str]:
    """The peak extra memory of each ``--mem-n`` case (hf_rfa and SDPA, SDPA where it was timed),
    one fresh subprocess per call → ``(rows, how it was measured)``."""
    mem_ns = [int(x) for x in args.mem_n.split(",") if x]
    rows = []
    method = (
        "CUDA: torch.cuda.max_memory_allocated() − memory_allocated() before the call."
        if args.device.startswith("cuda")
        else "one call per fresh subprocess; peak resident set size during the call (Linux VmHWM, reset just before the call "
        "via /proc/self/clear_refs) − resident set size just before it, with inputs allocated and kernels warmed up on N=64. "
        "Includes the output (and q/k/v gradients for fwd+bwd)."
    )
    timed = {(r["dtype"], r["causal"], r["backward"], r["n"]): r for r in timings if r["m"] == max(ms)}
    for dt in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for ps in args.passes.split(","):
                for n in mem_ns:
                    causal, bwd = mode == "causal", ps == "fwdbwd"
                    row = {"dtype": dt, "m": max(ms), "causal": causal, "backward": bwd, "n": n}
                    for impl in ("rfa", "sdpa"):
                        t = timed.get((dt, causal, bwd, n))
                        if impl == "sdpa" and (t is None or t["sdpa_s"] is None):
                            row[impl] = {"error": "skipped (timing skipped)" if t is not None else "not timed"}
                            continue
                        spec = {"impl": impl, "dtype": dt, "m": max(ms), "causal": causal, "backward": bwd, "n": n,
                                "device": args.device, "threads": threads, "chunk_size": args.chunk_size, "compile": args.compile, "checkpoint_blocks": args.checkpoint_blocks, "no_native": args.no_native}
                        row[impl] = measure_memory(spec, args.mem_timeout_s)
                    log(f"memory {row}")
                    rows.append(row)
    return rows, method


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-n", type=int, default=65536)
    ap.add_argument("--min-n", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="N ≤ 4096, 2 repetitions, memory at N=4096 only")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions for N ≤ --many-reps-max-n")
    ap.add_argument("--reps-large", type=int, default=2, help="repetitions above --many-reps-max-n")
    ap.add_argument("--many-reps-max-n", type=int, default=16384)
    ap.add_argument("--sdpa-limit-s", type=float, default=60.0, help="skip SDPA sizes predicted to take longer (per call)")
    ap.add_argument("--ms", default="64,256")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--modes", default="causal,bidir")
    ap.add_argument("--passes", default="fwd,fwdbwd")
    ap.add_argument("--mem-n", default="4096,16384,65536", help="sizes for the memory table ('' = none)")
    ap.add_argument("--mem-timeout-s", type=float, default=600.0)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    ap.add_argument("--compile", action="store_true", help="hf_rfa.set_compile(True): compiled inference kernels (forward only)")
    ap.add_argument("--checkpoint-blocks", action="store_true", help="random_feature_attention(checkpoint_blocks=True): recompute blocks in backward")
    ap.add_argument("--no-native", action="store_true", help="bypass the compiled CPU kernel (hf_rfa.ops.backends.native): the PyTorch path")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = _args(argv)

    if args.memory_worker is not None:
        print(json.dumps(memory_worker(json.loads(args.memory_worker))))
        return

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    hf_rfa.set_compile(args.compile)
    native.set_native(not args.no_native)
    args.native = native.usable(torch.device(args.device), torch.float32) and not args.compile
    if args.quick:
        args.max_n = min(args.max_n, 4096)
        args.reps = min(args.reps, 2)
        args.mem_n = ",".join(x for x in args.mem_n.split(",") if x and int(x) <= 4096) or "4096"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ns = [n for n in (2**i for i in range(8, 20)) if args.min_n <= n <= args.max_n]
    t_start = time.time()

    def log(msg):
        sys.stderr.write(f"[{time.time() - t_start:7.1f}s] {msg}\n")
        sys.stderr.flush()

    env = _environment(args, argv, threads)
    res: dict = {"env": env}
    mm_size = 2048 if args.quick else 4096
    mm_dtypes = {k: dt for k, dt in DTYPES.items() if k == "fp32" or k in args.dtypes.split(",")}  # (bf16's is minutes where it is emulated)
    res["matmul_gflops"] = {k: matmul_throughput(dt, args.device, mm_size, 5) / 1e9 for k, dt in mm_dtypes.items()}
    log(f"matmul GFLOP/s: {res['matmul_gflops']}")

    ms = [int(x) for x in args.ms.split(",")]
    sdpa_cache: dict = {}
    res["timings"] = []
    for dt in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for ps in args.passes.split(","):
                for m in sorted(ms, reverse=True):
                    res["timings"] += bench_group(dt, m, mode == "causal", ps == "fwdbwd", ns, args, sdpa_cache, log)
    # matmul throughput again at the end (load may have changed); report the max of both
    end_mm = {k: matmul_throughput(dt, args.device, mm_size, 5) / 1e9 for k, dt in mm_dtypes.items()}
    res["matmul_gflops_start"] = dict(res["matmul_gflops"])
    res["matmul_gflops_end"] = end_mm
    res["matmul_gflops"] = {k: max(v, end_mm[k]) for k, v in res["matmul_gflops"].items()}

    res["memory"], res["memory_method"] = _memory_table(args, res["timings"], ms, threads, log)
    env["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    env["wall_s"] = time.time() - t_start
    res["targets"] = evaluate_targets(res)
    (out / "speed_results.json").write_text(json.dumps(res, indent=1))
    files = plot(res, out)
    text = write_tables(res, out)
    sys.stdout.write(text + "\n")
    log(f"wrote {out / 'speed_tables.md'}, {', '.join(files)}; total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
