"""(k) Is the passkey lost in the choice of the memory, or in reading it?

For each passkey trial (natural filler, the same prompts as ``long_range.passkey_task`` with the
same seed), the prompt is prefilled into an :class:`hf_rfa.RFACache` and each layer's exact memory
is read at the question's end: which of the key's digit tokens (the key is written twice in the
needle sentence) are still held, per layer and kv head. The same trial's answer is scored as the
task scores it (the digits only, greedy). One JSON line per trial (``--out``); a summary per
length on stdout, with what a choice of the same memory sizes at random would hold of the needle.

``--score-drift``: prefills ``--filler-text`` once and prints, per layer, the mean memory score
(``memory_score``, in log2) of the candidate keys by position band: whether a key written late
meets a memory of keys that scored higher only because they were scored earlier.

    NT=2 python research/long_range_recall/needle_memory.py --model out/smollm2-135m-rfa \\
        --lengths 1024 2048 4096 8192 --trials 10
    NT=2 python research/long_range_recall/needle_memory.py --model out/smollm2-135m-rfa --score-drift 8192
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("needle_memory")


def _sub_positions(seq: list[int], sub: list[int]) -> list[int]:
    """Start positions of ``sub`` in ``seq``."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i : i + n] == sub]


def needle_positions(tok, prompt: list[int], key: str) -> list[int]:
    """Positions of the key's tokens in ``prompt``: its digit tokens, wherever the key is written
    (SmolLM2 writes ``" 71432"`` as ``" "`` + five digits; ``"71432"`` as the five digits)."""
    digits = tok(key, add_special_tokens=False)["input_ids"]
    return sorted({s + j for s in _sub_positions(prompt, digits) for j in range(len(digits))})


def held(cache, positions: list[int]) -> list[list[int]]:
    """Per layer and kv head: how many of ``positions`` its exact memory holds (row 0)."""
    want = torch.tensor(positions)
    out = []
    for layer in cache.layers:
        st = layer.state
        if st is None or not hasattr(st, "mem_pos"):
            out.append([])
            continue
        pos, ok = st.mem_pos[0], st.mem_ok[0]  # [Hkv, M]
        out.append([int(torch.isin(pos[h][ok[h]], want).sum()) for h in range(pos.shape[0])])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--filler-text", default="wikipedia:eval")
    ap.add_argument("--rfa", nargs="*", default=[], help="runtime settings as hf-rfa-evaluate --rfa (e.g. memory=512)")
    ap.add_argument("--label", default="published")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("needle_memory.jsonl"))
    ap.add_argument("--summary", action="store_true", help="print the summaries of --out (every label) and run nothing")
    ap.add_argument("--score-drift", type=int, default=0, metavar="N", help="prefill N tokens of --filler-text and print each layer's mean candidate score by position band, then stop")
    ap.add_argument("--excluded", type=int, default=68, help="--summary: keys never candidates (window + sinks; the recall preset's 64 + 4) for the random expectation")
    a = ap.parse_args(argv)
    if a.summary:
        rows = [json.loads(line) for line in open(a.out)]
        for label in dict.fromkeys(r["label"] for r in rows):
            print(f"## {label}")
            summarize([r for r in rows if r["label"] == label], a.excluded)
            for row in by_layer([r for r in rows if r["label"] == label]):
                print(json.dumps(row))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("NT", "2")))

    import hf_rfa
    from hf_rfa.recipes import evaluation, long_range
    from hf_rfa.recipes.conversion.loading import load_model

    model, tok, _ = load_model(a.model)
    model.eval()
    if a.rfa:
        hf_rfa.reconfigure(model, **hf_rfa.parse_runtime_settings(a.rfa))
    if a.score_drift:
        ids = tok(evaluation.load_text(a.filler_text), add_special_tokens=False)["input_ids"][: a.score_drift]
        for row in score_drift(model, torch.tensor([ids])):
            print(json.dumps(row))
        return
    filler = long_range.natural_filler(tok, evaluation.load_text(a.filler_text), a.filler_text)
    space = tok(" ", add_special_tokens=False)["input_ids"]
    rows = []
    for n in a.lengths:
        for dp in a.depths:
            keys, ends = long_range.passkey_draws(n, dp, a.trials, 0, filler)  # passkey_task's trials, seed 0
            for t, (key, end) in enumerate(zip(keys, ends)):
                prompt, answer = long_range.passkey_prompt(tok, n, dp, key, filler, end)
                lead = long_range._leading_space_tokens(space, answer)
                with torch.no_grad():
                    x = torch.cat([prompt, answer]).unsqueeze(0)
                    digits_ok = bool(long_range._passkey_hits(model, x, len(answer), lead)[0, 1])
                    cache = hf_rfa.RFACache(model)
                    model(input_ids=prompt.unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=1)
                pos = needle_positions(tok, prompt.tolist(), key)
                counts = held(cache, pos)
                sizes = [int(layer.state.mem_pos.shape[-1]) if layer.state is not None and hasattr(layer.state, "mem_pos") else 0 for layer in cache.layers]
                row = {"label": a.label, "length": n, "depth": dp, "trial": t, "key": key, "digits_ok": digits_ok,
                       "needle_positions": pos, "distance": len(prompt) - (pos[0] if pos else 0), "memory_sizes": sizes, "held": counts}
                rows.append(row)
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            log.info("length %d depth %.1f done", n, dp)
    summarize(rows)


