"""Issue 13 probe (session 18): why does passkey retrieval fail at depth 0.9?

For a converted model (e.g. ``make main``'s output) and each memory setting (``hf_rfa.set_memory``:
size and score), the passkey accuracy at ``--length`` (``--trials`` per depth 0.1 / 0.5 / 0.9),
and for one prompt at depth 0.9 (key 71432) what the model predicts for each answer token and the
probability it gives the true token (teacher-forced, as the passkey scorer reads it). SmolLM2's
tokenizer writes the answer ``" 71432"`` as ``" "`` + five digits, so the first probability is
that of *starting a number*, the others of the digits. One JSON line per setting to ``--out``.

    PYTHONPATH=. NT=2 .venv/bin/python experiments/issue13/passkey_first_token.py --model <make main output>
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch

import hf_rfa
from hf_rfa.recipes import long_range
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--length", type=int, default=2048)
p.add_argument("--trials", type=int, default=4)
p.add_argument("--settings", default="256:feature_error,1024:feature_error,256:value_norm", help="memory:score pairs")
p.add_argument("--out", default=str(Path(__file__).with_name("passkey_first_token.jsonl")))
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
model, tok, _ = load_model(a.model)
model.eval()
for setting in a.settings.split(","):
    mem, score = setting.split(":")
    t = time.time()
    hf_rfa.set_memory(model, int(mem), 64, score)
    r = long_range.passkey_task(model, tok, lengths=(a.length,), depths=(0.1, 0.5, 0.9), trials=a.trials, seed=0, progress=False)
    prompt, ans = long_range.passkey_prompt(tok, a.length, 0.9, "71432")
    with torch.no_grad():
        lg = model(input_ids=torch.cat([prompt, ans])[None], use_cache=False).logits[0, len(prompt) - 1 : len(prompt) + len(ans) - 1]
    row = {"model": a.model, "memory": int(mem), "score": score, "length": a.length, "trials": a.trials,
           "accuracy": r["accuracy"][str(a.length)], "key_accuracy": r["key_accuracy"][str(a.length)],
           "depth0.9_predicted": tok.decode(lg.argmax(-1)), "depth0.9_p_true": [round(float(x), 3) for x in lg.softmax(-1).gather(-1, ans[:, None]).squeeze(-1)],
           "seconds": round(time.time() - t)}
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
