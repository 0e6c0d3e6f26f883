"""Perplexity of any causal-LM checkpoint, original or converted; prints one JSON line.

    python conversion/evaluate.py --model DIR --text FILE --context 1024 [--max-tokens N]

Converted folders (``rfa_config`` in config.json) load with ``hf_rfa.from_pretrained``.
Standard non-overlapping windows; ``tokens`` is the number of predicted tokens.
"""

from hf_rfa.cli import evaluate_main as main  # noqa: F401

if __name__ == "__main__":
    main()
