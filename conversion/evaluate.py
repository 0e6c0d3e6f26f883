"""Perplexity of any causal-LM checkpoint, original or converted; prints one JSON line.

    python conversion/evaluate.py --model DIR --text FILE --context 1024 [--max-tokens N]

Converted folders (``rfa_config`` in config.json) load with ``hf_rfa.from_pretrained``.
Standard non-overlapping windows; ``tokens`` is the number of predicted tokens.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_rfa.cli import evaluate_main as main  # noqa: E402,F401

if __name__ == "__main__":
    main()
