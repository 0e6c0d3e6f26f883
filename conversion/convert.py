"""Convert a checkpoint to random feature attention: transfer, (LoRA), quality report, export.

    python conversion/convert.py --model <Hub id | local dir | GGUF file> --feature-map hedgehog \
        --num-features 64 --window 64 --sinks 4 --transfer-tokens 500000 --lora-tokens 500000 \
        --calibration-text <file or dataset> --eval-text <file or dataset> --output out/ [--push-to-hub ID]

Text sources: a file, ``wikipedia:<calibration|train|eval>`` / ``rotten_tomatoes:<train|test>``
(offline assets) or a Hub dataset ``name[:config]:split``. All logic is in
:mod:`hf_rfa.recipes.conversion.pipeline`; this script parses flags and prints the result table.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading


from hf_rfa.recipes.conversion.pipeline import ConversionConfig, _rows_markdown, run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="Hub id (e.g. gpt2), local folder or .gguf file")
    p.add_argument("--output", required=True, help="folder to create (written to a temp dir, renamed at the end)")
    p.add_argument("--feature-map", default="hedgehog")
    p.add_argument("--num-features", type=int, default=64)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--no-hybrid-mix", dest="hybrid_mix", action="store_false", help="no learned feature/exact mixing weight")
    p.add_argument("--learnable-projections", action="store_true", help="favor+/positive/rff…: attention transfer trains the projections")
    p.add_argument("--transfer-tokens", type=int, default=500_000)
    p.add_argument("--lora-tokens", type=int, default=0)
    p.add_argument("--transfer-minutes", type=float, default=None, help="wall-time cap of attention transfer")
    p.add_argument("--lora-minutes", type=float, default=None, help="wall-time cap of LoRA")
    p.add_argument("--calibration-text", required=True)
    p.add_argument("--train-text", default=None, help="transfer/LoRA text (default: calibration text)")
    p.add_argument("--eval-text", required=True)
    p.add_argument("--context", type=int, default=1024, help="sequence length of transfer and LoRA")
    p.add_argument("--lora-context", type=int, default=None)
    p.add_argument("--eval-contexts", type=int, nargs="+", default=[1024])
    p.add_argument("--eval-tokens", type=int, default=16384, help="predicted tokens per evaluation (0: all)")
    p.add_argument("--error-tokens", type=int, default=2048)
    p.add_argument("--eval-sentences", type=int, default=1000)
    p.add_argument("--transfer-queries", type=int, default=256, help="causal: fit the last Q queries of each sequence (0: all)")
    p.add_argument("--transfer-lr", type=float, default=1e-2)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--no-baselines", dest="baselines", action="store_false", help="skip the untrained baselines")
    p.add_argument("--no-random-hybrid", dest="random_hybrid", action="store_false", help="skip the random-feature hybrid baseline")
    p.add_argument("--eval-twin-max", type=int, default=2048, help="evaluate converted models up to this context with the op's quadratic twin (0: never)")
    p.add_argument("--random-num-features", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--push-to-hub", default=None, metavar="ID")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def config_from_args(argv: list[str] | None = None) -> ConversionConfig:
    a = vars(parser().parse_args(argv))
    a["eval_tokens"] = a["eval_tokens"] or None
    a["transfer_queries"] = a["transfer_queries"] or None
    return ConversionConfig(**a)


def _interrupt(signum, frame):  # SIGTERM unwinds like Ctrl-C, so the temp folder is removed
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    report = run(config_from_args(argv))
    print(_rows_markdown(report["rows"]))
    if "generation" in report:
        print(f"\ngeneration ({report['generation']['prompt']!r}): {report['generation']['text']!r}")
    print(f"\noutput: {report['output']}")
    return report


if __name__ == "__main__":
    main()
