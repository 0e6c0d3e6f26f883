"""(l) Does a learned score choose the memory better? A retaining probe per layer and kv head.

Locret (arXiv 2410.01805) trains small "retaining heads" that predict, from a token's own
projections, how much attention later queries will give it, and evicts the keys predicted least
important. Here the same idea as a probe (our definition, not the paper's code): for each layer
and kv head of a converted model, a ridge regression from a candidate key's un-rotated key and its
value (``[k, v, ‖k‖, ‖v‖, 1]``) to the log of the largest attention probability any query beyond
the window gives it under exact softmax of the model's own (rotated) queries and keys — the mass
the memory exists to keep. Targets come from the model itself on ``--fit-text`` (held-out
Wikipedia's training split by default; the passkey's filler is the evaluation split).

``fit``: collects targets over ``--windows`` windows of ``--length`` tokens, fits the probes
(``--out``, a ``.pt`` file) and prints, on one more window, how much of the true top ``--top``
share of keys the probe's top share holds, against ‖v‖ and a random choice.

``run``: runs another script of this folder (``needle_memory.py``, ``recall.py``; its arguments
after ``--``) with the memory's candidates scored by the probe instead of ``memory_score`` (scores
fixed at entry, as the op's are).

    NT=2 python research/long_range_recall/learned_selection.py fit --model out/smollm2-135m-rfa --out probe.pt
    NT=2 python research/long_range_recall/learned_selection.py run --probe probe.pt needle_memory.py -- \\
        --model out/smollm2-135m-rfa --lengths 4096 --trials 4 --rfa memory_score=value_norm --label learned_probe
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("learned_selection")


def key_features(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Probe inputs of keys ``[..., N, D]`` and values ``[..., N, Dv]`` → ``[..., N, D + Dv + 3]``."""
    k, v = k.double(), v.double()
    ones = torch.ones_like(k[..., :1])
    return torch.cat([k, v, k.norm(dim=-1, keepdim=True), v.norm(dim=-1, keepdim=True), ones], dim=-1)


