"""Issue 13 probe (session 13): per-layer choice, at equal decode state, between the recipe's
features (window 64 + 4 sinks + Hedgehog m=64 with decay: 64 + 128 state rows per head) and a
wider exact window (window 128 + 4 sinks, no features).

1. SmolLM2-135M-Instruct converted with the main job's recipe, its feature maps taken from a
   finished run's folder (``--maps``: the ``.rfa.`` tensors; LoRA does not train them, so these are
   the maps after attention transfer);
2. per-layer relative error of the layer output vs softmax (``calibration.layer_errors``) on
   ``--error-windows`` calibration windows of ``--error-context`` tokens, for the recipe and for
   window-only W128;
3. every layer where W128's error is lower (by the factor ``--margin``) becomes W128 window-only;
4. LoRA with the main job's budget (32,768 tokens @4096, stream seed 7) and perplexity @1024/4096/8192
   on the held-out eval split (4,096 / 4,096 / 8,191 tokens), as the main job measures them.
One JSON line appended to ``layer_choice.jsonl``.

    PYTHONPATH=. NT=2 .venv/bin/python experiments/issue13/layer_choice.py --maps /tmp/s12/lt262
"""
import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import hf_rfa
from hf_rfa import assets
from hf_rfa.hf.convert import build_layer, find_attention_modules
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion import calibration, transfer
from hf_rfa.recipes.conversion.loading import load_model

p = argparse.ArgumentParser()
p.add_argument("--maps", required=True, help="a run's output folder (model.safetensors with the transferred maps)")
p.add_argument("--error-context", type=int, default=4096)
p.add_argument("--error-windows", type=int, default=2)
p.add_argument("--margin", type=float, default=1.0, help="W128 where its error < margin × the recipe's")
p.add_argument("--lora-tokens", type=int, default=32768)
p.add_argument("--force", default=None, help="comma-separated layer indices to make W128 (skips the error rule)")
p.add_argument("--jsonl", default=str(Path(__file__).with_name("layer_choice.jsonl")))
a = p.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
t0 = time.time()

model, tok, _ = load_model(str(assets.smollm2_path()))
recipe = hf_rfa.RFAConfig(
    feature_map="hedgehog", num_features=64, window=64, sinks=4, decay=128, feature_input="unrotated",
    feature_map_options={"hybrid_mix": True},
)
hf_rfa.convert(model, recipe)
maps = {k: v for k, v in load_file(str(Path(a.maps) / "model.safetensors")).items() if ".rfa." in k}
missing, unexpected = model.load_state_dict(maps, strict=False)
assert not unexpected and not [k for k in missing if ".rfa." in k], (unexpected, missing)
ids = {s: evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file(s)))) for s in assets.WIKIPEDIA_SPLITS}

layers = calibration.rfa_layers(model)
recipe_layers = dict(layers)
attn = {idx: m for _, m, idx in find_attention_modules(model)}
wide = hf_rfa.RFAConfig(feature_map="none", window=128, sinks=4)
cfgm = model.config
heads, kv, hd = cfgm.num_attention_heads, cfgm.num_key_value_heads, cfgm.hidden_size // cfgm.num_attention_heads
wide_layers = {idx: build_layer(wide, idx, heads, kv, hd) for idx in layers}

batches = [(w.unsqueeze(0), None) for w in evaluation.token_windows(ids["calibration"], a.error_context, a.error_windows)]
with torch.no_grad():
    err_recipe = {e.layer: e.relative_error for e in calibration.layer_errors(model, batches, progress=False)}
    for idx, m in attn.items():
        m.rfa = wide_layers[idx]
    err_wide = {e.layer: e.relative_error for e in calibration.layer_errors(model, batches, progress=False)}
if a.force is not None:
    chosen = sorted(int(x) for x in a.force.split(",") if x)
else:
    chosen = sorted(i for i in layers if err_wide[i] < a.margin * err_recipe[i])
for idx, m in attn.items():
    m.rfa = wide_layers[idx] if idx in chosen else recipe_layers[idx]
logging.info("W128 layers: %s", chosen)
for i in sorted(layers):
    logging.info("layer %2d: recipe %.4f  W128 %.4f%s", i, err_recipe[i], err_wide[i], "  <- W128" if i in chosen else "")

rows = {}
if a.lora_tokens > 0:
    model, res = transfer.lora_finetune(model, evaluation.shuffled_batches(ids["train"], 4096, 1, 0 + 7), a.lora_tokens, lr=1e-3, r=8, progress=False)
with torch.no_grad():
    for ctx in (1024, 4096, 8192):
        r = evaluation.perplexity(model, ids["eval"], ctx, 4096, progress=False)
        rows[f"ppl@{ctx}"] = round(r["perplexity"], 3)
        logging.info("ppl @%d: %.3f (%d tokens)", ctx, r["perplexity"], r["tokens"])
line = {
    "probe": f"layer_choice.py --maps {a.maps} --error-context {a.error_context} --error-windows {a.error_windows} --margin {a.margin}"
    + (f" --force {a.force}" if a.force else "") + f" --lora-tokens {a.lora_tokens}",
    "w128_layers": chosen, "err_recipe": {i: round(err_recipe[i], 4) for i in sorted(layers)}, "err_w128": {i: round(err_wide[i], 4) for i in sorted(layers)},
    "rows": rows, "minutes": round((time.time() - t0) / 60, 1),
}
with open(a.jsonl, "a") as f:
    f.write(json.dumps(line) + "\n")
print(json.dumps(line))
