"""The causal feature scan through fla-core's chunked simple-GLA kernel (GPU, optional).

``pip install hf_rfa[gpu]`` installs ``fla-core`` (the flash-linear-attention kernels, Triton);
this module imports it only when a call runs here (:func:`importable` looks for it without
importing). Its ``chunk_simple_gla(q, k, v, g)`` computes, per head, ``o_t = Σ_{s ≤ t}
exp(Σ_{s < i ≤ t} g_i) (q_t·k_s) v_s`` in chunks — exactly the causal feature part with a decay
once the features are its q and k:

- q: the query features ``φ(q_t)`` (their log scale ``lq_t`` stays outside, in the Partial);
- k: the key features times ``exp(lk_s − m)``, ``lk_s`` the key's log scale (a gated map's
  ``log(1 − g_s)`` included) and ``m`` its maximum over the call per kv head (detached);
- v: the values with a ones column appended: the last output column is the denominator;
- g: the log decay per token (``RFAConfig(decay=H)``: log γ per kv head; ``gate=True``: log g_t),
  zero at padded positions, which never decay.

With a window W (a causal hybrid) the feature part of query t reads keys s ≤ t − W: keys and
values are delayed by W, and the decay the delayed key s has had over the W positions it skips in
the kernel's indexing (``Σ_{s < i ≤ s + W} g_i``) joins its log scale.

The kernel has one reference ``m`` per kv head, not the running maximum of the PyTorch forms, so
the output is re-expressed relative to each row's own maximum log weight ``r_t`` (``r_t = max_{s ≤
t} (lk_s + decay from s to t)``, the reference :func:`hf_rfa.ops.partial.finalize` floors against)
by the factor ``exp(m − r_t)``. When a row's ``m − r_t`` exceeds :data:`SPREAD` (its keys would
reach the kernel ~e⁻⁴⁰ smaller than the call's largest), :func:`scan_partial` returns None and the
caller runs the PyTorch scan instead (logged at DEBUG): a fallback by a stated rule, never an
underflowed answer.

On CUDA: ``tests/ops/test_cuda.py`` holds the twin tests. On a CPU the kernels run under Triton's
interpreter (``TRITON_INTERPRET=1`` before Triton is imported: NumPy, float32 products, slow), the
only CPU use :func:`available` admits; fla-core then also needs two adjustments to the interpreter
that ``tests/ops/test_fla_interpreter.py`` makes (an autotuner benchmark without a GPU driver, loop
counters as Triton scalars), so a named ``backend="fla"`` on a CPU tensor is for its twin tests.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..masks import NEG, shift_keys
from ..partial import Partial

#: largest gap (nats) between the call's key reference and a row's own maximum log weight
SPREAD = 40.0


def importable() -> bool:
    """Whether ``fla-core`` is installed (``pip install hf_rfa[gpu]``), without importing it."""
    return importlib.util.find_spec("fla") is not None


def gated_backward_refused(device: torch.device) -> bool:
    """Whether fla-core refuses the backward of a gated (decaying) scan on ``device``: it raises
    there on Hopper GPUs (compute capability 9.x) with Triton >= 3.4.0 and < 3.7.1, whose gated
    ``chunk_bwd_dqkwg`` gives wrong results, unless tilelang is installed (fla-core then runs its
    tilelang kernel instead). Seen on an H200 with Triton 3.6.0 and fla-core 0.6.0."""
    return device.type == "cuda" and _triton_gated_backward_bug() and torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def _triton_gated_backward_bug() -> bool:
    """The installed packages' part of :func:`gated_backward_refused` (looked up once: it is asked
    on every training call): Triton in [3.4.0, 3.7.1) and no tilelang."""
    if importlib.util.find_spec("tilelang") is not None:
        return False
    try:
        from importlib.metadata import version

        parts = tuple(int(x) for x in version("triton").split("+")[0].split(".")[:3])
    except Exception:  # noqa: BLE001 - no triton (or an unparsable version): fla cannot run anyway
        return False
    return (3, 4, 0) <= parts < (3, 7, 1)


def interpreted() -> bool:
    """Whether Triton's interpreter is on: ``TRITON_INTERPRET`` read as Triton reads it (1, true,
    on, yes, y; any case). It must be set before Triton is imported to take effect."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """A CUDA tensor (or a CPU tensor under Triton's interpreter, :func:`interpreted`), float32
    compute, fla-core installed (FlexAttention answers a band)."""
    from . import flex

    here = device.type == "cuda" or (device.type == "cpu" and interpreted())
    return here and dtype == torch.float32 and importable() and flex.importable()


def _kernel():
    # optional dependency, imported when used; inside try so that transformers' remote-code import
    # check (which skips try blocks) does not require fla-core to load an exported model
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        raise ImportError(f"the 'fla' backend needs fla-core (pip install hf_rfa[gpu]): {e}") from None
    return chunk_simple_gla


def scan_terms(feature_map, fq_in, fk_in, v, feat_mask, key_mask, window: int, root: float):
    """The kernel's inputs in the heads-first layout of the op, float32: ``(qf [B,H,N,F], lq
    [B,H,N], kf [B,Hkv,N,F], lk [B,Hkv,N], va [B,Hkv,N,Dv+1], logg [B,Hkv,N] or None)`` — keys,
    values and key log scales already delayed by ``window`` (the decay over it in ``lk``); keys
    that are not feature keys (``feat_mask [B, N]`` False: padding, sinks) have zero features and
    log scale NEG. ``fq_in``/``fk_in`` are what the map reads (multiplied by ``root`` here)."""
    ct = torch.float64 if fq_in.dtype == torch.float64 else torch.float32
    xk = fk_in.to(ct) * root
    fq, fk = feature_map.forward_queries(fq_in.to(ct) * root), feature_map.forward_keys(xk)
    qf, kf = fq.phi, fk.phi
    lq = fq.log_scale if fq.log_scale is not None else torch.zeros(qf.shape[:-1], dtype=ct, device=qf.device)
    lk = fk.log_scale if fk.log_scale is not None else torch.zeros(kf.shape[:-1], dtype=ct, device=kf.device)
    logg = None
    if feature_map.has_gate:
        logg, log1mg = feature_map.log_gate(xk)  # [B,Hkv,N]
        if key_mask is not None:
            logg = logg * key_mask[:, None, :]
        lk = lk + log1mg
    if feat_mask is not None:
        kf = kf * feat_mask[:, None, :, None]
        lk = torch.where(feat_mask[:, None, :], lk, torch.full_like(lk, NEG))
    vv = v.to(ct)
    va = torch.cat([vv, torch.ones_like(vv[..., :1])], dim=-1)
    if window > 0:
        kf, va, lk = shift_keys(kf, window, 0.0), shift_keys(va, window, 0.0), shift_keys(lk, window, NEG)
        if logg is not None:  # the decay over the W positions the delayed key skips
            cum = torch.cumsum(logg, dim=-1)
            lk = lk + (cum - shift_keys(cum, window, 0.0))
    return qf, lq, kf, lk, va, logg


def references(lk: torch.Tensor, logg: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m [B,Hkv,1], r [B,Hkv,N])``, detached: the call's key reference (the largest key log
    scale; 0 where none is real) and each row's maximum log weight over the keys it sees."""
    lk = lk.detach()
    m = lk.amax(-1, keepdim=True)
    m = torch.where(m > NEG / 2, m, torch.zeros_like(m))
    if logg is None:
        return m, torch.cummax(lk, dim=-1).values
    cum = torch.cumsum(logg.detach(), dim=-1)
    return m, torch.cummax(lk - cum, dim=-1).values + cum


