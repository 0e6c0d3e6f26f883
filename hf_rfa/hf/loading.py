"""Load hooks: with ``hf_rfa`` imported, stock loaders never run softmax in silence.

Installed on import of ``hf_rfa`` (idempotent):

* ``PreTrainedModel.from_pretrained`` (so every ``AutoModelFor*`` and model class): a folder
  saved from a converted model (``rfa_config`` in its ``config.json``) loads *converted* — the
  RFA modules are attached and their saved projections / learned maps loaded, as
  :func:`hf_rfa.from_pretrained` does; its ``rfa.*`` keys are no longer reported as unexpected.
  ``attn_implementation="rfa"`` on a checkpoint that was never converted raises a ``ValueError``
  naming :func:`hf_rfa.convert` (there is no default conversion to fall back to silently).
* ``PreTrainedModel.save_pretrained`` (Trainer checkpoints too): a converted model's folder gets a
  marked model type, an ``auto_map`` and its remote code (:mod:`hf_rfa.hub.remote`), so it never
  loads as softmax where hf_rfa is not imported; ``PreTrainedConfig.get_config_dict`` reads the
  marked type back as the base type.
* ``peft.PeftModel.save_pretrained``: an adapter on a converted model gets ``rfa_config.json`` and
  ``rfa_state.safetensors`` (the base's RFA tensors) next to it.
* ``peft.PeftModel.from_pretrained`` (so ``AutoPeftModelFor*``) and ``AutoModelFor*.from_pretrained``
  of an adapter folder: a base that is not converted is converted from ``rfa_config.json`` and
  given the saved RFA tensors (logged); a base converted with other settings, or an adapter that
  trains the ``rfa`` modules without that file, raises ``ValueError``.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
from typing import Any

from torch import nn

from .. import compat
from ..config import CONFIG_ATTR, RFAConfig
from .checkpoint import RFA_KEY_PATTERN
from .convert import _BYPASS_LOAD_HOOK, bypass_load_hook  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

#: file written next to a LoRA adapter on a converted model: the ``rfa_config``
ADAPTER_RFA_CONFIG = "rfa_config.json"
#: file written next to a LoRA adapter on a converted model: the base model's RFA tensors
ADAPTER_RFA_STATE = "rfa_state.safetensors"
#: RFAConfig fields that decide the RFA tensors and the attention an adapter was trained with
STRUCTURAL_FIELDS = ("feature_map", "num_features", "window", "sinks", "gate", "seed", "layers", "feature_map_options", "decay", "feature_input")



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
    adapter = str((kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path") or name_or_path)  # AutoModel* of an adapter
    if os.path.isdir(adapter) and os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        _convert_adapter_base(model, adapter, kwargs)  # transformers loaded base + adapter itself
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
    compat.wrap_get_config_dict(_unmark_config_dict)
    _install_save_hook()


def _unmark_config_dict(cls: type, config_dict: dict) -> dict:
    from ..hub.remote import unmark_config_dict

    return unmark_config_dict(cls, config_dict)


def _install_save_hook() -> None:
    """Wrap ``PreTrainedModel.save_pretrained``: a converted model's folder gets its marked config
    and remote code (:func:`hf_rfa.hub.remote.mark_folder`)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained
    if getattr(original, "_hf_rfa_hook", False):
        return

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if _saved_rfa_config(self) is None:
            return original(self, save_directory, *args, **kwargs)
        push = kwargs.pop("push_to_hub", False)
        hub = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "private", "create_pr") if k in kwargs}
        result = original(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", args[0] if args else True):
            from ..hub.remote import mark_folder

            mark_folder(self, save_directory)
            if push:
                _upload(save_directory, hub, kwargs.get("token"))
        return result

    save_pretrained._hf_rfa_hook = True
    PreTrainedModel.save_pretrained = save_pretrained


def _upload(folder: Any, hub: dict, token: Any) -> None:
    """``save_pretrained(push_to_hub=True)`` of a converted model: upload the marked folder."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo = api.create_repo(hub.get("repo_id") or os.path.basename(os.path.normpath(str(folder))), exist_ok=True, private=hub.get("private")).repo_id
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=hub.get("commit_message") or "Upload converted model (hf_rfa)", create_pr=hub.get("create_pr", False))


def _ignore_saved_rfa_keys(model: nn.Module) -> None:
    if _saved_rfa_config(model) is not None:
        compat.ignore_unexpected_keys(model, RFA_KEY_PATTERN)


# --------------------------------------------------------------------------- PEFT
def write_adapter_rfa_config(model: nn.Module, adapter_dir: str) -> None:
    """Save the model's ``rfa_config`` and RFA tensors next to a LoRA adapter (read back by the PEFT hook)."""
    d = _saved_rfa_config(model)
    if d is None:
        return
    from safetensors.torch import save_file

    with open(os.path.join(adapter_dir, ADAPTER_RFA_CONFIG), "w") as f:
        json.dump(d, f, indent=2, sort_keys=True)
    save_file(rfa_state_of(model), os.path.join(adapter_dir, ADAPTER_RFA_STATE), metadata={"format": "pt"})


def rfa_state_of(model: nn.Module) -> dict:
    """The RFA tensors of ``model`` keyed as in the plain converted model (PEFT wrappers' originals)."""
    state = {}
    for name, module in model.named_modules():
        rfa = getattr(module, "rfa", None)
        if isinstance(rfa, nn.Module) and not name.endswith((".original_module", ".modules_to_save")):
            rfa = getattr(rfa, "original_module", rfa)
            for k, v in rfa.state_dict().items():
                state[f"{name}.rfa.{k}" if name else f"rfa.{k}"] = v.detach().to("cpu").clone().contiguous()
    return state


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


def _structure(cfg: RFAConfig) -> dict:
    return {k: getattr(cfg, k) for k in STRUCTURAL_FIELDS}


def _load_adapter_rfa(model: nn.Module, model_id: str, kwargs: dict) -> bool:
    """Convert ``model`` from the adapter's ``rfa_config.json`` (and load its RFA tensors) or check that
    it is converted the same way; False when the adapter has no such file."""
    from .convert import convert, rfa_config_of

    path = _adapter_file(str(model_id), ADAPTER_RFA_CONFIG, kwargs)
    if path is None:
        return False
    with open(path) as f:
        cfg = RFAConfig.from_dict(json.load(f))
    if is_converted(model):
        have = rfa_config_of(model)
        diff = {k: (v, _structure(cfg)[k]) for k, v in _structure(have).items() if v != _structure(cfg)[k]} if have else {"rfa_config": (None, "set")}
        if diff:
            raise ValueError(f"adapter {model_id} was trained on a model converted with other settings than its base (base, adapter): {diff}; load the base it was trained on")
        return True
    convert(model, cfg)
    state = _adapter_file(str(model_id), ADAPTER_RFA_STATE, kwargs)
    if state is not None:
        _load_rfa_file(model, state)
    logger.warning("%s: base model converted to random feature attention from %s (%s, m=%d)", model_id, ADAPTER_RFA_CONFIG, cfg.feature_map, cfg.num_features)
    return True


def _load_rfa_file(model: nn.Module, path: str) -> None:
    """Load ``rfa_state.safetensors`` into a just-converted model: every tensor, no other, finite."""
    from safetensors.torch import load_file

    saved = load_file(path)
    want = rfa_state_of(model)
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    bad = [k for k in saved if k in want and (saved[k].shape != want[k].shape or (saved[k].is_floating_point() and not saved[k].isfinite().all()))]
    if missing or extra or bad:
        raise ValueError(f"{path} does not match the model its rfa_config builds: missing {missing[:3]}, extra {extra[:3]}, wrong shape or non-finite {bad[:3]}")
    for name, module in model.named_modules():
        rfa = getattr(module, "rfa", None)
        if isinstance(rfa, nn.Module):
            prefix = f"{name}.rfa." if name else "rfa."
            rfa.load_state_dict({k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix)}, strict=True)


