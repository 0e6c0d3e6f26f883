"""Which layers does the original model copy through, and what memory budget follows from that?

For every layer and kv head of the original SmolLM2-135M-Instruct (exact softmax), on copy
sequences (a passage of ``--passage`` tokens, ``--gap`` tokens of other text, the same passage
again; ``long_range.copy_sequences``) drawn from the held-out-from-evaluation ``--text`` (default
Wikipedia's calibration split, disjoint from the evaluation split the recall figures use): the
attention probability that the second copy's queries (its tokens ``--skip``.. onwards, as the copy
task scores them) put on the first copy, and on its *source* key, the token after the earlier
occurrence of the current one (an induction head's target). Averaged over the query heads of each
kv head, the queries and ``--draws`` draws per gap in ``--gaps``.

Writes one JSON line per layer (``copy_mass`` and ``induction`` per kv head; ``copy_score`` and
``induction_score``: their means over the kv heads and the gaps) with per-layer memory sizes that
split a total of ``--memory`` keys per kv head × layers in proportion to one of the scores:
``copy_proportional`` / ``induction_proportional``, and ``copy_floorF`` / ``induction_floorF`` for
each ``--floors`` F (F keys in every layer, the rest in proportion). ``recall.py --per-layer FILE
--per-layer-key NAME`` reads them.

    NT=2 python research/long_range_recall/copy_layers.py --gaps 512 3584 --draws 4
"""

import argparse
import json
import logging
import os
from pathlib import Path

import torch
from transformers import AttentionInterface

from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.loading import load_model
from hf_rfa.recipes.conversion.memory_split import split_budget

logger = logging.getLogger("research.copy_layers")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the original model (default: the offline SmolLM2-135M-Instruct)")
    p.add_argument("--text", default="wikipedia:calibration")
    p.add_argument("--gaps", type=int, nargs="+", default=[512, 3584])
    p.add_argument("--passage", type=int, default=256)
    p.add_argument("--skip", type=int, default=16)
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--memory", type=int, default=256, help="keys per kv head on average over the layers (the recipe's uniform memory)")
    p.add_argument("--floors", type=int, nargs="*", default=[64, 96, 128, 160, 192, 224])
    p.add_argument("--out", default=str(Path(__file__).with_name("copy_layers.jsonl")))
    a = p.parse_args()
    if a.draws < 1 or a.passage <= a.skip + 1 or any(g < 0 for g in a.gaps):
        p.error(f"need --draws >= 1, --passage > --skip + 1 and --gaps >= 0, got draws={a.draws}, passage={a.passage}, skip={a.skip}, gaps={a.gaps}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(int(os.environ.get("NT", "2")))

    state: dict = {"gap": None}
    sums: dict[tuple[int, int], torch.Tensor] = {}  # (layer, gap) -> [2, kv heads]: copy_mass and induction, summed over draws

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """sdpa's output; on the side, the second copy's attention on the first copy and on its source keys."""
        b, h, n, d = query.shape
        hkv = key.shape[1]
        g = h // hkv
        kk = key.repeat_interleave(g, dim=1)
        scale = scaling if scaling is not None else d**-0.5
        period = a.passage + state["gap"]
        t = torch.arange(period + a.skip - 1, period + a.passage - 1)  # queries predicting tokens skip.. of the second copy
        logits = (query[:, :, t].float() @ kk.float().transpose(-1, -2)) * scale
        logits = logits.masked_fill(torch.arange(n).view(1, -1) > t.view(-1, 1), float("-inf"))
        prob = logits.softmax(-1)  # [B, H, Q, N]
        copy = prob[..., : a.passage].sum(-1)  # on the first copy
        source = prob.gather(-1, (t - period + 1).view(1, 1, -1, 1).expand(b, h, -1, 1)).squeeze(-1)
        per_head = torch.stack([copy.mean(-1).sum(0), source.mean(-1).sum(0)])  # [2, H] summed over the batch
        key_ = (module.layer_idx, state["gap"])
        sums[key_] = sums.get(key_, 0) + per_head.view(2, hkv, g).mean(-1).double()
        out = torch.nn.functional.scaled_dot_product_attention(query, kk, value.repeat_interleave(g, dim=1), is_causal=True, scale=scale)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("copy_probe", probe)
    model, tok, _ = load_model(a.model or str(assets.smollm2_path()))
    model.set_attn_implementation("copy_probe")
    model.eval()
    ids = evaluation.tokenize(tok, evaluation.load_text(a.text))
    with torch.no_grad():
        for gap in a.gaps:
            state["gap"] = gap
            for row in long_range.copy_sequences(ids, a.passage, gap, a.draws, seed=1):
                model(input_ids=row.unsqueeze(0), use_cache=False)
            logger.info("gap %d: %d draws", gap, a.draws)
    layers = sorted({i for i, _ in sums})
    mean = {(i, gap): sums[i, gap] / a.draws for i, gap in sums}
    scores = {kind: [float(sum(mean[i, gap][c].mean() for gap in a.gaps) / len(a.gaps)) for i in layers] for c, kind in enumerate(("copy", "induction"))}
    total = a.memory * len(layers)
    budgets = {}
    for kind, score in scores.items():
        budgets[f"{kind}_proportional"] = split_budget(total, score)
        budgets.update({f"{kind}_floor{f}": split_budget(total, score, f) for f in a.floors})
    with open(a.out, "w") as f:
        for j, i in enumerate(layers):
            row = {"layer": i, **{f"{kind}_score": round(score[j], 4) for kind, score in scores.items()}}
            for gap in a.gaps:
                row[f"copy_mass@{gap}"] = [round(float(x), 4) for x in mean[i, gap][0]]
                row[f"induction@{gap}"] = [round(float(x), 4) for x in mean[i, gap][1]]
            row.update({name: sizes[j] for name, sizes in budgets.items()})
            row.update({"text": a.text, "passage": a.passage, "skip": a.skip, "draws": a.draws})
            f.write(json.dumps(row) + "\n")
    for name, sizes in budgets.items():
        print(json.dumps({name: sizes, "sum": sum(sizes), "target": total}))
    for j, i in enumerate(layers):
        print(i, f"copy {scores['copy'][j]:.3f} induction {scores['induction'][j]:.3f}", *(f"{gap}: {[round(float(x), 3) for x in mean[i, gap][0]]} ind {[round(float(x), 3) for x in mean[i, gap][1]]}" for gap in a.gaps))


if __name__ == "__main__":
    main()
