"""Perplexity of any causal-LM checkpoint, original or converted; prints one JSON line.

    python conversion/evaluate.py --model DIR --text FILE --context 1024 [--max-tokens N]

Converted folders (``rfa_config`` in config.json) load with ``hf_rfa.from_pretrained``.
Standard non-overlapping windows; ``tokens`` is the number of predicted tokens.
"""

from __future__ import annotations

import argparse
import json


from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion.pipeline import CAUSAL_LM, load_model


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="folder, Hub id or .gguf file")
    p.add_argument("--text", required=True, help="file, wikipedia:<split> or name[:config]:split")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate this many tokens (evenly spread windows)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    if a.max_tokens is not None and a.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1 (or omitted: all), got {a.max_tokens}")
    if a.context < 2:
        p.error(f"--context must be >= 2, got {a.context}")
    model, tok, kind = load_model(a.model)
    if kind != CAUSAL_LM:
        p.error(f"--model {a.model} is a {kind}, not a causal LM: perplexity is undefined")
    ids = evaluation.tokenize(tok, evaluation.load_text(a.text))
    r = evaluation.perplexity(model, ids, a.context, a.max_tokens, progress=a.progress)
    out = {"perplexity": r["perplexity"], "tokens": r["tokens"], "windows": r["windows"], "context": r["context"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
