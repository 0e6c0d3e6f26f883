"""Per-head log-gain on the feature part, fitted on calibration tokens (median log Z/Zhat), evaluated on eval tokens."""
import sys, json, torch, logging
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "benchmarks"))
from out_of_window import out_of_window_mask
from hf_rfa import assets
from hf_rfa.recipes import evaluation
from hf_rfa.recipes.conversion.pipeline import load_model
from hf_rfa.recipes.conversion.calibration import capture
from hf_rfa.feature_maps import build_feature_map, derive_seed, Features
from hf_rfa.ops import random_feature_attention
torch.set_num_threads(1)
W, S, M, N = int(sys.argv[1]), 4, int(sys.argv[2]), int(sys.argv[3])
name = sys.argv[4] if len(sys.argv) > 4 else "favor+"
class Const(torch.nn.Module):
    positive = True; null = False; has_gate = False; eps = 1e-20; feature_dim = 1
    def forward_queries(s, x): return Features(torch.ones(*x.shape[:-1], 1, dtype=x.dtype), torch.zeros(x.shape[:-1], dtype=x.dtype))
    forward_keys = forward_queries
    def native_params(s, *a, **k): return None
    def features_into(s, x, out, is_query, x_scale=1.0):
        f = s.forward_queries(x); return Features(out.copy_(f.phi), f.log_scale)

model, tok, _ = load_model(str(assets.smollm2_path()))
cal = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("calibration"))))[:N]
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))[:N]
cc, ce = capture(model, cal[None]), capture(model, ev[None])
class Gain(torch.nn.Module):
    def __init__(s, fm, g): super().__init__(); s.fm, s.g = fm, g
    def __getattr__(s, k):
        try: return super().__getattr__(k)
        except AttributeError: return getattr(s.fm, k)
    def forward_keys(s, x): return s.fm.forward_keys(x)
    def forward_queries(s, x):
        f = s.fm.forward_queries(x); return Features(f.phi, f.log_scale + s.g.view(1, -1, 1).to(x.dtype))
    def native_params(s, *a, **k): return None
    def features_into(s, x, out, is_query, x_scale=1.0):
        x = x * x_scale; f = s.forward_queries(x) if is_query else s.forward_keys(x); return Features(out.copy_(f.phi), f.log_scale)
def logz(cap, fm):
    q, k = cap.q.double(), cap.k.double(); h, hk = q.shape[1], k.shape[1]; s = cap.scale
    x = q[0] * s**.5; y = k[0].repeat_interleave(h // hk, 0) * s**.5
    o = out_of_window_mask(x.shape[1], W, S); rows = o.any(-1)
    lg = (x @ y.transpose(-1, -2)).masked_fill(~o, float("-inf")).logsumexp(-1)
    fq, fk = fm.forward_queries(x), fm.forward_keys(y)
    est = (fq.phi @ fk.phi.transpose(-1, -2)) * o
    le = est.clamp_min(1e-300).log() + fq.log_scale.unsqueeze(-1) + fk.log_scale.unsqueeze(-2)
    lh = le.masked_fill(~o, float("-inf")).logsumexp(-1)
    return (lg - lh)[:, rows]  # [H, rows]
tot = {"none": 0, "fm": 0, "gain": 0}
for l in sorted(ce):
    d = ce[l].q.shape[-1]
    fm = Const() if name == "const" else build_feature_map(name, head_dim=d, num_features=M, seed=derive_seed(0, "layer", l)).double()
    g = logz(cc[l], fm).median(-1).values  # [H]
    c = ce[l]; q, k, v = c.q.double(), c.k.double(), c.v.double(); ref = c.out.double()[0]
    o = out_of_window_mask(q.shape[2], W, S); rows = o.any(-1)
    err = lambda out: float(((out[0] - ref).norm(dim=-1) / ref.norm(dim=-1))[:, rows].median())
    e_none = err(random_feature_attention(q, k, v, build_feature_map("none", d, 1), causal=True, window=W, sinks=S, scale=c.scale))
    e_fm = err(random_feature_attention(q, k, v, fm, causal=True, window=W, sinks=S, scale=c.scale))
    e_g = err(random_feature_attention(q, k, v, Gain(fm, g), causal=True, window=W, sinks=S, scale=c.scale))
    tot["none"] += e_none; tot["fm"] += e_fm; tot["gain"] += e_g
    print(json.dumps({"layer": l, "none": round(e_none, 4), "fm": round(e_fm, 4), "gain": round(e_g, 4), "g_mean": round(float(g.mean()), 2)}), flush=True)
print(json.dumps({k: round(v / len(ce), 4) for k, v in tot.items()}))
