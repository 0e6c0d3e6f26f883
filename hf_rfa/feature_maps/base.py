"""The feature-map abstraction shared by every map in this package.

A feature map φ turns (scaled) queries and keys into features whose dot products estimate
(or, for learned maps, replace) the softmax kernel ``exp(q·k·scale)``:

    exp(x·y) ≈ φ_q(x)·φ_k(y),   x = q·√scale,  y = k·√scale.

Maps return :class:`Features`: a *bounded* feature tensor plus an optional per-token log scale,
``φ(x) = phi · exp(log_scale)``. Keeping the (possibly huge) magnitude in log space is what
lets the attention ops stabilise without breaking the common scale between exact softmax
scores and feature estimates (see ``hf_rfa.ops``).

Randomness is explicit: projections are buffers drawn from a ``torch.Generator`` seeded from
``(seed, step)`` by :func:`generator_for`, so every process that builds the same map with the
same seed, and redraws at the same step, holds identical projections.
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

import torch
from torch import nn


class Features(NamedTuple):
    """Features of a batch of vectors.

    phi:       ``[B, H, N, F]`` float32, bounded in magnitude (≤ ~1).
    log_scale: ``[B, H, N]`` float32 or ``None`` (= 0): the true feature is ``phi * exp(log_scale)``.
    """

    phi: torch.Tensor
    log_scale: torch.Tensor | None


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Compute dtype of the ops: float64 stays float64 (for gradcheck), all else → float32."""
    return x if x.dtype == torch.float64 else x.float()


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from any tuple of ints/strings (same on every process and platform)."""
    text = ":".join(str(p) for p in parts)
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def generator_for(seed: int, step: int) -> torch.Generator:
    """CPU generator seeded deterministically from ``(seed, step)``."""
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed("hf_rfa", seed, step))
    return g


class FeatureMap(nn.Module):
    """Base class of all feature maps.

    Subclasses set ``positive`` (all features ≥ 0, so normalisers cannot cross zero) and
    ``feature_dim`` and implement :meth:`forward_queries` / :meth:`forward_keys`. Random maps
    implement :meth:`_draw` and get :meth:`redraw` for free. Learned maps have trainable
    parameters; their random initialisation is also drawn from the seeded generator.

    Args:
        head_dim: D, the dimension of q and k.
        num_features: m, the number of random projections (feature dim may be m or 2m).
        seed: base seed of all randomness in this map.
        num_heads: query heads for maps with per-head parameters (None: shared over heads).
        num_kv_heads: key heads for such maps (defaults to ``num_heads``).
    """

    positive: bool = True
    #: floor of normalisers (relative to the ops' running stabilisation scale)
    eps: float = 1e-20
    #: True when a learned gate is available (RFA); the ops then call :meth:`log_gate`.
    has_gate: bool = False
    #: True for the ``none`` map: no feature part, keys outside the window and sinks are dropped.
    null: bool = False

    def __init__(
        self,
        head_dim: int,
        num_features: int,
        seed: int = 0,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("head_dim", head_dim), ("num_features", num_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.head_dim = head_dim
        self.num_features = num_features
        self.seed = int(seed)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        # The redraw step is saved with the checkpoint so that a reloaded map can tell which
        # projections it holds.
        self.register_buffer("step", torch.zeros((), dtype=torch.long), persistent=True)

    # ---- randomness -------------------------------------------------------------------------
    def redraw(self, step: int) -> None:
        """Draw new projections from the generator seeded by ``(seed, step)``.

        Deterministic: the same ``(seed, step)`` gives the same projections on every process.
        Maps without randomness only record the step.
        """
        self.step.fill_(int(step))
        with torch.no_grad():
            self._draw(generator_for(self.seed, int(step)))

    def _draw(self, generator: torch.Generator) -> None:  # pragma: no cover - overridden
        """Fill random buffers from ``generator`` (no-op for deterministic maps)."""

    # ---- features ---------------------------------------------------------------------------
    @property
    def feature_dim(self) -> int:
        """F, the size of the feature axis."""
        raise NotImplementedError

    def forward_queries(self, x: torch.Tensor) -> Features:
        """``x [B, H, N, D]`` (already multiplied by √scale) → :class:`Features` ``[B, H, N, F]``."""
        raise NotImplementedError

    def forward_keys(self, x: torch.Tensor) -> Features:
        """``x [B, Hkv, N, D]`` (already multiplied by √scale) → :class:`Features`."""
        raise NotImplementedError

    def features_into(self, x: torch.Tensor, out: torch.Tensor, is_query: bool, x_scale: float = 1.0) -> Features:
        """Features of ``x * x_scale`` for inference (no autograd), with ``phi`` written into the
        preallocated ``out [B, H, N, F]`` (saves allocations per block of the causal scan; maps
        may fold ``x_scale`` into their parameters instead of scaling ``x``). The default scales,
        computes the features as usual and copies; the result's ``phi`` is always ``out``.
        """
        x = upcast(x) * x_scale if x_scale != 1.0 else x
        f = self.forward_queries(x) if is_query else self.forward_keys(x)
        return Features(out.copy_(f.phi), f.log_scale)

    def native_params(self, x_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None, float, float] | None:
        """For maps of the positive-exponential form ``φ(x) = exp(x Wᵀ + bias − max)`` with log
        scale ``max + coef·‖x‖² + c0`` (inputs multiplied by ``x_scale``): ``(W [F,D], bias [F] or
        None, coef, c0)``, detached, for the compiled CPU kernel (:mod:`hf_rfa.ops.backends.native`). None
        (the default): the map has another form and always takes the PyTorch path."""
        return None

    def log_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For gated maps: ``(log g, log(1-g))`` each ``[B, Hkv, N]`` from keys ``x [B, Hkv, N, D]``:
        the causal feature state is S_t = g_t S_{t−1} + (1−g_t) φ(k_t) v_tᵀ. Maps with a decay
        (:meth:`enable_decay`) return ``(log γ, 0)``: S_t = γ S_{t−1} + φ(k_t) v_tᵀ."""
        rate = getattr(self, "decay_log_rate", None)
        if rate is None:
            raise NotImplementedError(f"{type(self).__name__} has no gate or decay")
        hkv = x.shape[1]
        if rate.shape[0] not in (1, hkv):
            raise ValueError(f"feature map has a decay for {rate.shape[0]} kv heads but the keys have {hkv} heads")
        logg = -rate.to(x.dtype).exp().view(1, -1, 1).expand(x.shape[:-1])
        return logg, torch.zeros_like(logg)

    def enable_decay(self, half_life: float) -> None:
        """Give the causal feature state an exponential decay S_t = γ S_{t−1} + φ(k_t) v_tᵀ (no
        (1−γ) factor, so the features' mass next to the window is unchanged), one learned γ per kv
        head, initialised to ``2^(−1/half_life)``; stored as ``decay_log_rate = log(−log γ)``
        ``[Hkv]`` (a trainable parameter: attention transfer fits it). Bidirectional attention
        ignores it (:func:`hf_rfa.convert` refuses bidirectional layers with a decay)."""
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life >= 1.0 or math.isinf(half_life):
            raise ValueError(f"decay half-life must be a finite number of tokens >= 1, got {half_life!r}")
        if self.null:
            raise ValueError("the 'none' map has no feature state to decay")
        if self.has_gate:
            raise ValueError(f"{type(self).__name__} already has a gate (a learned decay); a second decay is not supported")
        hk = self.num_kv_heads or 1
        self.decay_log_rate = nn.Parameter(torch.full((hk,), math.log(math.log(2.0) / float(half_life))))
        self.has_gate = True

    def decay_half_life(self) -> torch.Tensor | None:
        """Current half-life in tokens per kv head ``[Hkv]`` (None without a decay)."""
        rate = getattr(self, "decay_log_rate", None)
        return None if rate is None else (math.log(2.0) / rate.detach().exp())

    def forward(self, x: torch.Tensor, is_query: bool = True) -> Features:
        return self.forward_queries(x) if is_query else self.forward_keys(x)

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, "
            f"feature_dim={self.feature_dim}, seed={self.seed}"
        )


def per_head(param: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Broadcast a parameter stored per head ``[h, ...]`` (h ∈ {1, H}) to ``[1, H, 1, ...]``.

    Raises ValueError when the input has a head count the parameter cannot serve.
    """
    if param.shape[0] not in (1, num_heads):
        raise ValueError(
            f"feature map has parameters for {param.shape[0]} heads but the input has {num_heads} heads"
        )
    return param.unsqueeze(0).unsqueeze(2)
