"""Pure-PyTorch attention ops (nothing from transformers), one subpackage per mechanism; in each,
the readable reference (autograd) form sits next to its fast forms, and tests compare them.

Entry points and shared pieces (this folder):

- ``attention``: ``random_feature_attention``, the public entry point, and ``attend`` (the same on a spec)
- ``spec``: ``AttentionSpec``, a layer's settings (built once, validated once), and ``CallPlan`` (one call's choices)
- ``reference``: exact softmax, the quadratic kernelised form and the memory's brute-force twins (test oracles)
- ``masks`` (argument checks, key masks, guards), ``partial`` (log-space partial results merged under one
  normaliser), ``recurrent`` (the one-step form with an explicit state), ``rotary`` (the rotary embedding
  undone, and its adjoint), ``autograd`` (helpers of the recomputing Functions)

Mechanisms:

- ``feature/``: the feature part — ``linear`` (autograd forms on whole-sequence features: the reference),
  ``chunkwise`` (one block of the chunkwise-parallel causal form), ``scan`` (the causal scan over blocks),
  ``fused`` (the feature map applied block by block: the production form), ``recompute`` (the scan's
  recomputing training Function), ``bidirectional`` (keys folded block by block, inference)
- ``band/``: the exact window + sinks — ``plan`` (layout), ``exact`` (the autograd form and the inference
  form), ``recompute`` (the recomputing training Function with a hand-written backward)
- ``hybrid/``: the causal hybrid in training as one recomputing Function (``function``, ``blocks``)
- ``memory/``: the bounded exact global memory (``memory=M``) — ``state``, ``scores``, ``terms``,
  ``sequential`` (the reference form, and decoding steps), ``periods`` (the period-parallel prefill form),
  ``attention`` (prefill and cached continuation)
- ``decode/``: constant-memory decoding — ``state`` (``DecodeState``, the exact part over the kept window),
  ``continuation`` (``continue_attention``)
- ``backends/``: the registry that chooses among implementations (``torch``, ``inference``, ``compiled``,
  ``native``): ``causal_infer`` (the PyTorch inference form), ``kernels`` (optional ``torch.compile``),
  ``native`` (the optional C++ CPU kernel; ``causal_infer`` is its twin)
"""

from .attention import attend, random_feature_attention
from .backends.causal_infer import release_workspaces
from .backends.native import set_native
from .feature.linear import bidirectional_linear, causal_linear, shift_keys
from .partial import Partial, finalize, merge
from .recurrent import LinearState, fold, read
from .reference import quadratic_kernel_attention, softmax_attention
from .spec import AttentionSpec

__all__ = [
    "AttentionSpec",
    "LinearState",
    "Partial",
    "attend",
    "bidirectional_linear",
    "causal_linear",
    "finalize",
    "fold",
    "merge",
    "quadratic_kernel_attention",
    "random_feature_attention",
    "read",
    "release_workspaces",
    "set_native",
    "shift_keys",
    "softmax_attention",
]