def far_max_attention(q: torch.Tensor, k: torch.Tensor, scale: float, window: int, block: int = 512) -> torch.Tensor:
    """``log`` of the largest causal-softmax probability each key gets from a query at least
    ``window`` positions later, over the query heads of its kv head: q ``[H, N, D]`` and k ``[Hkv,
    N, D]`` (rotated) → ``[Hkv, N]`` float64 (−inf where no query is that far)."""
    h, n, _ = q.shape
    hkv = k.shape[0]
    g = h // hkv
    best = torch.zeros(hkv, n, dtype=torch.float64)
    kk = k.float().repeat_interleave(g, dim=0)
    cols = torch.arange(n)
    for i0 in range(window, n, block):
        i1 = min(n, i0 + block)
        rows = torch.arange(i0, i1).view(-1, 1)
        s = (q[:, i0:i1].float() @ kk.transpose(-1, -2)) * scale
        s = s.masked_fill(cols.view(1, -1) > rows, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = p.masked_fill(cols.view(1, -1) > rows - window, 0.0)  # keys inside the query's window: not the memory's
        blk = p.amax(dim=1).view(hkv, g, n).amax(dim=1).double()
        best = torch.maximum(best, blk)
    return torch.log(best)


class Collector:
    """Pre-hooks on every ``self_attn`` that turn one forward into per-(layer, kv head) probe
    inputs and targets for the keys ``[first, last)``. The forward is the converted model's own
    (not :func:`hf_rfa.recipes.conversion.calibration.capture`, which runs softmax in every
    layer): the probe reads the keys and values that the memory sees."""

    def __init__(self, model, window: int, span: tuple[int, int]):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.rot = apply_rotary_pos_emb
        self.window, self.span = window, span
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.hooks = [layer.self_attn.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            hs = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shape = (*hs.shape[:-1], -1, module.head_dim)
            q = module.q_proj(hs).view(shape).transpose(1, 2)[0]
            k = module.k_proj(hs).view(shape).transpose(1, 2)[0]
            v = module.v_proj(hs).view(shape).transpose(1, 2)[0]
            qr, kr = self.rot(q[None], k[None], cos, sin)
            y = far_max_attention(qr[0], kr[0], module.scaling, self.window)
            a, b = self.span
            self.rows.setdefault(i, []).append((key_features(k[:, a:b], v[:, a:b]), y[:, a:b]))

        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def fit(rows: list[tuple[torch.Tensor, torch.Tensor]], ridge: float) -> torch.Tensor:
    """Ridge weights ``[Hkv, F]`` from ``(features [Hkv, N, F], targets [Hkv, N])`` windows."""
    x = torch.cat([r[0] for r in rows], dim=1)
    y = torch.cat([r[1] for r in rows], dim=1)
    mu, sd = x.mean(1, keepdim=True), x.std(1, keepdim=True).clamp_min(1e-6)
    sd[..., -1] = 1.0
    mu[..., -1] = 0.0
    z = (x - mu) / sd
    a = z.transpose(1, 2) @ z + ridge * z.shape[1] * torch.eye(z.shape[-1], dtype=z.dtype)
    w = torch.linalg.solve(a, z.transpose(1, 2) @ y.unsqueeze(-1)).squeeze(-1)  # [Hkv, F] on standardised inputs
    w_raw = w / sd.squeeze(1)
    w_raw[:, -1] = w[:, -1] - (w[:, :-1] * mu.squeeze(1)[:, :-1] / sd.squeeze(1)[:, :-1]).sum(-1)
    return w_raw


def overlap(score: torch.Tensor, y: torch.Tensor, top: float) -> float:
    """Share of the true top ``top`` keys (by ``y [Hkv, N]``) that ``score``'s top share holds."""
    m = max(1, int(round(top * y.shape[1])))
    hits = [len(set(score[h].topk(m).indices.tolist()) & set(y[h].topk(m).indices.tolist())) / m for h in range(y.shape[0])]
    return sum(hits) / len(hits)


def windows_of(tok, text_spec: str, length: int, count: int) -> list[torch.Tensor]:
    from hf_rfa.recipes import evaluation

    ids = tok(evaluation.load_text(text_spec), add_special_tokens=False)["input_ids"]
    if len(ids) < length * count:
        raise ValueError(f"--fit-text {text_spec!r} has {len(ids)} tokens, fewer than --windows {count} × --length {length}")
    return [torch.tensor([ids[i * length : (i + 1) * length]]) for i in range(count)]


def published_scores(model, ids: torch.Tensor, span: tuple[int, int]) -> dict[int, torch.Tensor]:
    """Each layer's candidate scores as the model's own ``memory_score`` gave them in one prefill
    of ``ids`` (:func:`needle_memory.candidate_scores`), for the keys ``[first, last)`` →
    ``{layer: [Hkv, last − first]}`` (−inf where a key was never a candidate)."""
    from needle_memory import candidate_scores

    a, b = span
    out: dict[int, torch.Tensor] = {}
    for li, seen in candidate_scores(model, ids).items():
        row = out[li] = torch.full((seen[0][0].shape[0], b - a), float("-inf"), dtype=torch.float64)
        for pos, sc, ok in seen:
            keep = ok & (pos >= a) & (pos < b)
            for h in range(pos.shape[0]):
                row[h, pos[h][keep[h]] - a] = sc[h][keep[h]].double()
    return out


def run_fit(a) -> None:
    from hf_rfa.recipes.conversion.loading import load_model

    model, tok, _ = load_model(a.model)
    model.eval()
    window = int(model.config.rfa_config["window"])
    span = (int(model.config.rfa_config.get("sinks", 0)), a.length - a.tail)
    wins = windows_of(tok, a.fit_text, a.length, a.windows + 1)
    col = Collector(model, window, span)
    try:
        for j, ids in enumerate(wins):
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            log.info("window %d of %d collected", j + 1, len(wins))
    finally:
        col.remove()
    own = published_scores(model, wins[-1], span)
    probes, report = {}, []
    for li, rows in sorted(col.rows.items()):
        w = fit(rows[:-1], a.ridge)
        x, y = rows[-1]
        pred = (x @ w.unsqueeze(-1)).squeeze(-1)
        vnorm = x[..., -2]
        gen = torch.Generator().manual_seed(li)
        rnd = torch.rand(y.shape, generator=gen, dtype=torch.float64)
        probes[li] = w.float()
        report.append((li, overlap(pred, y, a.top), overlap(own[li], y, a.top) if li in own else float("nan"), overlap(vnorm, y, a.top), overlap(rnd, y, a.top), float(torch.corrcoef(torch.stack([pred.flatten(), y.flatten()]))[0, 1])))
    torch.save({"probes": probes, "window": window, "fit_text": a.fit_text, "windows": a.windows, "length": a.length, "ridge": a.ridge}, a.out)
    score = model.config.rfa_config.get("memory_score", "value_norm")
    print(f"| layer | probe top-{a.top:.0%} overlap | {score} (the model's) | ‖v‖ | random | probe r |")
    print("|---|---|---|---|---|---|")
    for row in report:
        print("| " + " | ".join([str(row[0])] + [f"{x:.3f}" for x in row[1:]]) + " |")
    mean = [sum(r[i] for r in report) / len(report) for i in range(1, 6)]
    print("| mean | " + " | ".join(f"{x:.3f}" for x in mean) + " |")
    held_ids = wins[-1][0, span[0] : span[1]].tolist()
    for li in a.token_layers:
        x, y = col.rows[li][-1]
        print(f"layer {li}: {top_tokens(tok, held_ids, (x @ probes[li].double().unsqueeze(-1)).squeeze(-1), a.top)} (probe), {top_tokens(tok, held_ids, y, a.top)} (true)")


def top_tokens(tok, ids: list[int], score: torch.Tensor, top: float, shown: int = 8) -> str:
    """The most frequent tokens among the top ``top`` share of keys by ``score [Hkv, N]`` (kv heads
    pooled), and the share of those keys that are digits."""
    import collections

    m = max(1, int(round(top * score.shape[1])))
    picked = [ids[j] for h in range(score.shape[0]) for j in score[h].topk(m).indices.tolist()]
    words = collections.Counter(tok.decode([t]) for t in picked)
    digits = sum(tok.decode([t]).strip().isdigit() for t in picked) / len(picked)
    return ", ".join(f"{w!r} {n}" for w, n in words.most_common(shown)) + f"; digits {digits:.1%}"


def install_probe(probe_file: Path, keep_layers: tuple[int, ...] = (), mix: float = 0.0) -> None:
    """Score the memory's candidates by the probe in every later load of a model (``run``), except
    in ``keep_layers``, which keep the model's own ``memory_score``; with ``mix > 0`` the score is
    the model's own plus ``mix`` × the probe's (both log2)."""
    import hf_rfa.recipes.conversion.loading as loading
    from hf_rfa.ops.memory import periods, sequential, terms
    from hf_rfa.ops.memory.scores import SCORE_BITS

    probes = torch.load(probe_file)["probes"]
    current = {"layer": -1, "call": None}
    prepare, choose, load = terms.prepare_call, terms.select_memory, loading.load_model

    def spy_prepare(*args, **kwargs):
        c = prepare(*args, **kwargs)
        current["call"] = c
        return c

    def spy_select(mem, cand, memory):
        if current["layer"] in keep_layers:
            return choose(mem, cand, memory)
        c = current["call"]
        local = (cand["pos"] - c.pos0).clamp(0, c.lv_raw.shape[2] - 1)
        gk = terms.gather_slots(c.lkf_raw if c.lkf_raw is not None else c.lk_raw, local)
        gv = terms.gather_slots(c.lv_raw, local)
        w = probes[current["layer"]].double()  # [Hkv, F]
        s = (key_features(gk, gv) @ w.view(1, w.shape[0], -1, 1)).squeeze(-1) / math.log(2)
        if mix > 0:
            s = cand["norm"].double() + mix * s
        cand = {**cand, "norm": (torch.round(s * 2**SCORE_BITS) / 2**SCORE_BITS).to(cand["norm"].dtype)}
        return choose(mem, cand, memory)

    def spy_load(*args, **kwargs):
        out = load(*args, **kwargs)
        for i, layer in enumerate(out[0].model.layers):
            layer.register_forward_pre_hook(lambda module, a, i=i: current.__setitem__("layer", i))
        return out

    for mod in (periods, sequential):
        mod.prepare_call, mod.select_memory = spy_prepare, spy_select
    loading.load_model = spy_load


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit", help="collect targets, fit the probes, print their overlap with the true top keys")
    f.add_argument("--model", required=True)
    f.add_argument("--fit-text", default="wikipedia:train")
    f.add_argument("--length", type=int, default=4096)
    f.add_argument("--windows", type=int, default=4, help="windows to fit on (one more is held out for the overlap)")
    f.add_argument("--tail", type=int, default=1024, help="keys this close to a window's end are left out (few far queries)")
    f.add_argument("--ridge", type=float, default=1e-3)
    f.add_argument("--top", type=float, default=0.06, help="the share of keys the overlap compares (256 of 4k ≈ 6 %%)")
    f.add_argument("--out", type=Path, default=Path("probe.pt"))
    f.add_argument("--token-layers", type=int, nargs="*", default=[3, 18, 23], help="print the most frequent tokens of these layers' top keys (probe and true)")
    n = sub.add_parser("run", help="another script of this folder with the memory scored by the probe (its arguments after --)")
    n.add_argument("--probe", type=Path, required=True)
    n.add_argument("script", choices=["needle_memory.py", "recall.py"])
    n.add_argument("--mix", type=float, default=0.0, help="score = the model's own memory_score + MIX × the probe's (0: the probe's alone)")
    n.add_argument("--keep-layers", default="", help="comma-separated layers that keep the model's own memory_score (e.g. the copy layers: 17,18,20)")
    n.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("NT", "2")))
    if a.command == "fit":
        run_fit(a)
        return
    import runpy

    install_probe(a.probe, tuple(int(x) for x in a.keep_layers.split(",") if x.strip()), a.mix)
    script = Path(__file__).with_name(a.script)
    sys.argv = [str(script)] + (a.rest[1:] if a.rest[:1] == ["--"] else a.rest)
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    sys.exit(main())
