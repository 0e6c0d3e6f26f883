"""The main job (``make main``): convert SmolLM2-135M on a fresh machine without the Hub.

1. prepares the offline assets (:mod:`hf_rfa.assets`): SmolLM2-135M-Instruct from its GGUF,
   the Wikipedia articles split into disjoint calibration / train / eval files;
2. converts SmolLM2 to a hybrid — exact window of 256 + 4 exact sink tokens + FAVOR+ (m=256) for
   every other key — and LoRA-tunes it briefly on train articles (random features have no
   parameters, so there is no attention-transfer stage by default: measured here, transfer of
   Hedgehog maps or of learned FAVOR+ projections did worse at context 4096, see
   ``conversion/RESULTS.md``; ``--feature-map hedgehog --transfer-tokens N`` adds it back);
3. evaluates perplexity on the held-out eval articles (fixed number of tokens, non-overlapping
   windows) at contexts 1024 and 4096 for: original / random features untrained / hybrid
   untrained / after LoRA;
4. prints the table, a greedy generation sample (decoded with the constant-memory cache) and the
   output folder (Hub-ready export).
``--quick`` is a few-minute run (context 512, window 64, a few LoRA steps, small eval); flags after the
known ones go to ``conversion/convert.py`` (e.g. ``--transfer-tokens 100000``).
"""

from __future__ import annotations

import argparse
import logging
import os
import time


DEFAULT = [
    "--feature-map", "favor+", "--num-features", "256", "--window", "256", "--sinks", "4", "--no-random-hybrid",
    "--context", "1024", "--lora-tokens", "8192", "--lora-context", "1024", "--lora-minutes", "6",
    "--eval-contexts", "1024", "4096", "--eval-tokens", "8192", "--error-tokens", "1024", "--eval-twin-max", "0",
]
QUICK = [
    "--feature-map", "favor+", "--num-features", "128", "--window", "64", "--sinks", "4", "--no-random-hybrid",
    "--context", "512", "--lora-tokens", "1024", "--lora-context", "256", "--lora-minutes", "1",
    "--eval-contexts", "512", "--eval-tokens", "2048", "--error-tokens", "512", "--random-num-features", "128",
]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few-minute run")
    p.add_argument("--output", default=os.path.join("out", "smollm2-135m-rfa"))
    a, rest = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    start = time.time()
    from hf_rfa import assets

    model = assets.smollm2_path()
    files = {s: assets.wikipedia_text_file(s) for s in assets.WIKIPEDIA_SPLITS}
    import convert

    args = (QUICK if a.quick else DEFAULT) + [
        "--model", str(model), "--output", a.output, "--overwrite",
        "--calibration-text", str(files["calibration"]), "--train-text", str(files["train"]), "--eval-text", str(files["eval"]),
    ] + rest
    convert.main(args)
    print(f"main job: {(time.time() - start) / 60:.1f} min wall (2 shared CPU cores)")


if __name__ == "__main__":
    main()
