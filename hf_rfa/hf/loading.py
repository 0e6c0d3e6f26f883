"""Load hooks: with ``hf_rfa`` imported, stock loaders never run softmax in silence.

Installed on import of ``hf_rfa`` (idempotent):

* ``PreTrainedModel.from_pretrained`` (so every ``AutoModelFor*`` and model class): a folder
  saved from a converted model (``rfa_config`` in its ``config.json``) loads *converted* — the
  RFA modules are attached and their saved projections / learned maps loaded, as
  :func:`hf_rfa.from_pretrained` does; its ``rfa.*`` keys are no longer reported as unexpected.
  ``attn_implementation="rfa"`` on a checkpoint that was never converted raises a ``ValueError``
  naming :func:`hf_rfa.convert` (there is no default conversion to fall back to silently).
* ``peft.PeftModel.from_pretrained`` (so ``AutoPeftModelFor*``): an adapter that saves the ``rfa``
  modules (``modules_to_save``) on a base that is not converted is converted first from the
  ``rfa_config.json`` saved next to the adapter (logged once); without that file, ``ValueError``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

from torch import nn

from .. import compat
from ..config import CONFIG_ATTR, RFAConfig
from .convert import _BYPASS_LOAD_HOOK, bypass_load_hook  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

#: file written next to a LoRA adapter that trains/saves the ``rfa`` modules
ADAPTER_RFA_CONFIG = "rfa_config.json"
#: ``_keys_to_ignore_on_load_unexpected`` pattern of the saved RFA tensors (they are loaded by the hook)
RFA_KEY_PATTERN = r"(^|\.)rfa\."



def is_converted(model: nn.Module) -> bool:
    """True when some attention module of ``model`` carries an RFA module (``module.rfa``)."""
    return any(isinstance(getattr(m, "rfa", None), nn.Module) for m in model.modules())


def _saved_rfa_config(model: nn.Module) -> dict | None:
    return getattr(getattr(model, "config", None), CONFIG_ATTR, None) or None


def _not_converted_error(what: str) -> ValueError:
    return ValueError(
        f"{what} was never converted to random feature attention (no '{CONFIG_ATTR}' in its config), so "
        "attn_implementation='rfa' would run plain softmax. Convert it first: "
        "model = hf_rfa.convert(AutoModel...from_pretrained(path), hf_rfa.RFAConfig(...)), "
        "then model.save_pretrained(...)"
    )


def _local_dir(name_or_path: Any, kwargs: dict) -> str:
    """The folder of a checkpoint (a Hub id is resolved through the local Hub cache)."""
    from .convert import _resolve_dir

    hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir") if kwargs.get(k) is not None}
    return _resolve_dir(str(name_or_path), **hub)


def attach_saved(model: nn.Module, path: str) -> nn.Module:
    """Attach the RFA modules described by ``model.config.rfa_config`` and load them from ``path``."""
    from .convert import convert, load_rfa_state

    convert(model, RFAConfig.from_dict(_saved_rfa_config(model)))
    load_rfa_state(model, path)
    return model


def _after_load(model: nn.Module, name_or_path: Any, kwargs: dict) -> nn.Module:
    if not isinstance(model, nn.Module) or _BYPASS_LOAD_HOOK.get():
        return model
    if _saved_rfa_config(model) is None:
        asked = kwargs.get("attn_implementation") or compat.attn_implementation_of(model.config)
        if asked == "rfa":  # (AutoModel* hands the flag over inside the config)
            raise _not_converted_error(str(name_or_path))
        return model
    if not is_converted(model):
        attach_saved(model, _local_dir(name_or_path, kwargs))
        logger.info("%s: converted checkpoint loaded with its RFA modules (%s)", name_or_path, type(model).__name__)
    return model


def install_load_hook() -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` (public) and ``post_init`` (through :mod:`hf_rfa.compat`); idempotent."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"].__func__
    if getattr(original, "_hf_rfa_hook", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        model = original(cls, pretrained_model_name_or_path, *args, **kwargs)
        out = model[0] if isinstance(model, tuple) else model  # output_loading_info=True
        _after_load(out, pretrained_model_name_or_path, kwargs)
        return model

    from_pretrained._hf_rfa_hook = True
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)

    compat.wrap_post_init(_ignore_saved_rfa_keys)


def _ignore_saved_rfa_keys(model: nn.Module) -> None:
    if _saved_rfa_config(model) is not None:
        compat.ignore_unexpected_keys(model, RFA_KEY_PATTERN)


# --------------------------------------------------------------------------- PEFT
def write_adapter_rfa_config(model: nn.Module, adapter_dir: str) -> None:
    """Save the model's ``rfa_config`` next to a LoRA adapter (read back by the PEFT hook)."""
    d = _saved_rfa_config(model)
    if d is not None:
        with open(os.path.join(adapter_dir, ADAPTER_RFA_CONFIG), "w") as f:
            json.dump(d, f, indent=2, sort_keys=True)


def _adapter_file(model_id: str, name: str, kwargs: dict) -> str | None:
    sub = kwargs.get("subfolder") or ""
    if os.path.isdir(model_id):
        path = os.path.join(model_id, sub, name)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(model_id, name, subfolder=sub or None, revision=kwargs.get("revision"), token=kwargs.get("token"))
    except Exception:  # not on the Hub / offline: treated as absent
        return None


def prepare_peft_base(model: nn.Module, model_id: str, config: Any = None, **kwargs) -> None:
    """Convert ``model`` (the base of an adapter) when the adapter saves ``rfa`` modules; else ValueError."""
    if config is None:
        from peft import PeftConfig

        config = PeftConfig.from_pretrained(model_id, subfolder=kwargs.get("subfolder"), revision=kwargs.get("revision"))
    wanted = getattr(config, "modules_to_save", None) or []
    if "rfa" not in wanted or is_converted(model):
        return
    path = _adapter_file(str(model_id), ADAPTER_RFA_CONFIG, kwargs)
    if path is None:
        raise ValueError(
            f"adapter {model_id} trains the 'rfa' modules (modules_to_save) but its base model is not converted "
            f"and the adapter has no {ADAPTER_RFA_CONFIG}: load the base with hf_rfa.from_pretrained(<converted folder>) "
            "or convert it with hf_rfa.convert(model, RFAConfig(...)) before PeftModel.from_pretrained"
        )
    from .convert import convert

    with open(path) as f:
        cfg = RFAConfig.from_dict(json.load(f))
    logger.warning("%s: base model converted to random feature attention from %s (%s, m=%d)", model_id, ADAPTER_RFA_CONFIG, cfg.feature_map, cfg.num_features)
    convert(model, cfg)


def install_peft_hook() -> None:
    """Wrap ``peft.PeftModel.from_pretrained`` (idempotent; no-op without peft)."""
    try:
        from peft import PeftModel
    except ImportError:
        return
    original = PeftModel.__dict__["from_pretrained"].__func__
    if getattr(original, "_hf_rfa_hook", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, model, model_id, *args, **kwargs):
        prepare_peft_base(model, model_id, config=kwargs.get("config"), subfolder=kwargs.get("subfolder"), revision=kwargs.get("revision"), token=kwargs.get("token"))
        return original(cls, model, model_id, *args, **kwargs)

    from_pretrained._hf_rfa_hook = True
    PeftModel.from_pretrained = classmethod(from_pretrained)
