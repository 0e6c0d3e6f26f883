"""Per-head calibrated gain on FAVOR+ (selected per head where it lowers calibration-layer error) -> ppl/copy."""
import sys, json, time, torch

import importlib.util
W, S, M = 256, 4, 256
NCAL, PPLTOK, DRAWS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
import hf_rfa
from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.pipeline import load_model
from hf_rfa.recipes.conversion.calibration import capture, rfa_layers
from hf_rfa.feature_maps import build_feature_map, derive_seed, Features
from hf_rfa.ops import random_feature_attention
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
from out_of_window import out_of_window_mask
class Gain(torch.nn.Module):
    def __init__(s, fm, g): super().__init__(); s.fm = fm; s.register_buffer("g", g)
    def __getattr__(s, k):
        try: return super().__getattr__(k)
        except AttributeError: return getattr(s.fm, k)
    def forward_keys(s, x): return s.fm.forward_keys(x)
    def forward_queries(s, x):
        f = s.fm.forward_queries(x); return Features(f.phi, f.log_scale + s.g.view(1, -1, 1).to(x.dtype))
    def native_params(s, *a, **k): return None
    def features_into(s, x, out, is_query, x_scale=1.0):
        x = x.float() * x_scale; f = s.forward_queries(x) if is_query else s.forward_keys(x); return Features(out.copy_(f.phi), f.log_scale)
model, tok, _ = load_model(str(assets.smollm2_path()))
cal = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("calibration"))))[:NCAL]
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
t0 = time.time()
cc = capture(model, cal[None])
gains = {}
for l in sorted(cc):
    c = cc[l]; q, k, v = c.q.double(), c.k.double(), c.v.double(); ref = c.out.double()[0]
    d = q.shape[-1]; h, hk = q.shape[1], k.shape[1]; s = c.scale
    fm = build_feature_map("favor+", head_dim=d, num_features=M, seed=derive_seed(0, "layer", l)).double()
    x = q[0] * s**.5; y = k[0].repeat_interleave(h // hk, 0) * s**.5
    o = out_of_window_mask(x.shape[1], W, S); rows = o.any(-1)
    lg = (x @ y.transpose(-1, -2)).masked_fill(~o, float("-inf")).logsumexp(-1)
    fq, fk = fm.forward_queries(x), fm.forward_keys(y)
    le = ((fq.phi @ fk.phi.transpose(-1, -2)) * o).clamp_min(1e-300).log() + fq.log_scale.unsqueeze(-1) + fk.log_scale.unsqueeze(-2)
    g = (lg - le.masked_fill(~o, float("-inf")).logsumexp(-1))[:, rows].median(-1).values
    herr = lambda out: ((out[0] - ref).norm(dim=-1) / ref.norm(dim=-1))[:, rows].mean(-1)  # [H]
    e0 = herr(random_feature_attention(q, k, v, fm, causal=True, window=W, sinks=S, scale=s))
    e1 = herr(random_feature_attention(q, k, v, Gain(fm, g), causal=True, window=W, sinks=S, scale=s))
    sel = e1 < 0.9 * e0
    gains[l] = torch.where(sel, g, torch.zeros_like(g)).float()
    print(json.dumps({"layer": l, "selected": int(sel.sum()), "e0": round(float(e0.mean()), 4), "e_sel": round(float(torch.where(sel, e1, e0).mean()), 4)}), flush=True)
print(json.dumps({"calib_sec": round(time.time() - t0, 1)}), flush=True)
del cc
for var in ["gain", "none", "favor+"]:
    model, tok, _ = load_model(str(assets.smollm2_path()))
    hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="none" if var == "none" else "favor+", num_features=M, window=W, sinks=S))
    if var == "gain":
        for l, r in rfa_layers(model).items():
            r.feature_map = Gain(r.feature_map, gains[l])
    t1 = time.time()
    r = evaluation.perplexity(model, ev, 1024, PPLTOK, progress=False)
    print(json.dumps({"variant": var, "task": "ppl1024", **r, "sec": round(time.time() - t1, 1)}), flush=True)
    if DRAWS:
        r = long_range.copy_task(model, ev, gap=512, draws=DRAWS, progress=False); r.pop("per_draw")
        print(json.dumps({"variant": var, "task": "copy512", **r}), flush=True)
