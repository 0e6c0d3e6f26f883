"""Evaluate any causal-LM checkpoint, original or converted; prints one JSON line.

    python conversion/evaluate.py --model DIR --text FILE --task perplexity --context 1024 [--max-tokens N]
    python conversion/evaluate.py --model DIR --text FILE --task copy --gap 512 [--draws 8]
    python conversion/evaluate.py --model DIR --task passkey --lengths 1024 4096 [--trials 20]

Tasks: ``perplexity`` (standard non-overlapping windows; ``tokens`` = predicted tokens), ``copy``
(a passage of held-out text, ``--gap`` tokens of other text, the passage again: perplexity of the
first and the second copy), ``passkey`` (a 5-digit key at depths 10/50/90% of filler text, greedy
retrieval accuracy per length and depth). Converted folders (``rfa_config`` in config.json) load
with ``hf_rfa.from_pretrained``. Seeded and deterministic.
"""

from __future__ import annotations

import argparse
import json


from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.pipeline import CAUSAL_LM, load_model

TASKS = ("perplexity", "copy", "passkey")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="folder, Hub id or .gguf file")
    p.add_argument("--task", choices=TASKS, default="perplexity", help="what to measure (default: perplexity)")
    p.add_argument("--text", default=None, help="file, wikipedia:<split> or name[:config]:split (perplexity and copy)")
    p.add_argument("--context", type=int, default=1024, help="perplexity: window length")
    p.add_argument("--max-tokens", type=int, default=None, help="perplexity: evaluate this many tokens (evenly spread windows)")
    p.add_argument("--gap", type=int, default=512, help="copy: tokens of other text between the two copies")
    p.add_argument("--passage", type=int, default=256, help="copy: passage length in tokens")
    p.add_argument("--draws", type=int, default=8, help="copy: seeded draws")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="passkey: prompt lengths")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="passkey: depths of the key in [0, 1]")
    p.add_argument("--trials", type=int, default=20, help="passkey: seeded trials per (length, depth)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    if a.task in ("perplexity", "copy") and a.text is None:
        p.error(f"--task {a.task} needs --text")
    model, tok, kind = load_model(a.model)
    if kind != CAUSAL_LM:
        p.error(f"--model {a.model} is a {kind}, not a causal LM: {a.task} is undefined")
    if a.task == "passkey":
        r = long_range.passkey_task(model, tok, a.lengths, a.depths, a.trials, a.seed, progress=a.progress)
    else:
        ids = evaluation.tokenize(tok, evaluation.load_text(a.text))
        if a.task == "copy":
            r = long_range.copy_task(model, ids, a.gap, a.passage, a.draws, seed=a.seed, progress=a.progress)
        else:
            r = evaluation.perplexity(model, ids, a.context, a.max_tokens, progress=a.progress)
    out = {"task": a.task, **r}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
