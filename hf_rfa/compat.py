"""Every private transformers / torch internal that hf_rfa relies on, in one place.

Each hook is one small function here and one row of :data:`HOOKS` (what it touches, why it is
still needed, the versions it was checked on); ``tests/test_compat.py`` probes each against the
installed versions, so an upgrade that breaks one fails a test that names it. Nothing here is
imported at module level: the ops stay free of transformers.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

#: the transformers / torch versions these hooks were checked against (pyproject pins the range)
TRANSFORMERS_RANGE = ">=5.0,<5.30"
TORCH_RANGE = ">=2.4"


@dataclass(frozen=True)
class Hook:
    """One private internal: ``name`` (what is touched), ``library``, ``used_by`` and ``why``."""

    name: str
    library: str
    used_by: str
    why: str


HOOKS: tuple[Hook, ...] = (
    Hook("GenerationMixin._prepare_cache_for_generation", "transformers", "hf.cache.install_generate_hook",
         "the only place where generate() builds its default cache; wrapped so converted models get an RFACache"),
    Hook("DynamicCache._is_user_defined / DynamicCache.offloading", "transformers", "hf.cache.install_generate_hook",
         "tell the default cache generate() built apart from a user-passed or offloaded one (never replaced)"),
    Hook("PretrainedConfig._attn_implementation", "transformers", "hf.cache.uses_rfa, recipes.conversion.calibration, hub.export",
         "the attention implementation a model runs (read), and the one a remote class must run before __init__ (set)"),
    Hook("PreTrainedModel._can_set_attn_implementation", "transformers", "hf.convert.convert",
         "refuses models whose attention is hard-coded (not on the attention interface) before converting"),
    Hook("inspect.getsource(Attention.forward) contains 'ALL_ATTENTION_FUNCTIONS'", "transformers", "hf.convert.find_attention_modules",
         "transformers has no public flag saying an attention module dispatches through the attention interface"),
    Hook("_BaseAutoModelClass._model_mapping._model_mapping", "transformers", "hub.export.auto_classes_of",
         "the model-type -> class-name table of each Auto class: which auto_map entries an export may declare"),
    Hook("PreTrainedModel.accepts_loss_kwargs", "transformers", "recipes.training.trainer.run_trainer",
         "Trainer scales a classifier's batch-mean loss as a token sum (doubled on 2 processes) unless this is False"),
    Hook("PreTrainedModel.post_init / _keys_to_ignore_on_load_unexpected", "transformers", "hf.loading.install_load_hook",
         "the per-instance regexes of checkpoint keys not to report as unexpected: a converted folder's rfa.* tensors "
         "are loaded by the load hook right after from_pretrained, so they must not be reported as dropped"),
    Hook("PreTrainedConfig.get_config_dict", "transformers", "hf.loading.install_load_hook",
         "the one reader of config.json behind AutoConfig and every config class: a converted folder's marked "
         "model type (hf_rfa_<type>, so it never loads as softmax without hf_rfa) is read back as the base type"),
    Hook("torch.utils.cpp_extension._get_build_directory", "torch", "ops.backends.native",
         "where torch's builder keeps its lock file: a killed build leaves it and every later load would hang"),
)


# --------------------------------------------------------------------------- transformers
def attn_implementation_of(config: Any) -> str | None:
    """The attention implementation ``config`` selects (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def preset_attn_implementation(config: Any, name: str) -> None:
    """Select attention implementation ``name`` on a config before the model is built from it."""
    config._attn_implementation = name


def wrap_post_init(after: Callable[[Any], None]) -> bool:
    """Run ``after(model)`` at the end of every ``PreTrainedModel.post_init`` (idempotent; False if already wrapped)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init
    if getattr(original, "_hf_rfa_hook", False):
        return False

    @functools.wraps(original)
    def post_init(self):
        original(self)
        after(self)

    post_init._hf_rfa_hook = True
    PreTrainedModel.post_init = post_init
    return True


def wrap_get_config_dict(edit: Callable[[type, dict], dict]) -> bool:
    """Pass the config dict ``PreTrainedConfig.get_config_dict`` returns through ``edit(cls, d)``
    (idempotent; False if already wrapped)."""
    from transformers import PretrainedConfig

    original = PretrainedConfig.__dict__["get_config_dict"].__func__
    if getattr(original, "_hf_rfa_hook", False):
        return False

    @functools.wraps(original)
    def get_config_dict(cls, *args, **kwargs):
        config_dict, rest = original(cls, *args, **kwargs)
        return edit(cls, config_dict), rest

    get_config_dict._hf_rfa_hook = True
    PretrainedConfig.get_config_dict = classmethod(get_config_dict)
    return True


def ignore_unexpected_keys(model: Any, pattern: str) -> None:
    """Do not report checkpoint keys matching the regex ``pattern`` as unexpected when ``model`` loads."""
    keys = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    model._keys_to_ignore_on_load_unexpected = set(keys or ()) | {pattern}


def can_set_attn_implementation(model_class: type) -> bool | None:
    """``model_class._can_set_attn_implementation()``; None where transformers has no such check."""
    check = getattr(model_class, "_can_set_attn_implementation", None)
    return None if check is None else bool(check())


_INTERFACE_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface")


@functools.lru_cache(maxsize=None)
def forward_uses_attention_interface(module_class: type) -> bool:
    """Whether ``module_class.forward`` dispatches through transformers' attention interface
    (its source names ``ALL_ATTENTION_FUNCTIONS``)."""
    try:
        src = inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        src = ""
    return any(m in src for m in _INTERFACE_MARKERS)


def auto_class_model_names(auto_class: type) -> Iterable[str]:
    """Class names in ``auto_class``'s model mapping (a tuple entry gives each of its names)."""
    names = getattr(getattr(auto_class, "_model_mapping", None), "_model_mapping", None) or {}
    for value in names.values():
        yield from (value if isinstance(value, (list, tuple)) else (value,))


def disable_loss_kwargs(model: Any) -> None:
    """Tell ``Trainer`` that ``model``'s loss is a batch mean, not a sum over ``num_items_in_batch``."""
    model.accepts_loss_kwargs = False


def is_default_dynamic_cache(cache: Any) -> bool:
    """Whether ``cache`` is the plain ``DynamicCache`` generate() built itself (not user-passed,
    not offloaded)."""
    from transformers.cache_utils import DynamicCache

    return type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False) and not getattr(cache, "offloading", False)


def wrap_prepare_cache_for_generation(after: Callable[..., None]) -> bool:
    """Wrap ``GenerationMixin._prepare_cache_for_generation`` so that ``after(self,
    generation_config, model_kwargs, generation_mode)`` runs after the stock method (idempotent).
    Returns whether it installed the wrapper now."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._prepare_cache_for_generation
    if getattr(original, "_hf_rfa_hook", False):
        return False

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        after(self, generation_config, model_kwargs, args[0] if args else kwargs.get("generation_mode"))
        return result

    _prepare_cache_for_generation._hf_rfa_hook = True
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    return True


# --------------------------------------------------------------------------- torch
def extension_build_dir(name: str) -> Path:
    """The folder where ``torch.utils.cpp_extension.load(name=...)`` builds (and keeps its lock)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


__all__ = [
    "HOOKS", "Hook", "attn_implementation_of", "auto_class_model_names", "can_set_attn_implementation",
    "disable_loss_kwargs", "extension_build_dir", "forward_uses_attention_interface", "is_default_dynamic_cache",
    "preset_attn_implementation", "wrap_get_config_dict", "wrap_prepare_cache_for_generation",
]
