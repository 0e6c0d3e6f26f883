"""Approximation error of every feature map vs softmax (the core issue's table).

    python benchmarks/approximation.py [--n 1024] [--d 64] [--draws 3] [--out benchmarks/results/approximation.md]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from hf_rfa import available_feature_maps
from hf_rfa.recipes.approximation import approximation_errors, error_table_markdown


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--maps", nargs="+", default=available_feature_maps())
    p.add_argument("--num-features", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument("--logit-stds", nargs="+", type=float, default=[0.05, 0.1, 0.5, 1.0, 2.0])
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the markdown report here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    t0 = time.time()
    rows = approximation_errors(a.maps, a.num_features, a.logit_stds, n=a.n, d=a.d, draws=a.draws, heads=a.heads)
    head = (
        f"Relative error ‖o − o_softmax‖/‖o_softmax‖, bidirectional, d={a.d}, N={a.n}, H={a.heads}, "
        f"mean of {a.draws} seeded draws; q, k Gaussian with the given std of q·k/√d.\n"
        "Learned maps (hedgehog, t2r, elu) and rfa are shown at initialisation: they are not estimators of softmax.\n"
        "'uniform (baseline)' is plain averaging of the values (every key weight 1/N): an estimator must beat it to be useful.\n"
    )
    report = (
        "## Attention output error\n\n" + head + "\n" + error_table_markdown(rows, "output_error")
        + "\n\n## Row-normalised attention matrix error\n\n" + error_table_markdown(rows, "matrix_error")
        + f"\n\n(took {time.time() - t0:.0f} s; command: python benchmarks/approximation.py)\n"
    )
    sys.stdout.write(report)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