def scan_partial(feature_map, fq_in, fk_in, v, feat_mask, key_mask, window: int, root: float) -> Partial | None:
    """The causal feature part by the fla kernel: a Partial ``[B, Hkv, G, N, ·]`` (float32), or
    None when a row's reference gap exceeds :data:`SPREAD` (the caller's PyTorch scan answers).

    ``fq_in [B, H, N, D]``, ``fk_in [B, Hkv, N, D]``: what the feature map reads (× ``root`` =
    √scale); ``v [B, Hkv, N, Dv]``; ``feat_mask [B, N]`` bool or None: the keys the feature part
    answers (real, not sinks); ``key_mask [B, N]`` bool or None: real tokens (padding never
    decays); ``window``: the feature part reads keys ``s ≤ t − window``. The kernel is
    :func:`_kernel`'s (fla-core's ``chunk_simple_gla``, imported there; the tests swap in
    :func:`reference_kernel`)."""
    b, h, n, _ = fq_in.shape
    hkv, dv = fk_in.shape[1], v.shape[-1]
    g = h // hkv
    qf, lq, kf, lk, va, logg = scan_terms(feature_map, fq_in, fk_in, v, feat_mask, key_mask, window, root)
    m, r = references(lk, logg)
    seen = r > NEG / 2  # rows with a feature key
    gap = torch.where(seen, m - r, torch.zeros_like(r))
    if n and float(gap.max()) > SPREAD:
        return None
    ks = kf * torch.exp(lk - m).unsqueeze(-1)  # ≤ 1 · φ; NEG keys: exactly 0
    heads = lambda x: x.repeat_interleave(g, dim=1) if g > 1 else x  # noqa: E731  (kv heads → query heads)
    to_bthk = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  [B,H,N,·] → [B,N,H,·]
    gg = to_bthk(heads(logg).unsqueeze(-1)).squeeze(-1) if logg is not None else None
    fn = _kernel()
    o, _ = fn(to_bthk(qf), to_bthk(heads(ks)), to_bthk(heads(va)), g=gg, scale=1.0)
    o = o.transpose(1, 2).reshape(b, hkv, g, n, dv + 1).to(qf.dtype)
    factor = torch.where(seen, torch.exp(gap), torch.zeros_like(gap))  # ≤ e^SPREAD
    o = o * factor[:, :, None, :, None]
    ls = lq.reshape(b, hkv, g, n) + torch.where(seen, r, torch.zeros_like(r))[:, :, None, :]
    ls = torch.where(seen[:, :, None, :], ls, torch.full_like(ls, NEG))
    return Partial(o[..., :dv], o[..., dv], ls)


def reference_kernel(q, k, v, g=None, scale=1.0, **_):
    """A plain-PyTorch twin of ``chunk_simple_gla`` in its ``[B, N, H, ·]`` layout (quadratic,
    for tests): ``o_t = Σ_{s ≤ t} exp(G_t − G_s) (scale · q_t·k_s) v_s``, ``G`` the cumulative
    sum of ``g [B, N, H]``. Returns ``(o, None)``."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B,H,N,·]
    n = qh.shape[2]
    w = scale * qh @ kh.transpose(-1, -2)  # [B,H,N,N]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if g is not None:
        cum = torch.cumsum(g.transpose(1, 2), dim=-1)  # [B,H,N]
        w = w * torch.exp((cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, 0.0))
    w = w.masked_fill(~causal, 0.0)
    return (w @ vh).transpose(1, 2), None


__all__ = ["SPREAD", "available", "gated_backward_refused", "importable", "interpreted", "reference_kernel", "references", "scan_partial", "scan_terms"]
