"""One config family on the command line: recipe dataclasses *contain* an :class:`RFAConfig`.

``ConversionConfig`` and the training ``RFAArguments`` hold the model's attention settings as one
``RFAConfig`` field instead of restating its fields. ``transformers.HfArgumentParser`` parses flat
dataclasses only, so :func:`flag_view` derives one per recipe class and preset: the class's own
fields plus every ``RFAConfig`` field (its own help) plus ``--preset``, with the preset's values
as defaults (:mod:`hf_rfa.presets`: its ``RFAConfig`` fields and, for the class's own fields, its
training budgets). A flag given on the command line therefore overrides the preset; every other
value is the preset's. :func:`from_flags` builds the recipe class back from a parsed view.
:func:`parse` does both, for ``argv`` or a JSON / YAML file (whose ``preset`` key chooses the
preset). Each flag is spelled ``--feature_map`` and ``--feature-map``.

How a class appears on the command line is declared next to it, as ``CLI: ClassVar[FlagSpec]``.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass
from typing import Any, Sequence

from ..config import RFAConfig
from ..feature_maps import available_feature_maps
from ..ops.backends import backend_names
from ..presets import DEFAULT_PRESET, PRESETS, Preset, get_preset

#: the flag naming the preset (``--preset recall``)
PRESET_FLAG = "preset"


def preset_config(name: str = DEFAULT_PRESET, **changes: Any) -> RFAConfig:
    """The preset's ``RFAConfig`` (``changes`` override any field); a dataclass default factory."""
    return get_preset(name).config(**changes)


def preset_of(argv: Sequence[str] | None) -> str:
    """The ``--preset`` named in ``argv`` (the default preset when none or an unknown one is given:
    the parser itself then refuses the unknown name, listing the choices)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--preset", default=DEFAULT_PRESET)
    known, _ = p.parse_known_args(list(argv or []))
    return known.preset if known.preset in PRESETS else DEFAULT_PRESET


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


def _rfa_flag_fields(spec: FlagSpec, preset: Preset) -> list[tuple[str, Any, Field]]:
    """One flat field per ``RFAConfig`` field: its help, the preset's value as default, listed choices."""
    hints = typing.get_type_hints(RFAConfig)
    base = preset.config().to_dict()
    out = []
    for f in fields(RFAConfig):
        if f.name in spec.skip:
            continue
        name = spec.rename.get(f.name, f.name)
        default = base[f.name]
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
            kind, default, meta["help"] = str, json.dumps(default), 'extra options of the map, a JSON object (e.g. \'{"learnable": true}\')'
        out.append((name, kind, field(default=default, metadata=meta)))
    return out


def _preset_field() -> tuple[str, Any, Field]:
    names = list(PRESETS)
    help_text = "named recipe whose settings and training budgets are the defaults of every other flag (flags given override them): " + "; ".join(
        f"{n}: {p.summary}" for n, p in PRESETS.items())
    return (PRESET_FLAG, str, field(default=DEFAULT_PRESET, metadata={"help": help_text, "choices": names}))


_VIEWS: dict[tuple[type, str], type] = {}


