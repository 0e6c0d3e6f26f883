"""Where one attention-transfer step of the main job's recipe goes: the teacher's capture and the
fit of each query block (``attention_transfer(query_blocks=4, queries=256)`` at context 1,024).

    python benchmarks/transfer_step.py --threads 2 --repeats 2

SmolLM2-135M (offline asset) converted with ``make main``'s recipe (Hedgehog m=64 + window 64 + 4
sinks + decay on un-rotated q/k), one 1,024-token train sequence; prints, per repeat, the seconds
of :func:`~hf_rfa.recipes.conversion.calibration.capture` (one softmax forward of the model) and
of the 30 layers' forward + backward for the 256 queries ending at 1,024, 768, 512 and 256
(:func:`~hf_rfa.recipes.conversion.transfer.transfer_output`, the loss of ``attention_transfer``),
and the seconds per sequence for 1–4 blocks. Each repeat is one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="timed repeats after one warm-up")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--queries", type=int, default=256)
    a = p.parse_args(argv)
    if a.context % a.queries:
        raise ValueError(f"--context ({a.context}) must be a multiple of --queries ({a.queries})")
    torch.set_num_threads(a.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rfa
    from hf_rfa import assets
    from hf_rfa.recipes.conversion.calibration import capture, rfa_layers
    from hf_rfa.recipes.conversion.transfer import _masked_mse, transfer_output
    from train_step import RECIPES  # the main job's recipe

    path = str(assets.smollm2_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = hf_rfa.convert(model, hf_rfa.RFAConfig(**RECIPES["main"])).eval()
    for q in model.parameters():
        q.requires_grad_(False)
    layers = rfa_layers(model)
    for rfa in layers.values():
        for q in rfa.parameters():
            q.requires_grad_(True)
    text = open(assets.wikipedia_text_file("train")).read()[: 40 * a.context]
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids[:, : a.context]
    blocks = a.context // a.queries
    for rep in range(a.repeats + 1):
        t = time.perf_counter()
        caps = capture(model, ids)
        cap_s = time.perf_counter() - t
        fits = []
        for b in range(blocks):
            t = time.perf_counter()
            for idx, rfa in layers.items():
                cap = caps[idx].queries_ending_at(a.context - b * a.queries, a.queries)
                (_masked_mse(transfer_output(rfa, cap), cap) / len(layers)).backward()
            fits.append(time.perf_counter() - t)
        if rep == 0:
            continue  # warm-up
        per_seq = {str(k): round(cap_s + sum(fits[:k]), 3) for k in range(1, blocks + 1)}
        print(json.dumps({"capture_s": round(cap_s, 3), "fit_s": [round(x, 3) for x in fits], "seconds_per_sequence_by_blocks": per_seq, "threads": a.threads}), flush=True)


if __name__ == "__main__":
    main()
