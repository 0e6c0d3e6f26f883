"""hf_rfa: random feature attention as a drop-in ``attn_implementation`` for Hugging Face models.

Public API::

    hf_rfa.available_feature_maps()
    fm = hf_rfa.build_feature_map("favor+", head_dim=64, num_features=256, seed=0)
    out = hf_rfa.random_feature_attention(q, k, v, fm, causal=True, window=0, sinks=0)
    ref = hf_rfa.softmax_attention(q, k, v, causal=True)

    model = hf_rfa.convert(model, hf_rfa.RFAConfig(feature_map="favor+", num_features=256))
    model = hf_rfa.convert(model, hf_rfa.RFAConfig.from_preset("recall"))   # hf_rfa.available_presets()
    model = hf_rfa.linearize(model_or_id, "recall", train_texts=...)      # convert + transfer + LoRA + memory
    model.save_pretrained("out"); model = hf_rfa.from_pretrained("out", AutoModelForCausalLM)
    for fm in hf_rfa.model_feature_maps(model): ...   # hf_rfa.feature_maps is the subpackage
"""

from .config import RFAConfig
from .feature_maps import FeatureMap, Features, available_feature_maps, build_feature_map, register_feature_map
from .ops import LinearState, quadratic_kernel_attention, random_feature_attention, softmax_attention
from .ops.backends.kernels import compile_enabled, set_compile
from .ops.backends.native import native_enabled, set_native
from .presets import available_presets

__version__ = "0.2.0"


def _register_with_transformers() -> None:
    try:
        from .hf.attention import register
    except ImportError:  # transformers not installed: the ops still work
        return
    register()
    from ._logging import follow_transformers_verbosity
    from .hf.loading import install_load_hook, install_peft_hook

    follow_transformers_verbosity()

    install_load_hook()
    install_peft_hook()


_register_with_transformers()

from .hf.compile import compile_layers  # noqa: E402
from .hf.convert import convert, find_attention_modules, from_pretrained, redraw, rfa_config_of  # noqa: E402
from .hf.runtime import parse_runtime_settings, reconfigure, set_memory  # noqa: E402
# every feature map of a model; not named ``feature_maps``, which is the subpackage hf_rfa.feature_maps
from .hf.convert import feature_maps as model_feature_maps  # noqa: E402

try:  # with transformers: generate() of a converted model defaults to the constant-memory RFACache
    from .hf.cache import RFACache, RFACacheLayer, install_generate_hook  # noqa: E402
except ImportError:  # transformers not installed
    pass
else:
    install_generate_hook()
from .hub.export import export, push_to_hub  # noqa: E402


def linearize(
    model: "torch.nn.Module | str", preset: str = "recall", train_texts: "str | list[str] | None" = None,
    tokenizer: "object" = None, progress: bool = True, **settings: "object",
) -> "torch.nn.Module":
    """Convert and train ``model`` as ``hf-rfa-convert --preset`` does (convert → attention transfer →
    LoRA → exact memory), without its evaluation and export; see
    :func:`hf_rfa.recipes.conversion.linearize.linearize`."""
    from .recipes.conversion.linearize import linearize as _linearize

    return _linearize(model, preset, train_texts, tokenizer, progress, **settings)

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
    "available_presets",
    "build_feature_map",
    "compile_layers",
    "convert",
    "export",
    "find_attention_modules",
    "from_pretrained",
    "linearize",
    "model_feature_maps",
    "push_to_hub",
    "quadratic_kernel_attention",
    "random_feature_attention",
    "redraw",
    "register_feature_map",
    "rfa_config_of",
    "reconfigure",
    "set_memory",
    "softmax_attention",
]
