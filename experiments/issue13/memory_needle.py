"""Issue 13 probe (session 16): does the exact memory hold the pass key?

One passkey prompt (``long_range.passkey_prompt``), untrained SmolLM2-135M converted with each
variant of ``memory.py``; a prefill through ``RFACache`` leaves every layer's ``MemoryState``; we
count, per layer, the kv heads whose memory holds every token of the needle's key digits
(the first occurrence of the key in the needle sentence) and the share of the key's tokens held.
One JSON line per variant (``--out``).
"""
import argparse
import json
import os

import torch

import hf_rfa
from hf_rfa import assets
from hf_rfa.recipes import long_range
from hf_rfa.recipes.conversion.pipeline import load_model

import importlib.util

spec = importlib.util.spec_from_file_location("mem", os.path.join(os.path.dirname(__file__), "memory.py"))
mem = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mem)

p = argparse.ArgumentParser()
p.add_argument("--variants", default="w64:favor+mem128err,w64:none+mem128")
p.add_argument("--length", type=int, default=2048)
p.add_argument("--depths", default="0.1,0.5,0.9")
p.add_argument("--recipe-model", default=None, help="a converted model folder (e.g. make main's output): variants are then mem<M>[err] added to it")
p.add_argument("--out", default=None)
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
path = str(assets.smollm2_path())
_, tok, _ = load_model(path)
key = "71432"
for name in a.variants.split(","):
    if a.recipe_model:
        model, _, _ = load_model(a.recipe_model)
        for mod in model.modules():
            if hasattr(mod, "rfa") and hasattr(mod.rfa, "memory"):
                mod.rfa.memory, mod.rfa.memory_every = int(name[3:].removesuffix("err")), 64
                mod.rfa.memory_score = "feature_error" if name.endswith("err") else "value_norm"
        model.eval()
    else:
        model, _, _ = load_model(path)
        model = hf_rfa.convert(model, hf_rfa.RFAConfig(**mem.VARIANTS[name])).eval()
    for depth in (float(x) for x in a.depths.split(",")):
        prompt, answer = long_range.passkey_prompt(tok, a.length, depth, key)
        ids = prompt.tolist()
        needle = tok(f" The pass key is {key}.", add_special_tokens=False)["input_ids"]
        start = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
        digits = list(range(start + 4, start + len(needle) - 1))  # after " The pass key is", before "."
        cache = hf_rfa.RFACache(model)
        with torch.no_grad():
            model(prompt[None], cache=cache, use_cache=True)
        per_layer = []
        for layer in cache.layers:
            st = layer.state
            pos = [set(st.mem_pos[0, h][st.mem_ok[0, h]].tolist()) for h in range(st.mem_pos.shape[1])]
            per_layer.append([round(sum(d in ph for d in digits) / len(digits), 2) for ph in pos])
        full_heads = sum(x == 1.0 for row in per_layer for x in row)
        share = sum(x for row in per_layer for x in row) / sum(len(r) for r in per_layer)
        row = {"variant": name, "length": len(ids), "depth": depth, "needle_digits": [ids[d] for d in digits], "digit_positions": digits,
               "kv_heads_holding_all_digits": full_heads, "kv_heads": sum(len(r) for r in per_layer), "mean_share_held": round(share, 3), "per_layer": per_layer}
        print(json.dumps({k: v for k, v in row.items() if k != "per_layer"}), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
