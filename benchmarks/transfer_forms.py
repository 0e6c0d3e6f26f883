"""The three uses of a converted layer's output in the conversion recipes, by the quadratic twin
(``quadratic_kernel_attention``, N×N per head) and by the op (``random_feature_attention``, the
production form; with and without ``checkpoint_blocks``), in the same run: one thread, median of
``--repeats`` calls, forward + backward where the recipe trains.

- ``transfer``: attention transfer, last 256 queries of N keys, gradient to the map's parameters
- ``lora``: LoRA / fine-tuning, N queries, gradient to q, k, v (the map frozen)
- ``eval``: layer errors and perplexity, N queries, no autograd

    python benchmarks/transfer_forms.py            # SmolLM2-like heads: H=9, Hkv=3, D=64, N=1024
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

import hf_rfa

logger = logging.getLogger("benchmarks.transfer_forms")

#: (label, feature map, num_features)
MAPS = (("hedgehog m=64", "hedgehog", 64), ("favor+ m=256", "favor+", 256))


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def _call(form: str, q, k, v, fm, mask, window: int, sinks: int) -> torch.Tensor:
    if form == "twin":
        return hf_rfa.quadratic_kernel_attention(q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks)
    return hf_rfa.random_feature_attention(
        q, k, v, fm, causal=True, attention_mask=mask, window=window, sinks=sinks, checkpoint_blocks=form == "op, checkpoint",
    )


def _case(use: str, form: str, q, k, v, fm, mask, window: int, sinks: int, queries: int):
    """A callable running one use of one form: returns the output and the gradients of that use."""
    fm.requires_grad_(use == "transfer")  # LoRA trains the projections, not the map
    if use == "transfer":
        qq, kk, vv, leaves = q[:, :, -queries:], k, v, list(fm.parameters())
    elif use == "lora":
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        leaves = [qq, kk, vv]
    else:
        qq, kk, vv, leaves = q, k, v, []
    grad_out = torch.randn(qq.shape[0], qq.shape[1], qq.shape[2], v.shape[-1], generator=torch.Generator().manual_seed(1))

    def run():
        if use == "eval":
            with torch.no_grad():
                return _call(form, qq, kk, vv, fm, mask, window, sinks), []
        for x in leaves:
            x.grad = None
        out = _call(form, qq, kk, vv, fm, mask, window, sinks)
        out.backward(grad_out)
        return out.detach(), [x.grad.clone() if x.grad is not None else torch.zeros_like(x) for x in leaves]

    return run


def measure(b: int, h: int, hkv: int, d: int, n: int, window: int, sinks: int, queries: int, repeats: int) -> list[dict]:
    """One row per (map, use): milliseconds of each form, the op/twin ratios and the largest
    relative difference of outputs and gradients between the op and the twin."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    mask = torch.ones(b, n, dtype=torch.bool)
    rows = []
    for label, name, m in MAPS:
        fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=m, seed=0)
        uses = ("transfer", "lora", "eval") if any(True for _ in fm.parameters()) else ("lora", "eval")
        for use in uses:
            row = {"map": label, "use": use}
            results = {}
            for form in ("twin", "op, checkpoint", "op, no checkpoint"):
                run = _case(use, form, q, k, v, fm, mask, window, sinks, queries)
                row[form] = _median_ms(run, repeats)
                results[form] = run()
            tw_out, tw_grads = results["twin"]
            diff = 0.0
            for form in ("op, checkpoint", "op, no checkpoint"):
                out, grads = results[form]
                for a, t in zip([out, *grads], [tw_out, *tw_grads]):
                    diff = max(diff, float((a - t).norm() / t.norm().clamp_min(1e-30)))
            row["max rel diff"] = diff
            rows.append(row)
            logger.info("%s", row)
    return rows


def table(rows: list[dict]) -> str:
    head = "| map | use | twin ms | op ms (checkpoint) | op ms (no checkpoint) | op/twin (checkpoint) | op/twin (no checkpoint) | max rel diff |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tw = r["twin"]
        lines.append(
            f"| {r['map']} | {r['use']} | {tw:.1f} | {r['op, checkpoint']:.1f} | {r['op, no checkpoint']:.1f} | "
            f"{r['op, checkpoint'] / tw:.2f} | {r['op, no checkpoint'] / tw:.2f} | {r['max rel diff']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1024, help="sequence length")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--queries", type=int, default=256, help="transfer: queries fitted (the last Q)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (median reported)")
    a = p.parse_args(argv)
    if a.window + a.sinks >= a.n:
        p.error("window + sinks must be below --n (otherwise every key is exact and the map gets no gradient)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(a.threads)
    rows = measure(1, a.heads, a.kv_heads, a.head_dim, a.n, a.window, a.sinks, a.queries, a.repeats)
    logger.info("B=1 H=%d Hkv=%d D=%d N=%d window %d sinks %d, %d thread(s), median of %d\n%s", a.heads, a.kv_heads, a.head_dim, a.n, a.window, a.sinks, a.threads, a.repeats, table(rows))


if __name__ == "__main__":
    main()
