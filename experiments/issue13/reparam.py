"""Issue 13 experiment: kernel-preserving reparametrisation of q/k before the feature map.
key centering (softmax-invariant) + a per-kv-head SPD transform A (q -> A^-1 q, k -> A k)
that minimises E|x|^2 + E|y|^2 (the exponent of positive-RF variance). One JSON line per result."""
import argparse, json, time, logging, math
import torch
import hf_rfa
from hf_rfa import assets
from hf_rfa.recipes import evaluation, long_range
from hf_rfa.recipes.conversion.pipeline import load_model
from hf_rfa.recipes.conversion import calibration
from hf_rfa.hf.attention import RFAAttention

p = argparse.ArgumentParser()
p.add_argument("--variants", default="none,favor+,favor+:center,favor+:center+A")
p.add_argument("--m", type=int, default=256)
p.add_argument("--window", type=int, default=256)
p.add_argument("--sinks", type=int, default=4)
p.add_argument("--tasks", default="ppl1024,copy512")
p.add_argument("--calib-tokens", type=int, default=4096)
p.add_argument("--ppl-tokens", type=int, default=8192)
p.add_argument("--draws", type=int, default=8)
a = p.parse_args()
torch.set_num_threads(int(__import__("os").environ.get("NT", "2")))
logging.basicConfig(level=logging.WARNING)

def sqrtm(M):
    e, V = torch.linalg.eigh(M)
    return (V * e.clamp_min(1e-12).sqrt()) @ V.T

def fit(q, k):  # q [H,N,D] (heads of one kv group pooled), k [N,D]  (already * scale^.5)
    q = q.reshape(-1, q.shape[-1]).double(); k = k.double()
    mu = k.mean(0)
    kc = k - mu
    Mq = q.T @ q / len(q); Mk = kc.T @ kc / len(kc)
    eye = torch.eye(len(mu), dtype=torch.float64) * 1e-6
    Mq, Mk = Mq + eye * Mq.trace() / len(mu), Mk + eye * Mk.trace() / len(mu)
    Rk = sqrtm(Mk); Rki = torch.linalg.inv(Rk)
    P = Rki @ sqrtm(Rk @ Mq @ Rk) @ Rki
    A = sqrtm(P)
    return mu, A

ORIG_FWD = RFAAttention.forward
def fwd(self, query, key, value, attention_mask, causal, scale, **kw):
    rp = getattr(self, "_rp", None)
    if rp is not None:
        mu, A, Ai = rp  # mu [Hkv,D] in unscaled units; A [Hkv,D,D]
        hk = key.shape[1]; g = query.shape[1] // hk
        key = key - mu[None, :, None, :].to(key.dtype)
        if A is not None:
            key = torch.einsum("bhnd,hed->bhne", key, A.to(key.dtype))
            Aq = Ai.repeat_interleave(g, 0).to(query.dtype)
            query = torch.einsum("bhnd,hed->bhne", query, Aq)
    return ORIG_FWD(self, query, key, value, attention_mask, causal, scale, **kw)
RFAAttention.forward = fwd

model, tok, _ = load_model(str(assets.smollm2_path()))
cal = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("calibration"))))
ev = evaluation.tokenize(tok, evaluation.load_text(str(assets.wikipedia_text_file("eval"))))
t0 = time.time()
caps = {}
for w in evaluation.token_windows(cal, 1024, a.calib_tokens // 1024):
    for l, c in calibration.capture(model, w[None]).items():
        caps.setdefault(l, []).append(c)
fits = {}
for l, cs in caps.items():
    s = cs[0].scale
    q = torch.cat([c.q[0] for c in cs], 1) * s ** 0.5  # [H,N,D]
    k = torch.cat([c.k[0] for c in cs], 1) * s ** 0.5
    hk = k.shape[0]; g = q.shape[0] // hk
    mus, As = [], []
    for h in range(hk):
        mu, A = fit(q[h * g:(h + 1) * g], k[h])
        mus.append(mu / s ** 0.5); As.append(A)
    mu = torch.stack(mus).float(); A = torch.stack(As)
    Ai = torch.linalg.inv(A)
    # stats: mean |x|^2+|y|^2 before / after
    kk = k - (mu * s ** 0.5)[:, None]
    before = float(q.pow(2).sum(-1).mean() + k.pow(2).sum(-1).mean())
    cen = float(q.pow(2).sum(-1).mean() + kk.pow(2).sum(-1).mean())
    x = torch.einsum("hnd,hed->hne", q.double(), Ai.repeat_interleave(g, 0)); y = torch.einsum("hnd,hed->hne", kk.double(), A)
    after = float(x.pow(2).sum(-1).mean() + y.pow(2).sum(-1).mean())
    fits[l] = (mu, A.float(), Ai.float())
    print(json.dumps({"layer": l, "sq_before": round(before, 2), "sq_centered": round(cen, 2), "sq_after": round(after, 2)}), flush=True)
del caps
print(json.dumps({"calib_sec": round(time.time() - t0, 1)}), flush=True)

for var in a.variants.split(","):
    fm, _, mode = var.partition(":")
    model, tok, _ = load_model(str(assets.smollm2_path()))
    if fm != "softmax":
        hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map=fm, num_features=a.m, window=a.window, sinks=a.sinks))
        for l, rfa in calibration.rfa_layers(model).items():
            mu, A, Ai = fits[l]
            rfa._rp = None if not mode else (mu, A if "A" in mode else None, Ai if "A" in mode else None)
    for task in a.tasks.split(","):
        t1 = time.time()
        if task.startswith("ppl"):
            r = evaluation.perplexity(model, ev, int(task[3:]), a.ppl_tokens, progress=False)
        else:
            r = long_range.copy_task(model, ev, gap=int(task[4:]), draws=a.draws, progress=False); r.pop("per_draw")
        print(json.dumps({"variant": var, "m": a.m, "W": a.window, "S": a.sinks, "task": task, **r, "sec": round(time.time() - t1, 1)}), flush=True)
