"""Every folder saved from a converted model carries its remote code and a marked model type.

:func:`mark_folder` runs after ``save_pretrained`` of a converted model (the save hook of
:mod:`hf_rfa.hf.loading`, Trainer checkpoints included) and in :func:`hf_rfa.export`. It rewrites
``config.json``:

* ``model_type`` becomes ``hf_rfa_<base type>`` (e.g. ``hf_rfa_llama``): a process that does not
  import hf_rfa cannot load the folder as the plain base model — ``AutoConfig`` / ``AutoModel*``
  refuse it (transformers does not know the type, and the folder's code runs only with
  ``trust_remote_code=True``). With hf_rfa imported, the config loader reads the base type back
  (:func:`unmark_config_dict`), so the stock loaders and :func:`hf_rfa.from_pretrained` load it converted.
* ``auto_map`` names the remote config class and the remote model class for every Auto class that
  maps to the model's class, written next to the weights (``modeling_hf_rfa.py`` + the bundled
  hf_rfa modules): ``AutoModel*.from_pretrained(folder, trust_remote_code=True)`` loads it right
  in a process without hf_rfa.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from .. import compat
from ..config import CONFIG_ATTR, RFAConfig
from .bundle import bundle_sources, flat_name

#: the file holding the remote config and model classes
MODELING_FILE = "modeling_hf_rfa.py"
#: prefix of the model type written to the config.json of a converted model
MODEL_TYPE_PREFIX = "hf_rfa_"

# Auto classes tried, in order of preference, for the auto_map, with the Hub pipeline tag of each.
AUTO_CLASSES: tuple[tuple[str, str | None], ...] = (
    ("AutoModelForCausalLM", "text-generation"),
    ("AutoModelForSeq2SeqLM", "text2text-generation"),
    ("AutoModelForMaskedLM", "fill-mask"),
    ("AutoModelForSequenceClassification", "text-classification"),
    ("AutoModelForTokenClassification", "token-classification"),
    ("AutoModelForQuestionAnswering", "question-answering"),
    ("AutoModelForMultipleChoice", "multiple-choice"),
    ("AutoModelForNextSentencePrediction", None),
    ("AutoModelForPreTraining", None),
    ("AutoModel", "feature-extraction"),
)


def marked_model_type(model_type: str) -> str:
    """``llama`` → ``hf_rfa_llama`` (unchanged when already marked)."""
    return model_type if model_type.startswith(MODEL_TYPE_PREFIX) else MODEL_TYPE_PREFIX + model_type


def unmark_config_dict(config_class: type, config_dict: dict) -> dict:
    """The config dict of a converted folder with its base ``model_type`` back (for the stock
    config classes; a remote config class that declares the marked type keeps it)."""
    model_type = config_dict.get("model_type")
    if not (isinstance(model_type, str) and model_type.startswith(MODEL_TYPE_PREFIX)):
        return config_dict
    if getattr(config_class, "model_type", None) == model_type:
        return config_dict
    return {**config_dict, "model_type": model_type[len(MODEL_TYPE_PREFIX):]}


def transformers_base(cls: type) -> type:
    """The first class of ``cls``'s MRO that is transformers' own (a remote ``RFA<Base>`` gives ``Base``)."""
    import transformers

    for c in cls.__mro__:
        if c.__module__.startswith("transformers.") and getattr(transformers, c.__name__, None) is c:
            return c
    for c in cls.__mro__:
        if c.__module__.startswith("transformers."):
            return c
    raise ValueError(
        f"model class {cls.__module__}.{cls.__name__} is not part of transformers; "
        "a converted folder's remote code supports transformers' built-in architectures"
    )


def auto_classes_of(model_class: type) -> list[str]:
    """Names of the Auto classes whose mapping contains ``model_class`` (preferred first)."""
    import transformers

    base = transformers_base(model_class)
    return [a for a, _tag in AUTO_CLASSES if base.__name__ in compat.auto_class_model_names(getattr(transformers, a, None))]


def remote_class_name(model_class: type) -> str:
    return "RFA" + transformers_base(model_class).__name__


def _import_line(cls: type) -> str:
    import transformers

    if getattr(transformers, cls.__name__, None) is cls:
        return f"from transformers import {cls.__name__}"
    return f"from {cls.__module__} import {cls.__name__}"


def modeling_source(model_class: type, rfa_config: RFAConfig, config_class: type, model_type: str) -> str:
    """Source of ``modeling_hf_rfa.py``: ``RFA<Config>`` (model type ``model_type``) and
    ``RFA<Base>(Base)`` attaching RFA in ``__init__``."""
    from .. import __version__

    base_cls, cfg_cls = transformers_base(model_class), transformers_base(config_class)
    base, cfg_base = base_cls.__name__, cfg_cls.__name__
    # the config class keeps its base's name: transformers finds inner models (AutoModel.from_config in
    # e.g. ...ForSequenceClassification) by the config class's name
    name, cfg_name = remote_class_name(model_class), cfg_base
    conv, att, cfg, cpt = (flat_name(m) for m in ("hf_rfa.hf.convert", "hf_rfa.hf.attention", "hf_rfa.config", "hf_rfa.compat"))
    return f'''# Generated by hf_rfa {__version__} (a converted model's save_pretrained / hf_rfa.export). Do not edit.
"""{name}: {base} with random feature attention ({rfa_config.feature_map}), loadable without hf_rfa.

    AutoModel*.from_pretrained(path, trust_remote_code=True)