def flag_view(cls: type, preset: str | None = None) -> type:
    """The flat dataclass ``HfArgumentParser`` parses for ``cls`` with ``preset``'s values as
    defaults (``cls`` itself when it has no ``CLI``)."""
    spec = _spec(cls)
    if spec is None:
        return cls
    p = get_preset(preset or DEFAULT_PRESET)
    cached = _VIEWS.get((cls, p.name))
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    own = []
    for f in fields(cls):
        if f.name == spec.rfa_field:  # its flags where the field is declared, the preset first
            own += [_preset_field(), *_rfa_flag_fields(spec, p)]
        if f.name == spec.rfa_field or not f.init:
            continue
        meta = dict(f.metadata)
        if f.name in spec.required:
            own.append((f.name, hints[f.name], field(metadata=meta)))
        elif f.name in p.training:
            value = p.training[f.name]
            own.append((f.name, hints[f.name], field(default_factory=lambda v=value: v, metadata=meta) if isinstance(value, list) else field(default=value, metadata=meta)))
        elif f.default_factory is not MISSING:
            own.append((f.name, hints[f.name], field(default_factory=f.default_factory, metadata=meta)))
        elif f.default is not MISSING:
            own.append((f.name, hints[f.name], field(default=f.default, metadata=meta)))
        else:
            own.append((f.name, hints[f.name], field(metadata=meta)))
    view = make_dataclass(f"{cls.__name__}Flags", own, kw_only=True)
    view.__doc__ = f"Flat command-line view of :class:`{cls.__name__}` with preset {p.name!r} (see hf_rfa.recipes.flags)."
    view.__module__ = __name__
    _VIEWS[(cls, p.name)] = view
    return view


def from_flags(cls: type, flags: Any) -> Any:
    """``cls`` from a parsed :func:`flag_view` instance (or a dict of flag values)."""
    spec = _spec(cls)
    values = dict(flags) if isinstance(flags, dict) else {f.name: getattr(flags, f.name) for f in fields(flags)}
    if spec is None:
        return cls(**values)
    preset = get_preset(values.pop(PRESET_FLAG, None) or DEFAULT_PRESET)
    names = {f.name for f in fields(cls)}
    for name, value in preset.training.items():  # a dict of flags may leave budgets out: the preset's
        if name in names and name not in values:
            values[name] = list(value) if isinstance(value, list) else value
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
        values[spec.rfa_field] = preset.config(**_own_options(preset, rfa))
    return cls(**values)


def _own_options(preset: Preset, rfa: dict[str, Any]) -> dict[str, Any]:
    """``rfa`` overrides, where the preset's map options still at their default follow the preset's
    map: another ``feature_map`` with the options left alone gets none (hybrid_mix is Hedgehog's)."""
    own = preset.config()
    if rfa.get("feature_map", own.feature_map) != own.feature_map and rfa.get("feature_map_options") == own.feature_map_options:
        rfa = {**rfa, "feature_map_options": {}}
    return rfa


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


def parser(classes: Sequence[type], formatter_class: type | None = None, preset: str | None = None, **kwargs: Any):
    """``HfArgumentParser`` over the flag views of ``classes`` (defaults: ``preset``'s values)."""
    from transformers import HfArgumentParser

    if formatter_class is not None:
        kwargs["formatter_class"] = formatter_class
    return HfArgumentParser([flag_view(c, preset) for c in classes], **kwargs)


def parse(
    classes: Sequence[type], argv: list[str] | None = None, config_file: str | None = None,
    formatter_class: type | None = None, **kwargs: Any,
) -> tuple:
    """Instances of ``classes`` from ``argv`` (default ``sys.argv[1:]``) or a ``.json`` / ``.yaml`` file;
    ``--preset`` (the file's ``preset`` key) chooses the defaults of every other flag."""
    import sys

    if config_file is not None:
        with open(config_file, encoding="utf-8") as f:
            if config_file.endswith(".json"):
                values = json.load(f)
            else:
                import yaml

                values = yaml.safe_load(f)
        name = values.get(PRESET_FLAG, DEFAULT_PRESET) if isinstance(values, dict) else DEFAULT_PRESET
        p = parser(classes, formatter_class, preset=name if name in PRESETS else None, **kwargs)
        views = p.parse_dict(values)
    else:
        argv = sys.argv[1:] if argv is None else argv
        p = parser(classes, formatter_class, preset=preset_of(argv), **kwargs)
        views = p.parse_args_into_dataclasses(args=argv)
    return tuple(from_flags(c, v) for c, v in zip(classes, views))


__all__ = ["PRESET_FLAG", "FlagSpec", "flag_view", "flat_dict", "from_flags", "parse", "parser", "preset_config", "preset_of"]
