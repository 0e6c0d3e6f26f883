"""A bounded exact global memory for causal attention (``RFAConfig.memory``)."""

from .attention import MAX_MEMORY, MEMORY_SCORES, MemoryCall, MemoryState, check_memory_args, continue_memory_attention, derive_feature_keys, feature_error, memory_attention, value_norm

__all__ = ["MAX_MEMORY", "MEMORY_SCORES", "MemoryCall", "MemoryState", "check_memory_args", "continue_memory_attention", "derive_feature_keys", "feature_error", "memory_attention", "value_norm"]
