"""Exact window or exact memory? Train the LoRA *with* the exact memory switched on, instead of adding
the memory after training (the main job's ``--memory-after-training``), and a larger memory.

Arms, each the main job's LoRA (32,768 tokens at context 4096, stream seed 7, r 8, lr 1e-3, the
run's autocast rule) on a fresh copy of SmolLM2-135M-Instruct:

- ``recipe``: the main job's recipe (Hedgehog m=64 + window 64 + 4 sinks + decay 128, un-rotated
  feature inputs, hybrid mix) with its feature maps taken from a finished run (``--maps``: the
  ``.rfa.`` tensors of its model.safetensors — LoRA does not train them, so they are the maps after
  attention transfer) and memory ``--train-memory`` ranked by ``feature_error`` during the LoRA;
- ``baseline``: window-only W64 + 4 sinks + the same memory ranked by ‖v‖ during its LoRA;
- ``published``: no training — the finished run's model itself (``--published``; its LoRA ran
  without memory);
- ``window<W>`` (e.g. ``window320``): window-only with a window of W + the same 4 sinks
  and no memory, its own LoRA — the window-only model with as many exact keys per query as the
  recipe's window 64 + memory 256 hold (evaluate it with ``--eval-memory 0``).

``--window`` gives the recipe and baseline arms another exact window (the maps stay
those transferred at 64), to compare recipes at an equal count of exact keys per query (window +
memory) with ``window<W>``.

After training each arm is evaluated with each memory size of ``--eval-memory`` switched on
(``hf_rfa.set_memory``; the recipe and the published model rank by ``feature_error``, the
baseline by ‖v‖) like the main job: copy @512 (--draws draws), passkey at --passkey-length
(--trials per depth), perplexity @1024 / @4096 (4,096 eval tokens). JSON lines to --out.

    NT=2 python research/window_vs_memory/window_vs_memory.py --maps out/smollm2-135m-rfa --arms recipe,baseline --train-memory 0 --eval-memory 256
"""

import argparse
import copy
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import hf_rfa
from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion import precision, transfer
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--maps", default=None, help="a run's output folder (model.safetensors with the transferred maps; arm recipe)")
p.add_argument("--arms", default="recipe,baseline")
p.add_argument("--train-memory", type=int, default=128, help="memory during the LoRA (0: none, as in the main job)")
p.add_argument("--eval-memory", default="128,256", help="memory sizes switched on (hf_rfa.set_memory) for the evaluations after training")
p.add_argument("--window", type=int, default=64, help="arms recipe and baseline: the exact window (the main job's 64; the maps were transferred at 64)")
p.add_argument("--published", default=None, help="arm 'published': evaluate this finished run's model (no training)")
p.add_argument("--lora-tokens", type=int, default=32768)
p.add_argument("--lora-context", type=int, default=4096)
p.add_argument("--draws", type=int, default=2)
p.add_argument("--trials", type=int, default=4)
p.add_argument("--passkey-length", type=int, default=1024)
p.add_argument("--contexts", default="1024,4096", help="perplexity contexts (4,096 eval tokens each; 8192: 8,192 as in the main job)")
p.add_argument("--copy3584", action="store_true", help="also the copy task at gap 3,584")
p.add_argument("--out", default=str(Path(__file__).with_name("result.jsonl")))
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

base, tok, _ = load_model(str(assets.smollm2_path()))
ids = {s: evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file(s)))) for s in ("train", "eval")}
if "recipe" in a.arms.split(",") and not a.maps:
    p.error("--arms recipe needs --maps")
maps = {k: v for k, v in load_file(str(Path(a.maps) / "model.safetensors")).items() if ".rfa." in k} if a.maps else {}
for arm in a.arms.split(","):
    t0 = time.time()
    model = copy.deepcopy(base)
    if arm == "recipe":
        cfg = hf_rfa.RFAConfig(feature_map="hedgehog", num_features=64, window=a.window, sinks=4, decay=128, feature_input="unrotated",
                               feature_map_options={"hybrid_mix": True}, memory=a.train_memory, memory_score="feature_error")
        hf_rfa.convert(model, cfg)
        missing, unexpected = model.load_state_dict(maps, strict=False)
        assert not unexpected and not [k for k in missing if ".rfa." in k], (unexpected, missing)
    elif arm == "baseline":
        hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="none", window=a.window, sinks=4, memory=a.train_memory, memory_score="value_norm"))
    elif arm == "published":
        model, _, _ = load_model(a.published)
    elif arm.startswith("window") and arm[len("window"):].isdigit():
        hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="none", window=int(arm[len("window"):]), sinks=4))
    else:
        raise ValueError(f"--arms: recipe, baseline, published or window<W>, got {arm!r}")
    lora = None
    if arm != "published":
        stream = evaluation.shuffled_batches(ids["train"], a.lora_context, 1, 0 + 7)  # the main job's LoRA stream (seed 0 + 7)
        autocast = precision.resolve_autocast("auto", torch.device("cpu"))
        model, res = transfer.lora_finetune(model, stream, a.lora_tokens, lr=1e-3, r=8, progress=False, autocast=autocast)
        lora = {**res.as_dict(), "autocast": str(autocast)}
    model.eval()
    score = "value_norm" if arm == "baseline" or arm.startswith("window") else "feature_error"
    for mem in (int(x) for x in a.eval_memory.split(",")):
        t1 = time.time()
        if mem or not arm.startswith("window"):
            hf_rfa.set_memory(model, mem, 64, score)
        row = {"arm": arm, "train_memory": 0 if arm == "published" or arm.startswith("window") else a.train_memory, "eval_memory": mem, "score": score, "maps": a.maps, "lora": lora, **({"window": a.window} if arm in ("recipe", "baseline") else {})}
        with torch.no_grad():
            for ctx in (int(x) for x in a.contexts.split(",") if x):
                row[f"ppl@{ctx}"] = evaluation.perplexity(model, ids["eval"], ctx, max(4096, ctx), progress=False)["perplexity"]
            row["copy512"] = long_range.copy_task(model, ids["eval"], gap=512, draws=a.draws, seed=0, progress=False)
            if a.copy3584:
                row["copy3584"] = long_range.copy_task(model, ids["eval"], gap=3584, draws=a.draws, seed=0, progress=False)
            row["passkey"] = long_range.passkey_task(model, tok, lengths=(a.passkey_length,), depths=(0.1, 0.5, 0.9), trials=a.trials, seed=0, progress=False)
        row["minutes"] = round((time.time() - t0) / 60, 2)
        row["eval_minutes"] = round((time.time() - t1) / 60, 2)
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
