"""The published model's LoRA trained again with the exact memory switched on: does the model learn
to read a memory it sees during training (README finding d)? Also the LoRA with another objective
or learning rate, or none at all (``--objective``, ``--lr``, ``--lora-tokens 0``): which LoRA keeps
the original's few-shot accuracy (``research/short_task_loss/``)?

The main job (``make main``) trains the recall preset's LoRA without memory and switches the
memory of 256 keys per kv head (``feature_error``) on after training. Here everything but the
memory is the main job's: the original SmolLM2-135M-Instruct, converted with the recall preset and
the transferred feature maps of the published model (``--maps``: the ``.rfa.`` tensors of its
model.safetensors — LoRA does not train them, so they are the maps after its attention transfer),
then the main job's LoRA (the recall preset's budget and learning rate, 65,536 tokens at 3e-4 at
context 4,096; stream seed 0 + 7, r 8, the run's autocast rule) with ``--train-memory`` keys per kv head ranked by ``feature_error`` during
the LoRA only. The global generator that initialises the adapters is seeded as the main job seeds
it (seed 0 before loading) and advanced as the main job's window-only baseline advances it (the
initialisation of that baseline's adapters, which the main job draws first), so the LoRA starts
from the published run's draw. With ``--train-memory 0`` and ``--compare out/smollm2-135m-rfa``
the script rebuilds the published model and prints the largest difference of every weight (the
check that the above is the main job's training).

``convert.py --memory 256`` (with ``--memory-after-training 0``) would train with the memory too,
but during attention transfer as well: another transfer, and on a shared 2-core CPU a slower one
(it reached the 30-minute safety limit after 432 of its 512 steps).

    NT=1 python research/long_range_recall/lora_with_memory.py --maps out/smollm2-135m-rfa \\
        --train-memory 256 --output ~/runs/recall-memory-lora
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
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import devices, transfer
from hf_rfa.recipes.conversion.loading import load_model
from hf_rfa.recipes.training.peft_utils import lora_config
from hf_rfa.presets import PRESETS

PRESET = PRESETS["recall"].training  # the main job's LoRA budget and learning rate

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--maps", required=True, help="the published model's folder (a make main output): its transferred feature maps")
p.add_argument("--train-memory", type=int, default=256, help="exact memory per kv head during the LoRA, ranked by feature_error (0: none, as in the main job)")
p.add_argument("--output", default=None, help="folder for the trained model (hf_rfa.export; its memory stays switched on)")
p.add_argument("--compare", default=None, help="a model folder to compare every weight with (e.g. the published model, with --train-memory 0)")
p.add_argument("--seed", type=int, default=0, help="the main job's seed")
p.add_argument("--objective", default="next_token", help="LoRA objective (lora.OBJECTIVES): next_token, as the main job, or distill")
p.add_argument("--lr", type=float, default=PRESET["lora_lr"], help=f"LoRA learning rate (the main job's: {PRESET['lora_lr']:g})")
p.add_argument("--lora-tokens", type=int, default=PRESET["lora_tokens"], help=f"LoRA budget (the main job's: {PRESET['lora_tokens']:,} tokens; 0: no LoRA, the transferred maps on the original weights)")
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "1")))
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

t0 = time.time()
torch.manual_seed(a.seed)  # as the main job: seeded before loading; LoRA initialises from the global generator
model, tok, _ = load_model(str(assets.smollm2_path()))
train = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("train"))))

# the main job's window-only baseline draws its adapters' initialisation first (its LoRA trains
# without further draws: no dropout); the same draws on a throw-away copy
scratch = copy.deepcopy(model)
hf_rfa.convert(scratch, hf_rfa.RFAConfig(feature_map="none", window=64, sinks=4, seed=a.seed))  # stages.window_only_baseline
from peft import get_peft_model  # noqa: E402

get_peft_model(scratch, lora_config(scratch, r=8, train_feature_maps=False))
del scratch

cfg = hf_rfa.RFAConfig.from_preset("recall", memory=a.train_memory, memory_score="feature_error")
hf_rfa.convert(model, cfg)
maps = {k: v for k, v in load_file(str(Path(a.maps) / "model.safetensors")).items() if ".rfa." in k}
missing, unexpected = model.load_state_dict(maps, strict=False)
assert not unexpected and not [k for k in missing if ".rfa." in k], (unexpected, missing)

stream = evaluation.shuffled_batches(train, 4096, 1, a.seed + 7)  # the main job's LoRA stream
autocast = devices.training_autocast("auto", devices.input_device(model), devices.weight_dtype(model))
if a.lora_tokens > 0:
    model, res = transfer.lora_finetune(model, stream, a.lora_tokens, lr=a.lr, r=8, progress=False, autocast=autocast, objective=a.objective)
    lora = {**res.as_dict(), "losses": res.losses, "lr": a.lr, "objective": a.objective}
else:
    lora = {"tokens": 0}
lora.update({"autocast": str(autocast), "train_memory": a.train_memory, "minutes_total": round((time.time() - t0) / 60, 2)})
print(json.dumps({"lora": lora}), flush=True)

if a.compare:
    ref, _, _ = load_model(a.compare)
    mine, theirs = model.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys(), sorted(set(mine) ^ set(theirs))[:10]
    diff = {k: (mine[k].float() - theirs[k].float()).abs().max().item() for k in mine}
    worst = max(diff, key=diff.get)
    print(json.dumps({"compare": a.compare, "tensors": len(diff), "identical": sum(v == 0 for v in diff.values()),
                      "max_abs_diff": diff[worst], "worst": worst}), flush=True)
if a.output:
    if a.train_memory == 0:  # as published: the memory switched on after training
        hf_rfa.set_memory(model, 256, 64, "feature_error")
    hf_rfa.export(model, a.output, tokenizer=tok, overwrite=True)
    Path(a.output, "lora_with_memory.json").write_text(json.dumps({"maps": Path(a.maps).name, **lora}, indent=2) + "\n")
    print(f"wrote {a.output}")
