"""Perplexity, copy or passkey of any causal-LM checkpoint, original or converted, each figure with
its 95% bootstrap interval; one JSON line.

    python conversion/evaluate.py --model DIR --text FILE [--task perplexity] --context 1024 [--max-tokens N]
    python conversion/evaluate.py --model DIR --text FILE --task copy --gap 512 [--draws 8]
    python conversion/evaluate.py --model DIR --task passkey --lengths 1024 4096 [--trials 20] [--fillers repeated natural]
    python conversion/evaluate.py --model DIR --grid full [--output FILE.json]

Converted folders (``rfa_config`` in config.json) load with ``hf_rfa.from_pretrained``.
Standard non-overlapping windows; ``tokens`` is the number of predicted tokens.
"""

from hf_rfa.cli import _command, evaluate_main as main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(_command(main, "conversion/evaluate.py")())  # a user error: one line, status 2, as the installed command