def random_expectation(row: dict, excluded: int) -> tuple[float, float]:
    """What the memory of ``row``'s sizes would hold of its needle were its keys a uniform random
    choice among the ``length − excluded`` candidates: ``(share of pairs holding ≥ 1 needle token,
    needle tokens held per pair)``."""
    n, k = row["length"] - excluded, len(row["needle_positions"])
    share = tokens = 0.0
    pairs = 0
    for size, layer in zip(row["memory_sizes"], row["held"]):
        m = min(size, n)
        miss = math.prod((n - m - j) / (n - j) for j in range(k)) if n - m >= k else 0.0  # no needle token among m of n
        share += (1 - miss) * len(layer)
        tokens += k * m / n * len(layer)
        pairs += len(layer)
    return share / max(1, pairs), tokens / max(1, pairs)


def summarize(rows: list[dict], excluded: int = 68) -> None:
    """Per length: digits right; trials where some layer holds every needle token; mean share of
    (layer, kv head) pairs holding at least one, among the right and wrong trials, and were the
    memory a random choice of the same sizes (:func:`random_expectation`); needle tokens held per
    pair, measured and at random."""
    for n in sorted({r["length"] for r in rows}):
        rs = [r for r in rows if r["length"] == n]
        def share(r):
            pairs = [c for layer in r["held"] for c in layer]
            return sum(c > 0 for c in pairs) / max(1, len(pairs))
        def full(r):
            k = len(r["needle_positions"])
            return any(c == k for layer in r["held"] for c in layer)
        ok = [r for r in rs if r["digits_ok"]]
        bad = [r for r in rs if not r["digits_ok"]]
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        tokens = lambda r: sum(c for layer in r["held"] for c in layer) / max(1, sum(len(layer) for layer in r["held"]))  # noqa: E731
        rand = [random_expectation(r, excluded) for r in rs]
        print(json.dumps({"length": n, "trials": len(rs), "digits_right": len(ok), "some_head_holds_every_key_token": sum(map(full, rs)),
                          "pairs_holding_some": round(mean([share(r) for r in rs]), 3), "pairs_holding_some_right": round(mean([share(r) for r in ok]), 3),
                          "pairs_holding_some_wrong": round(mean([share(r) for r in bad]), 3), "pairs_holding_some_at_random": round(mean([x[0] for x in rand]), 3),
                          "tokens_per_pair": round(mean([tokens(r) for r in rs]), 2), "tokens_per_pair_at_random": round(mean([x[1] for x in rand]), 2)}))


def by_layer(rows: list[dict]) -> list[dict]:
    """Per layer: the needle tokens its kv heads hold (summed over the heads), mean over the right
    and over the wrong trials, pooled over the lengths where both kinds occur."""
    mixed = {n for n in {r["length"] for r in rows} if len({r["digits_ok"] for r in rows if r["length"] == n}) == 2}
    rs = [r for r in rows if r["length"] in mixed]
    out = []
    for li in range(len(rs[0]["held"]) if rs else 0):
        ok = [sum(r["held"][li]) for r in rs if r["digits_ok"]]
        bad = [sum(r["held"][li]) for r in rs if not r["digits_ok"]]
        out.append({"layer": li, "size": rs[0]["memory_sizes"][li], "right": round(sum(ok) / len(ok), 2), "wrong": round(sum(bad) / len(bad), 2)})
    return out


#: position bands of :func:`score_drift`
BANDS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 16384))


def candidate_scores(model, ids: torch.Tensor) -> dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Prefill ``ids [1, N]`` (no cache) and return, per layer with an exact memory, every choice's
    candidates as ``(pos, score, ok)`` ``[Hkv, K]`` (row 0): their ``memory_score`` as the memory
    compares it (log2), read where the memory chooses (``select_memory`` of both forms, wrapped
    for the call); the layer from a pre-hook on each decoder layer."""
    from hf_rfa.ops.memory import periods, sequential, terms

    current = {"layer": -1}
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    choose = terms.select_memory

    def spy(mem, cand, memory):
        seen.setdefault(current["layer"], []).append((cand["pos"][0], cand["norm"][0], cand["ok"][0]))
        return choose(mem, cand, memory)

    def enter(i):
        return lambda module, args: current.__setitem__("layer", i)

    hooks = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(model.model.layers)]
    sequential.select_memory = periods.select_memory = spy
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        sequential.select_memory = periods.select_memory = choose
        for h in hooks:
            h.remove()
    return seen


def score_drift(model, ids: torch.Tensor) -> list[dict]:
    """Prefill ``ids [1, N]`` and return, per layer with an exact memory, the mean score of the
    candidate keys (:func:`candidate_scores`) in each position band of :data:`BANDS` that holds
    keys, and the scores' standard deviation over all bands."""
    out = []
    for li, seen in sorted(candidate_scores(model, ids).items()):
        pos = torch.cat([p[ok].float() for p, _, ok in seen])
        sc = torch.cat([s[ok].float() for _, s, ok in seen])
        bands = {f"{lo}-{hi}": round(float(sc[(pos >= lo) & (pos < hi)].mean()), 3) for lo, hi in BANDS if bool(((pos >= lo) & (pos < hi)).any())}
        out.append({"layer": li, "keys": int(pos.numel()), "score_std": round(float(sc.std()), 3), "mean_score_by_position": bands})
    return out


if __name__ == "__main__":
    sys.exit(main())
