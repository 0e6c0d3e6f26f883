"""One config family on the command line: recipe dataclasses *contain* an :class:`RFAConfig`.

``ConversionConfig`` and the training ``RFAArguments`` hold the model's attention settings as one
``RFAConfig`` field instead of restating its fields. ``transformers.HfArgumentParser`` parses flat
dataclasses only, so :func:`flag_view` derives one per recipe class: the class's own fields plus
every ``RFAConfig`` field (its own help, the recommended recipe :data:`RECIPE` as default), and
:func:`from_flags` builds the recipe class back from a parsed view. :func:`parse` does both, for
``argv`` or a JSON / YAML file. Each flag is spelled ``--feature_map`` and ``--feature-map``.

How a class appears on the command line is declared next to it, as ``CLI: ClassVar[FlagSpec]``.
"""

from __future__ import annotations

import json
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass
from typing import Any, Sequence

from ..config import RFAConfig
from ..feature_maps import available_feature_maps
from ..ops.backends import backend_names

#: the recommended recipe (the main job, ``conversion/main_job.py``): FAVOR+ with m=256 for far keys,
#: an exact window of 256 and 4 exact sink tokens; the command lines' defaults
RECIPE: dict[str, Any] = {"feature_map": "favor+", "num_features": 256, "window": 256, "sinks": 4}


def recipe_config(**changes: Any) -> RFAConfig:
    """:data:`RECIPE` as an ``RFAConfig`` (``changes`` override any field)."""
    return RFAConfig(**{**RECIPE, **changes})


@dataclass(frozen=True)
class FlagSpec:
    """How a recipe dataclass with an ``RFAConfig`` field (``rfa_field``) appears as flat flags."""

    rfa_field: str = "rfa"
    #: RFAConfig field -> flag name (where the recipe's other dataclasses use the name: ``seed``)
    rename: dict[str, str] = field(default_factory=dict)
    #: RFAConfig fields that are not flags (the recipe class has its own field for them)
    skip: tuple[str, ...] = ()
    #: ``feature_map`` value meaning "no RFAConfig" (the field becomes None: exact softmax)
    none_value: str | None = None
    #: own fields that the command line requires although the dataclass has a default
    required: tuple[str, ...] = ()
    #: own ``int | None`` fields where the flag value 0 means None
    zero_is_none: tuple[str, ...] = ()


def _spec(cls: type) -> FlagSpec | None:
    return getattr(cls, "CLI", None)