def prepare_peft_base(model: nn.Module, model_id: str, config: Any = None, **kwargs) -> None:
    """Convert ``model`` (the base of an adapter) as the adapter's ``rfa_config.json`` says; ValueError
    when the adapter trains ``rfa`` modules without it, or when the base is converted otherwise."""
    if config is None:
        from peft import PeftConfig

        config = PeftConfig.from_pretrained(model_id, subfolder=kwargs.get("subfolder"), revision=kwargs.get("revision"))
    if _load_adapter_rfa(model, model_id, kwargs):
        return
    wanted = getattr(config, "modules_to_save", None) or []
    if "rfa" in wanted and not is_converted(model):
        raise ValueError(
            f"adapter {model_id} trains the 'rfa' modules (modules_to_save) but its base model is not converted "
            f"and the adapter has no {ADAPTER_RFA_CONFIG}: load the base with hf_rfa.from_pretrained(<converted folder>) "
            "or convert it with hf_rfa.convert(model, RFAConfig(...)) before PeftModel.from_pretrained"
        )


def _convert_adapter_base(model: nn.Module, adapter: str, kwargs: dict) -> None:
    """``AutoModelFor*.from_pretrained(<adapter folder>)``: transformers loaded the base and the adapter."""
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        wanted = json.load(f).get("modules_to_save") or []
    if os.path.isfile(os.path.join(adapter, ADAPTER_RFA_CONFIG)) and "rfa" in wanted and not is_converted(model):
        raise ValueError(f"adapter {adapter} trains the 'rfa' modules: load it with peft's AutoPeftModelFor*.from_pretrained (with hf_rfa imported), not AutoModelFor*")
    _load_adapter_rfa(model, adapter, {k: kwargs.get(k) for k in ("subfolder", "revision", "token")})


def install_peft_hook() -> None:
    """Wrap ``peft.PeftModel.from_pretrained`` and ``save_pretrained`` (idempotent; no-op without peft)."""
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

    save = PeftModel.save_pretrained

    @functools.wraps(save)
    def save_pretrained(self, save_directory, *args, **kwargs):
        result = save(self, save_directory, *args, **kwargs)
        bound = inspect.signature(save).bind(self, save_directory, *args, **kwargs)
        if bound.arguments.get("is_main_process", True):
            _write_adapter_files(self, str(save_directory), bound.arguments.get("selected_adapters"))
        return result

    PeftModel.save_pretrained = save_pretrained


def _write_adapter_files(peft_model: Any, save_directory: str, selected: Any) -> None:
    base = peft_model.get_base_model()
    if _saved_rfa_config(base) is None:
        return
    for name in selected or list(peft_model.peft_config):
        out = save_directory if name == "default" else os.path.join(save_directory, name)
        if os.path.isdir(out):
            write_adapter_rfa_config(base, out)
        origin = getattr(peft_model.peft_config[name], "base_model_name_or_path", None) or ""
        if not _is_converted_folder(origin):
            logger.warning(
                "adapter %s: its base %r is not a converted checkpoint, so the adapter loads converted only where hf_rfa is "
                "imported; save the converted base too (model.save_pretrained) and load from it to be safe everywhere", out, origin)


def _is_converted_folder(path: str) -> bool:
    """Whether ``path`` is a local folder saved from a converted model (``rfa_config`` in its config)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return False
    try:
        with open(cfg_file, encoding="utf-8") as f:
            return bool(json.load(f).get(CONFIG_ATTR))
    except (OSError, ValueError, AttributeError):
        return False
