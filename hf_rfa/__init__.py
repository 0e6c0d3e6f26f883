"""hf_rfa: random feature attention as a drop-in ``attn_implementation`` for Hugging Face models.

Public API::

    hf_rfa.available_feature_maps()
    fm = hf_rfa.build_feature_map("favor+", head_dim=64, num_features=256, seed=0)
    out = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=0, sinks=0)
    ref = hf_rfa.softmax_attention(q, k, v, causal=True)

    model = hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=256))
    model.save_pretrained("out"); model = hf_rfa.from_pretrained("out", AutoModelForCausalLM)
"""

from .config import RFAConfig
from .feature_maps import FeatureMap, Features, available_feature_maps, build_feature_map, register_feature_map
from .ops import LinearState, quadratic_kernel_attention, random_feature_attention, softmax_attention
from .ops.backends.kernels import compile_enabled, set_compile
from .ops.backends.native import native_enabled, set_native

__version__ = "0.1.0"


def _register_with_transformers() -> None:
    try:
        from .hf.attention import register
    except ImportError:  # transformers not installed: the ops still work
        return
    register()


_register_with_transformers()

from .hf.convert import convert, feature_maps, find_attention_modules, from_pretrained, redraw, rfa_config_of  # noqa: E402

try:  # with transformers: generate() of a converted model defaults to the constant-memory RFACache
    from .hf.cache import RFACache, RFACacheLayer, install_generate_hook  # noqa: E402
except ImportError:  # transformers not installed
    pass
else:
    install_generate_hook()
from .hub.export import export, push_to_hub  # noqa: E402

__all__ = [
    "compile_enabled",
    "set_compile",
    "native_enabled",
    "set_native",
    "FeatureMap",
    "Features",
    "LinearState",
    "RFACache",
    "RFACacheLayer",
    "RFAConfig",
    "available_feature_maps",
    "build_feature_map",
    "convert",
    "export",
    "feature_maps",
    "find_attention_modules",
    "from_pretrained",
    "push_to_hub",
    "quadratic_kernel_attention",
    "random_feature_attention",
    "redraw",
    "register_feature_map",
    "rfa_config_of",
    "softmax_attention",
]
