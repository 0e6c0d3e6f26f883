"""The hybrid's exact band in training: the current ``BandFunction`` vs the one of an earlier commit.

    .venv/bin/python benchmarks/band_backward.py --old-rev 67cd002 --n 1024 --threads 1

One converted SmolLM2-shaped layer (H=9, Hkv=3, D=64; favor+ m=256, window 256, 4 sinks, causal),
forward + backward of ``random_feature_attention`` (``checkpoint_blocks=True``) with the band's
``BandFunction`` from the working tree and from ``--old-rev`` (its ``hf_rfa/ops/recompute.py``,
read with ``git show``), next to SDPA; the three alternate, the fastest of ``--repeats`` counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", default="67cd002", help="git revision whose BandFunction is the 'old' one")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    import hf_rfa
    import hf_rfa.ops.band.recompute as new_mod

    root = Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "show", f"{args.old_rev}:hf_rfa/ops/recompute.py"], cwd=root, capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("hf_rfa.ops._old_recompute", f.name)
    old_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old_mod)
    forms = {"new": new_mod.BandFunction, "old": old_mod.BandFunction}

    torch.set_num_threads(args.threads)
    b, h, hkv, d, n = 1, 9, 3, 64, args.n
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, hh, n, d, generator=g) for hh in (h, hkv, hkv))
    up = torch.randn(b, h, n, d, generator=g)
    fm = hf_rfa.build_feature_map("favor+", head_dim=d, num_features=256, seed=0)

    def rfa(which: str):
        new_mod.BandFunction = forms[which]  # exact_local imports it at call time
        try:
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out = hf_rfa.random_feature_attention(qq, kk, vv, fm, causal=True, window=256, sinks=4)
            (out * up).sum().backward()
            return [out.detach(), qq.grad, kk.grad, vv.grad]
        finally:
            new_mod.BandFunction = forms["new"]

    def sdpa():
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk.repeat_interleave(h // hkv, 1), vv.repeat_interleave(h // hkv, 1), is_causal=True)
        (out * up).sum().backward()

    a, c = rfa("old"), rfa("new")
    diff = max(float((x - y).norm() / y.norm()) for x, y in zip(c, a))
    times = {"sdpa": [], "old": [], "new": []}
    for _ in range(args.repeats):
        for name, fn in (("sdpa", sdpa), ("old", lambda: rfa("old")), ("new", lambda: rfa("new"))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    m = {k_: min(v_) for k_, v_ in times.items()}
    print(f"N={n} threads={args.threads}: new vs old output/grad max relative difference {diff:.1e}")
    print(f"fwd+bwd ms (fastest of {args.repeats}, interleaved): SDPA {m['sdpa'] * 1e3:.0f}, op with old band {m['old'] * 1e3:.0f}, "
          f"op with new band {m['new'] * 1e3:.0f}; old/new {m['old'] / m['new']:.2f}x, SDPA/new {m['sdpa'] / m['new']:.2f}x")


if __name__ == "__main__":
    main()
