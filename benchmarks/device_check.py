"""The GPU device check: twin errors of each GPU backend, layer and model speed vs SDPA, decoding.

Writes Markdown tables into OUT (each headed by the device's name), one section at a time; a
section or row that fails writes ``failed: <reason>`` and the run goes on (exit 0 unless OUT
cannot be written):

(``--sections`` picks among ``layer``, ``prefill``, ``decode``, ``profile`` and ``twins``, run in
that order.)

- ``profile.md``: where one layer's forward + backward spends its time at the first layer length
  (the top kernels by device time, their call counts, and the count of every kernel launched);

- ``twins.md``: forward and backward of every backend (``torch``, ``flex``, ``fla``, ``auto``) on
  the device in fp32 and bf16 against the CPU ``torch`` backend in fp32 (relative errors);
- ``layer.md``: one SmolLM2-135M attention layer (9 query heads, 3 kv heads, head dim 64) of the
  recommended preset (``RFAConfig.from_preset("recall")``): prefill (no grad) and forward + backward,
  bf16, vs SDPA (flash) at 2k / 8k / 16k / 32k tokens;
- ``prefill.md``: the whole model's no-grad prefill, original (SDPA) vs converted;
- ``decode.md``: greedy decoding tokens/s at batch 1 and 32, the constant-memory ``RFACache``
  vs the original with ``DynamicCache``, and the cache bytes.

The model: the offline SmolLM2-135M-Instruct where it is already prepared on the machine
(``python -m hf_rfa.assets``), else a randomly initialised model of its shape (the tables say which;
speed does not depend on the weights). ``--cpu-smoke``: tiny sizes on the CPU, to run the whole
script where no GPU is (the test suite does).

    python benchmarks/device_check.py --out OUTDIR [--cpu-smoke] [--budget 300]
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("device_check")

#: SmolLM2-135M's shape (its config.json), for a random model where the asset is not prepared
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=4096, tie_word_embeddings=True)


@dataclass
class Plan:
    """Sizes of one run: full on a GPU, tiny with ``--cpu-smoke``."""

    device: torch.device
    #: the goals' lengths first (a layer at 16k, the model at 32k), so that a short budget still
    #: measures them (fla-core autotunes its kernels on first use of each shape: minutes in all)
    layer_n: tuple[int, ...] = (16384, 2048, 8192, 32768)
    model_n: tuple[int, ...] = (32768, 2048, 8192)
    batches: tuple[int, ...] = (1, 32)
    prompt: int = 512
    new_tokens: int = 64
    twin_n: int = 1024
    reps: int = 3
    shape: dict = field(default_factory=lambda: dict(SMOLLM2))
    recipe: dict | None = None


def plan_for(cpu_smoke: bool) -> Plan:
    if not cpu_smoke:
        return Plan(torch.device("cuda"))
    return Plan(torch.device("cpu"), layer_n=(128, 256), model_n=(128,), batches=(1, 2), prompt=32, new_tokens=4, twin_n=96, reps=1,
                shape=dict(TINY), recipe=dict(feature_map="favor+", num_features=16, window=16, sinks=2))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}; --cpu-smoke: tiny sizes, not a measurement)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after one warm-up (compiles, allocator)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def attempt(fn, *args):
    """``fn(*args)``, or ``"failed: <reason>"`` (one line) when it raises."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a device check reports every failure and goes on
        logger.warning("%s failed: %s", getattr(fn, "__name__", fn), exc)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def table(title: str, device: torch.device, header: list[str], rows: list[list]) -> str:
    lines = [f"# {title}", "", f"Device: {device_name(device)}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(x) for x in r) + " |")
    return "\n".join(lines) + "\n"


def _cell(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x).replace("|", "/")


def recipe(plan: Plan):
    import hf_rfa

    return hf_rfa.RFAConfig(**plan.recipe) if plan.recipe else hf_rfa.RFAConfig.from_preset("recall")


# ---- twins -----------------------------------------------------------------------------------
def _twin_inputs(plan: Plan):
    g = torch.Generator().manual_seed(0)
    s = plan.shape
    h, hkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    q, k, v = (0.5 * torch.randn(1, x, plan.twin_n, d, generator=g) for x in (h, hkv, hkv))
    up = torch.randn(1, h, plan.twin_n, d, generator=g)
    return q, k, v, up


def _op_run(fm, q, k, v, up, device, backend, dtype, cfg):
    import hf_rfa

    fm = fm.to(device)
    fm.zero_grad()
    xs = [x.to(device=device, dtype=dtype).detach().requires_grad_() for x in (q, k, v)]
    seen = _Lines()
    op_log = logging.getLogger("hf_rfa.ops.attention")
    level = op_log.level
    op_log.addHandler(seen)
    op_log.setLevel(logging.DEBUG)
    try:
        out = hf_rfa.random_feature_attention(*xs, fm, window=cfg.window, sinks=cfg.sinks, backend=backend)
    finally:
        op_log.removeHandler(seen)
        op_log.setLevel(level)
    (out.float() * up.to(device)).sum().backward()
    ran = seen.lines[-1].split("backend ")[1].split(" ")[0] if seen.lines else "?"
    return out.detach().float().cpu(), [x.grad.float().cpu() for x in xs], ran


class _Lines(logging.Handler):
    """Collects the op's DEBUG lines (which backend ran)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def twin_rows(plan: Plan) -> list[list]:
    import hf_rfa

    cfg = recipe(plan)
    s = plan.shape
    fm = hf_rfa.build_feature_map(cfg.feature_map, head_dim=s["head_dim"], num_features=cfg.num_features, seed=0)
    q, k, v, up = _twin_inputs(plan)
    ref_out, ref_grads, _ = _op_run(fm, q, k, v, up, torch.device("cpu"), "torch", torch.float32, cfg)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    rows = []
    for backend in ("torch", "flex", "fla", "auto"):
        for dtype in (torch.float32, torch.bfloat16):
            res = attempt(_op_run, fm, q, k, v, up, plan.device, backend, dtype, cfg)
            name = str(dtype).replace("torch.", "")
            if isinstance(res, str):
                rows.append([backend, "", name, res, ""])
                continue
            out, grads, ran = res
            rows.append([backend, ran, name, rel(out, ref_out), max(rel(a, b) for a, b in zip(grads, ref_grads))])
    return rows


# ---- one layer ---------------------------------------------------------------------------------
def _layer_case(plan: Plan, n: int, grad: bool):
    import hf_rfa
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    cfg, s, dev = recipe(plan), plan.shape, plan.device
    h, hkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fm = hf_rfa.build_feature_map(cfg.feature_map, head_dim=d, num_features=cfg.num_features, seed=0).to(dev)
    q, k, v = (torch.randn(1, x, n, d, device=dev, dtype=dt, requires_grad=grad) for x in (h, hkv, hkv))
    # SDPA reads kv heads repeated per query head (as transformers' repeat_kv), made outside the timing
    ke, ve = (x.detach().repeat_interleave(h // hkv, dim=1).requires_grad_(grad) for x in (k, v))

    def run_rfa():
        out = hf_rfa.random_feature_attention(q, k, v, fm, window=cfg.window, sinks=cfg.sinks)
        if grad:
            out.sum().backward()

    def run_sdpa():
        if dev.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = sdpa(q, ke, ve, is_causal=True)
        else:
            out = sdpa(q, ke, ve, is_causal=True)
        if grad:
            out.sum().backward()

    with torch.set_grad_enabled(grad):
        return timed(run_sdpa, dev, plan.reps), timed(run_rfa, dev, plan.reps)


def layer_rows(plan: Plan, deadline: float) -> list[list]:
    rows = []
    for n in plan.layer_n:
        row = [n]
        for grad in (False, True):
            if time.monotonic() > deadline:
                row += ["skipped: time budget", "", ""]
                continue
            res = attempt(_layer_case, plan, n, grad)
            row += [res, "", ""] if isinstance(res, str) else [res[0], res[1], res[0] / res[1]]
        rows.append(row)
    return rows


def profile_rows(plan: Plan, n: int, top: int = 15) -> list[list]:
    """Where one layer's forward + backward (the recipe, ``auto`` backend) spends its time at ``n``
    tokens: the ``top`` device kernels (CPU ops with ``--cpu-smoke``) by total time, with their
    call counts, after one warm-up; the last row sums every kernel."""
    import hf_rfa
    from torch.profiler import ProfilerActivity, profile

    cfg, s, dev = recipe(plan), plan.shape, plan.device
    h, hkv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fm = hf_rfa.build_feature_map(cfg.feature_map, head_dim=d, num_features=cfg.num_features, seed=0).to(dev)
    q, k, v = (torch.randn(1, x, n, d, device=dev, dtype=dt, requires_grad=True) for x in (h, hkv, hkv))

    def step():
        hf_rfa.random_feature_attention(q, k, v, fm, window=cfg.window, sinks=cfg.sinks).sum().backward()

    step()
    sync(dev)
    cuda = dev.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        sync(dev)
    key = "device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    rows = [[e.key[:70], e.count, getattr(e, key) / 1e3, getattr(e, key) / max(total, 1e-9)] for e in events[:top]]
    rows.append([f"all {len(events)} kernels", sum(e.count for e in events), total / 1e3, 1.0])
    return rows


# ---- the whole model ---------------------------------------------------------------------------
def load_models(plan: Plan):
    """``(original, converted, source)`` on the device, bf16 on CUDA."""
    import transformers as tf

    import hf_rfa

    source = "random weights of SmolLM2-135M's shape (the offline asset is not prepared here)"
    model = None
    if plan.device.type == "cuda":
        from hf_rfa.assets import store

        folder = store.cache_dir() / "smollm2-135m-instruct"
        if (folder / "config.json").is_file():
            model = tf.AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa")
            source = "SmolLM2-135M-Instruct (offline asset)"
    else:
        source = "tiny random Llama (--cpu-smoke)"
    if model is None:
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**plan.shape, attn_implementation="sdpa"))
    dt = torch.bfloat16 if plan.device.type == "cuda" else torch.float32
    converted = hf_rfa.convert(copy.deepcopy(model), recipe(plan))  # converted where loaded, then moved
    return model.to(device=plan.device, dtype=dt).eval(), converted.to(device=plan.device, dtype=dt).eval(), source


def prefill_rows(plan: Plan, models, deadline: float) -> list[list]:
    model, converted, _ = models
    rows = []
    for n in plan.model_n:
        if time.monotonic() > deadline:
            rows.append([n, "skipped: time budget", "", ""])
            continue
        ids = torch.randint(3, plan.shape["vocab_size"], (1, n), device=plan.device, generator=torch.Generator(device=plan.device).manual_seed(n))

        def fwd(m, flash=False):
            with torch.no_grad(), _flash_only(plan.device if flash else None):
                return timed(lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1), plan.device, plan.reps)

        a, b = attempt(fwd, model, True), attempt(fwd, converted)
        if isinstance(a, str):  # flash refused (e.g. a mask it cannot take): SDPA's own choice, said so
            a = attempt(fwd, model)
            a = f"{a:.3g} (SDPA default; flash refused)" if not isinstance(a, str) else a
        rows.append([n, a, b, a / b if isinstance(a, float) and isinstance(b, float) else ""])
    return rows


def _flash_only(device: torch.device | None):
    """SDPA restricted to its flash kernel on CUDA (a null context elsewhere or for None)."""
    import contextlib

    if device is None or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _decode(model, plan: Plan, batch: int) -> tuple[float, int]:
    """Greedy decoding of ``new_tokens`` after a ``prompt``-token prefill: (tokens/s, cache bytes)."""
    from transformers import DynamicCache

    import hf_rfa

    dev = plan.device
    ids = torch.randint(3, plan.shape["vocab_size"], (batch, plan.prompt), device=dev, generator=torch.Generator(device=dev).manual_seed(batch))
    rfa = hf_rfa.hf.cache.uses_rfa(model)
    with torch.inference_mode():
        cache = hf_rfa.RFACache(model) if rfa else DynamicCache(config=model.config)
        nxt = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(plan.new_tokens):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        secs = time.perf_counter() - t0
    nbytes = cache.nbytes() if rfa else sum(x.keys.numel() * x.keys.element_size() * 2 for x in cache.layers if x.keys is not None)
    return batch * plan.new_tokens / secs, nbytes


def decode_rows(plan: Plan, models, deadline: float) -> list[list]:
    model, converted, _ = models
    rows = []
    for batch in plan.batches:
        for name, m in (("original + DynamicCache", model), ("converted + RFACache", converted)):
            if time.monotonic() > deadline:
                rows.append([batch, name, "skipped: time budget", ""])
                continue
            res = attempt(_decode, m, plan, batch)
            rows.append([batch, name, res, ""] if isinstance(res, str) else [batch, name, res[0], res[1] / 2**20])
    return rows


# ---- main --------------------------------------------------------------------------------------
SECTIONS = ("layer", "prefill", "decode", "profile", "twins")


def run(plan: Plan, out: Path, budget: float, sections: tuple[str, ...] = SECTIONS) -> list[Path]:
    """The chosen sections (speed first, the twins last: the CUDA tests check the backends too),
    each table written as soon as it is measured; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget
    written = []

    def write(name: str, text: str) -> None:
        (out / name).write_text(text)
        written.append(out / name)
        logger.info("wrote %s", out / name)

    share = lambda frac: time.monotonic() + frac * max(0.0, deadline - time.monotonic())  # noqa: E731  (a section's deadline)
    dev, cfg = plan.device, recipe(plan)
    what = f"{cfg.feature_map} m={cfg.num_features}, window {cfg.window}, {cfg.sinks} sinks"
    if "layer" in sections:
        write("layer.md", table(f"One SmolLM2-shaped attention layer ({what}) vs SDPA (flash), ms", dev,
                                ["N", "SDPA prefill", "RFA prefill", "speed-up", "SDPA fwd+bwd", "RFA fwd+bwd", "speed-up"], layer_rows(plan, share(0.4))))
    if "prefill" in sections or "decode" in sections:
        models = attempt(load_models, plan)
        if isinstance(models, str):
            for name in ("prefill", "decode"):
                if name in sections:
                    write(f"{name}.md", table(name.capitalize(), dev, ["N", "result"], [["all", models]]))
        else:
            if "prefill" in sections:
                write("prefill.md", table(f"Whole-model prefill, ms: original (SDPA) vs converted ({what}); {models[2]}", dev,
                                          ["N", "original", "converted", "speed-up"], prefill_rows(plan, models, share(0.5))))
            if "decode" in sections:
                write("decode.md", table(f"Decoding {plan.new_tokens} tokens after a {plan.prompt}-token prompt; {models[2]}", dev,
                                         ["batch", "model + cache", "tokens/s", "cache MiB"], decode_rows(plan, models, share(0.6))))
            del models
    if "profile" in sections:
        n = plan.layer_n[0]
        res = attempt(profile_rows, plan, n)
        write("profile.md", table(f"One layer's forward + backward at N={n} ({what}, bf16 on CUDA): kernels by time", dev,
                                  ["kernel", "calls", "ms", "share"], [[res, "", "", ""]] if isinstance(res, str) else res))
    if "twins" in sections:
        write("twins.md", table(f"Twin errors vs the CPU fp32 reference ({what}, N={plan.twin_n})", dev,
                                ["backend", "ran as", "dtype", "forward rel. err", "max input-grad rel. err"], twin_rows(plan)))
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the Markdown tables")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (runs the script where no GPU is)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds after which the remaining rows are skipped")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)} (default: all, in this order)")
    a = p.parse_args(argv)
    sections = tuple(x.strip() for x in a.sections.split(",") if x.strip())
    bad = [x for x in sections if x not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections: unknown section {bad[0] if bad else a.sections!r}; allowed: {', '.join(SECTIONS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if not a.cpu_smoke and not torch.cuda.is_available():
        p.error("no CUDA device here: use --cpu-smoke for the tiny CPU run")
    files = run(plan_for(a.cpu_smoke), Path(a.out), a.budget, sections)
    print(f"device check: {len(files)} tables in {a.out}")


if __name__ == "__main__":
    main()