``__init__`` builds the base model, then attaches one ``RFAAttention`` per converted layer from
``config.rfa_config`` (the same seeds as ``hf_rfa.convert``) and selects the ``"rfa"`` attention and
mask functions; the projections and learned feature-map parameters then load from the checkpoint,
which must hold every one of them, finite, and no other.
"""

{_import_line(base_cls)}
{_import_line(cfg_cls)} as _BaseConfig

from .{att} import ATTN_NAME, register
from .{cpt} import preset_attn_implementation
from .{cfg} import CONFIG_ATTR, RFAConfig
from .{conv} import check_loaded_rfa, convert, report_unexpected_rfa_keys
from .{flat_name("hf_rfa.hf.cache")} import install_generate_hook

install_generate_hook()  # generate() defaults to the constant-memory RFACache, as with hf_rfa installed


class {cfg_name}(_BaseConfig):
    """{cfg_base} of a converted checkpoint (model type {model_type!r}; settings in ``rfa_config``)."""

    model_type = {model_type!r}


class {name}({base}):
    """{base} whose self-attention is random feature attention (settings in ``config.rfa_config``)."""

    config_class = {cfg_name}

    def __init__(self, config, *args, **kwargs):
        register()
        rfa = getattr(config, CONFIG_ATTR, None)
        if not rfa:
            raise ValueError(f"config has no '{{CONFIG_ATTR}}': not an hf_rfa checkpoint")
        preset_attn_implementation(config, ATTN_NAME)
        super().__init__(config, *args, **kwargs)
        convert(self, RFAConfig.from_dict(rfa))
        report_unexpected_rfa_keys(self)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``{base}.from_pretrained``; raises if an RFA tensor is missing, extra or not finite."""
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except RuntimeError as e:
            if "ignore_mismatched_sizes" not in str(e):
                raise
            raise ValueError("checkpoint tensors have other shapes than the model its config (rfa_config included) builds: "
                             + " ".join(str(e).split())[:300]) from None
        check_loaded_rfa(model, info)
        return (model, info) if want_info else model


__all__ = ["{cfg_name}", "{name}"]
'''


def mark_folder(model: nn.Module, folder: str | os.PathLike, autos: list[str] | None = None) -> None:
    """Rewrite ``folder/config.json`` of a converted model (marked model type, ``auto_map``,
    ``rfa_config``) and write its remote code; ``autos``: the Auto classes, preferred first."""
    out = Path(folder)
    cfg_path = out / "config.json"
    if not cfg_path.is_file():
        return
    rfa_config = RFAConfig.from_dict(getattr(model.config, CONFIG_ATTR))
    autos = autos if autos is not None else auto_classes_of(type(model))
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    base_type = getattr(transformers_base(type(model.config)), "model_type", "") or cfg.get("model_type", "")
    model_type = marked_model_type(base_type)
    module = MODELING_FILE[:-3]
    auto_map: dict[str, Any] = {"AutoConfig": f"{module}.{transformers_base(type(model.config)).__name__}"}
    auto_map.update({a: f"{module}.{remote_class_name(type(model))}" for a in autos})
    cfg.update(model_type=model_type, auto_map=auto_map)
    cfg[CONFIG_ATTR] = rfa_config.to_dict()
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    sources = bundle_sources()
    sources[MODELING_FILE] = modeling_source(type(model), rfa_config, type(model.config), model_type)
    for name, text in sources.items():
        (out / name).write_text(text, encoding="utf-8")
