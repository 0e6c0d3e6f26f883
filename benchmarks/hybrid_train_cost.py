"""Training cost of one causal hybrid attention layer: HybridFunction vs the separate Functions.

    .venv/bin/python benchmarks/hybrid_train_cost.py --n 4096 --threads 2

SmolLM2-135M-shaped layer (B=1, 9 query / 3 kv heads, D=64), FAVOR+ m=256, window 256, 4 sinks,
fp32, ``checkpoint_blocks=True`` (the default). ``new``: the one recomputing
:class:`hf_rfa.ops.hybrid.function.HybridFunction` (q, k, v saved once); ``old``: the form before
it — :class:`~hf_rfa.ops.band.recompute.BandFunction` on √scale-multiplied q/k, the
:class:`~hf_rfa.ops.feature.recompute.ScanFunction` on window-shifted k/v, then autograd ``merge`` and
``finalize`` (selected by switching off ``attention._hybrid_function_applies``). Reports the
bytes autograd saves for backward (saved-tensor hooks; per layer) and the median forward and
backward seconds, both forms *interleaved* in one process (same machine load), plus the load
average. Writes a Markdown table to stdout and, with ``--out``, to a file.

    .venv/bin/python benchmarks/hybrid_train_cost.py --unrotated-saved --n 4096 --threads 1

With ``--unrotated-saved``: only the bytes saved for backward (one forward per form, no timing)
of the un-rotated recipe's layer (``feature_input="unrotated"``: ``feature_q``/``feature_k``
given; Hedgehog m=64, window 64, 4 sinks, with and without a decay): ``new`` the one
HybridFunction with feature inputs, ``old`` the separate Functions (what the dispatcher picked for
feature inputs before). Both the sum over saves (as above) and the distinct storages.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path

import torch

import hf_rfa
from hf_rfa.ops import attention

logger = logging.getLogger("hybrid_train_cost")
SHAPE = dict(b=1, h=9, hkv=3, d=64)
RECIPE = dict(window=256, sinks=4)


def _form(new: bool):
    """The predicate that picks the form (the original for ``new``, never for the old form)."""
    return _APPLIES if new else (lambda *a: False)


_APPLIES = attention._hybrid_function_applies


def measure(n: int, new: bool, fm, inputs, grad_out) -> tuple[int, float, float, float]:
    """One forward + backward of the layer: ``(saved bytes, forward s, backward s, process CPU s
    of both)`` (on a machine shared with other jobs CPU seconds track the compute cost when wall
    time does not)."""
    q, k, v = inputs
    for x in inputs:
        x.grad = None
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    attention._hybrid_function_applies = _form(new)
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = hf_rfa.random_feature_attention(q, k, v, fm, **RECIPE)
        t1 = time.perf_counter()
        out.backward(grad_out)
        t2, c2 = time.perf_counter(), time.process_time()
    finally:
        attention._hybrid_function_applies = _APPLIES
    return saved[0], t1 - t0, t2 - t1, c2 - c0


def layer_inputs(n: int, seed: int = 0):
    """``(q [1,9,N,64], k, v [1,3,N,64])`` requiring gradients and the output gradient."""
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, d = SHAPE["b"], SHAPE["h"], SHAPE["hkv"], SHAPE["d"]
    q, k, v = (torch.randn(b, x, n, d, generator=g).requires_grad_() for x in (h, hkv, hkv))
    return (q, k, v), torch.randn(b, h, n, d, generator=g)


def run(ns: list[int], reps: int, m: int = 256) -> list[dict]:
    """Rows ``{n, form, saved_mib, qkv_mib, fwd_s, bwd_s, cpu_s}`` (medians over ``reps`` after a warm-up)."""
    fm = hf_rfa.build_feature_map("favor+", head_dim=SHAPE["d"], num_features=m, seed=0)
    rows = []
    for n in ns:
        inputs, go = layer_inputs(n)
        qkv = sum(x.numel() * x.element_size() for x in inputs)
        res: dict[bool, list] = {False: [], True: []}
        for new in (False, True):
            measure(n, new, fm, inputs, go)  # warm-up
        for _ in range(reps):
            for new in (False, True):
                res[new].append(measure(n, new, fm, inputs, go))
        for new in (False, True):
            saved = res[new][0][0]
            fwd = statistics.median(r[1] for r in res[new])
            bwd = statistics.median(r[2] for r in res[new])
            cpu = statistics.median(r[3] for r in res[new])
            rows.append({"n": n, "form": "new" if new else "old", "saved_mib": saved / 2**20, "qkv_mib": qkv / 2**20, "fwd_s": fwd, "bwd_s": bwd, "cpu_s": cpu})
    return rows


UNROTATED = dict(window=64, sinks=4)


def saved_unrotated(n: int, decay: bool, new: bool, m: int = 64) -> tuple[int, int, int]:
    """One forward of the un-rotated recipe's layer: ``(bytes over saves, bytes of distinct
    storages, bytes of q, k, v, feature_q, feature_k)``; runs its backward."""
    b, h, hkv, d = SHAPE["b"], SHAPE["h"], SHAPE["hkv"], SHAPE["d"]
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=d, num_features=m, seed=0, num_heads=h, num_kv_heads=hkv)
    if decay:
        fm.enable_decay(64.0)
    g = torch.Generator().manual_seed(0)
    q, k, v, fq, fk = (torch.randn(b, x, n, d, generator=g).requires_grad_() for x in (h, hkv, hkv, h, hkv))
    total, stores = [0], {}

    def pack(t):
        total[0] += t.numel() * t.element_size()
        st = t.untyped_storage()
        stores[st.data_ptr()] = st.nbytes()
        return t

    attention._hybrid_function_applies = _form(new)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = hf_rfa.random_feature_attention(q, k, v, fm, feature_q=fq, feature_k=fk, **UNROTATED)
        out.sum().backward()
    finally:
        attention._hybrid_function_applies = _APPLIES
    return total[0], sum(stores.values()), sum(x.numel() * x.element_size() for x in (q, k, v, fq, fk))


def unrotated_table(ns: list[int], threads: int) -> str:
    lines = [f"un-rotated hybrid layer (feature_q/feature_k given) B=1 H=9 Hkv=3 D=64, hedgehog m=64, W=64, S=4, fp32, {threads} threads; saved for backward per layer", "",
             "| N | decay | form | MiB over saves | MiB distinct storages | q,k,v,feature_q,feature_k MiB |", "|---|---|---|---|---|---|"]
    for n in ns:
        for decay in (False, True):
            for new in (False, True):
                tot, dist, inp = saved_unrotated(n, decay, new)
                lines.append(f"| {n} | {'yes' if decay else 'no'} | {'new' if new else 'old'} | {tot / 2**20:.2f} | {dist / 2**20:.2f} | {inp / 2**20:.2f} |")
    return "\n".join(lines) + "\n"


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| N | form | saved for backward MiB (q,k,v: MiB) | forward s | backward s | fwd+bwd s | fwd+bwd CPU s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['form']} | {r['saved_mib']:.1f} ({r['qkv_mib']:.1f}) | {r['fwd_s']:.3f} | {r['bwd_s']:.3f} | {r['fwd_s'] + r['bwd_s']:.3f} | {r['cpu_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    ap.add_argument("--unrotated-saved", action="store_true", help="only the saved bytes of the un-rotated recipe (feature inputs)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.unrotated_saved:
        text = unrotated_table(args.n, args.threads)
        logger.info("%s", text)
        if args.out is not None:
            args.out.write_text(text)
        return
    load0 = os.getloadavg()[0]
    rows = run(args.n, args.reps)
    header = f"hybrid layer B=1 H=9 Hkv=3 D=64, favor+ m=256, W=256, S=4, fp32, {args.threads} threads, median of {args.reps}; load average (1 min) {load0:.2f} before, {os.getloadavg()[0]:.2f} after"
    text = table(rows, header)
    logger.info("%s", text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