def _layers(flag: str, value: str | None) -> list[int] | None:
    """``"0,1"`` / ``"0 1"`` -> ``[0, 1]``; None or "" -> None (every layer)."""
    if value is None or not str(value).strip():
        return None
    try:
        return [int(x) for x in str(value).replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated layer indices such as '0,1', got {value!r}") from None


def _options(flag: str, value: str | dict | None) -> dict:
    """A JSON object string -> dict (a dict passes through)."""
    if isinstance(value, dict):
        return value
    try:
        out = json.loads(value or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON object such as '{{\"learnable\": true}}', got {value!r} ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{flag} must be a JSON object, got {value!r}")
    return out


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _rfa_flag_fields(spec: FlagSpec) -> list[tuple[str, Any, Field]]:
    """One flat field per ``RFAConfig`` field: its help, the recipe's default, listed choices."""
    hints = typing.get_type_hints(RFAConfig)
    out = []
    for f in fields(RFAConfig):
        if f.name in spec.skip:
            continue
        name = spec.rename.get(f.name, f.name)
        default = RECIPE.get(f.name, _default(f))
        meta = dict(f.metadata)
        kind = hints[f.name]
        if f.name == "feature_map":
            names = sorted(available_feature_maps())
            meta["choices"] = names + ([spec.none_value] if spec.none_value else [])
            meta["help"] = "feature map of the converted layers" + (f" ('{spec.none_value}': keep exact softmax, no conversion)" if spec.none_value else "")
        elif f.name == "backend":
            meta["choices"] = list(backend_names())
        elif f.name == "layers":  # a list or None: one string on the command line
            kind, meta["help"] = str | None, "comma-separated indices of the layers to convert (None: all)"
        elif f.name == "feature_map_options":
            kind, default, meta["help"] = str, "{}", 'extra options of the map, a JSON object (e.g. \'{"learnable": true}\')'
        out.append((name, kind, field(default=default, metadata=meta)))
    return out


def flag_view(cls: type) -> type:
    """The flat dataclass ``HfArgumentParser`` parses for ``cls`` (``cls`` itself when it has no ``CLI``)."""
    spec = _spec(cls)
    if spec is None:
        return cls
    cached = cls.__dict__.get("_flag_view")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    own = []
    for f in fields(cls):
        if f.name == spec.rfa_field:  # its flags where the field is declared
            own += _rfa_flag_fields(spec)
        if f.name == spec.rfa_field or not f.init:
            continue
        if f.name in spec.required:
            own.append((f.name, hints[f.name], field(metadata=dict(f.metadata))))
        elif f.default_factory is not MISSING:
            own.append((f.name, hints[f.name], field(default_factory=f.default_factory, metadata=dict(f.metadata))))
        elif f.default is not MISSING:
            own.append((f.name, hints[f.name], field(default=f.default, metadata=dict(f.metadata))))
        else:
            own.append((f.name, hints[f.name], field(metadata=dict(f.metadata))))
    view = make_dataclass(f"{cls.__name__}Flags", own, kw_only=True)
    view.__doc__ = f"Flat command-line view of :class:`{cls.__name__}` (see hf_rfa.recipes.flags)."
    view.__module__ = __name__
    cls._flag_view = view
    return view


def from_flags(cls: type, flags: Any) -> Any:
    """``cls`` from a parsed :func:`flag_view` instance (or a dict of flag values)."""
    spec = _spec(cls)
    values = dict(flags) if isinstance(flags, dict) else {f.name: getattr(flags, f.name) for f in fields(flags)}
    if spec is None:
        return cls(**values)
    rfa = {}
    for f in fields(RFAConfig):
        if f.name in spec.skip:
            continue
        name = spec.rename.get(f.name, f.name)
        if name not in values:
            continue
        value = values.pop(name)
        if f.name == "layers":
            value = value if isinstance(value, list) else _layers(f"--{name}", value)
        elif f.name == "feature_map_options":
            value = _options(f"--{name}", value)
        rfa[f.name] = value
    for name in spec.zero_is_none:
        if values.get(name) == 0:
            values[name] = None
    if spec.none_value is not None and rfa.get("feature_map") == spec.none_value:
        values[spec.rfa_field] = None
    else:
        values[spec.rfa_field] = RFAConfig(**{**RECIPE, **rfa})
    return cls(**values)


def flat_dict(obj: Any) -> dict[str, Any]:
    """``obj``'s fields with its ``RFAConfig`` spread out under the flag names (``report.json``'s
    ``config``: the keys a run had before the configs were nested)."""
    spec = _spec(type(obj))
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if spec is None or f.name != spec.rfa_field:
            out[f.name] = value
        elif value is not None:
            out.update({spec.rename.get(k, k): v for k, v in value.to_dict().items() if k not in spec.skip})
    return out


def parser(classes: Sequence[type], formatter_class: type | None = None, **kwargs: Any):
    """``HfArgumentParser`` over the flag views of ``classes``."""
    from transformers import HfArgumentParser

    if formatter_class is not None:
        kwargs["formatter_class"] = formatter_class
    return HfArgumentParser([flag_view(c) for c in classes], **kwargs)


def parse(
    classes: Sequence[type], argv: list[str] | None = None, config_file: str | None = None,
    formatter_class: type | None = None, **kwargs: Any,
) -> tuple:
    """Instances of ``classes`` from ``argv`` (default ``sys.argv[1:]``) or a ``.json`` / ``.yaml`` file."""
    p = parser(classes, formatter_class, **kwargs)
    if config_file is not None:
        views = p.parse_json_file(config_file) if config_file.endswith(".json") else p.parse_yaml_file(config_file)
    else:
        views = p.parse_args_into_dataclasses(args=argv)
    return tuple(from_flags(c, v) for c, v in zip(classes, views))


__all__ = ["RECIPE", "FlagSpec", "flag_view", "flat_dict", "from_flags", "parse", "parser", "recipe_config"]
