"""Pure-PyTorch attention ops (nothing from transformers).

- ``reference``: exact softmax and the quadratic kernelised form (test oracles)
- ``linear``: bidirectional and causal linear attention on whole-sequence features (autograd forms)
- ``chunkwise``: one block of the chunkwise-parallel causal form (and its block features)
- ``scan``: the causal scan over blocks (block plan, state matrix, inference workspace path)
- ``fused``: causal attention with the feature map applied block by block (the production form)
- ``recompute``: training forms that recompute blocks in backward (O(N·D) activation memory)
- ``decode``: incremental attention of new tokens from a summarised past (generation)
- ``causal_infer``: the inference form of the causal block step (reused workspace, no autograd)
- ``bidirectional``: bidirectional attention with keys folded block by block (inference form)
- ``native``: optional compiled CPU kernel (C++, MKL) for causal inference with positive
  features — the default on CPUs where it builds; ``causal_infer`` is its twin
- ``kernels``: optional ``torch.compile`` of inner functions (off by default)
- ``recurrent``: the one-step form with an explicit state (decoding, prefix folding)
- ``hybrid``: exact softmax over a local window and attention sinks
- ``memory``: a bounded exact global memory (``memory=M``): prefill and cached continuation
- ``partial``: log-space partial results merged under one normaliser
- ``rotary``: the rotary embedding undone (and its adjoint), for feature parts reading un-rotated q/k
- ``attention``: ``random_feature_attention``, the public entry point
"""

from .attention import random_feature_attention
from .backends.causal_infer import release_workspaces
from .backends.native import set_native
from .feature.linear import bidirectional_linear, causal_linear, shift_keys
from .partial import Partial, finalize, merge
from .recurrent import LinearState, fold, read
from .reference import quadratic_kernel_attention, softmax_attention

__all__ = [
    "LinearState",
    "Partial",
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
