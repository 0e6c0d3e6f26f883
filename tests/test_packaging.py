"""What users look for in a package: license, changelog, py.typed, one version, entry points,
logging that follows transformers' verbosity, declared dependencies that are used."""

from __future__ import annotations

import importlib
import logging
import re
import tomllib
from pathlib import Path

import pytest
import torch

import hf_rfa

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_changelog_and_py_typed():
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")
    assert (ROOT / "hf_rfa" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["hf_rfa"]


def test_version_defined_once():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"] == "hf_rfa.__version__"
    hits = [p for p in (ROOT / "hf_rfa").rglob("*.py") if re.search(r"^__version__\s*=", p.read_text(), re.M)]
    assert hits == [ROOT / "hf_rfa" / "__init__.py"]


@pytest.mark.parametrize("name", ["hf-rfa-convert", "hf-rfa-evaluate", "hf-rfa-finetune", "hf-rfa-train"])
def test_entry_points_resolve_and_print_help(name, capsys):
    target = PYPROJECT["project"]["scripts"][name]
    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "usage" in capsys.readouterr().out.lower()


def test_conversion_flags_accept_both_spellings():
    from hf_rfa.cli import convert_parser

    base = ["--model", "m", "--output", "o", "--calibration-text", "c", "--eval-text", "e"]
    a = convert_parser().parse_args([*base, "--feature-map", "favor+", "--num_features", "32"])
    assert a.feature_map == "favor+" and a.num_features == 32


def test_declared_dependencies_are_imported():
    import_names = {"safetensors": "safetensors", "tqdm": "tqdm", "torch": "torch", "transformers": "transformers",
                    "accelerate": "accelerate", "datasets": "datasets", "peft": "peft"}
    source = "\n".join(p.read_text() for p in (ROOT / "hf_rfa").rglob("*.py"))
    for dep in PYPROJECT["project"]["dependencies"]:
        name = re.split(r"[<>=!~ \[]", dep)[0]
        mod = import_names[name]  # KeyError: a new dependency, add its import name here
        assert re.search(rf"^\s*(from|import) {mod}\b", source, re.M), f"{name} is declared but never imported"


def test_logging_follows_transformers_verbosity():
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    log = logging.getLogger("hf_rfa.some.module")
    try:
        hf_logging.set_verbosity_error()
        assert not log.isEnabledFor(logging.WARNING)
        hf_logging.set_verbosity_info()
        assert log.isEnabledFor(logging.INFO)
        hf_logging.set_verbosity_warning()
        assert log.isEnabledFor(logging.WARNING) and not log.isEnabledFor(logging.INFO)
    finally:
        hf_logging.set_verbosity(old)
    assert hf_rfa.__version__


def test_public_api_is_fully_annotated():
    import inspect

    for name in hf_rfa.__all__:
        obj = getattr(hf_rfa, name)
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        missing = [p.name for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
        assert not missing and sig.return_annotation is not inspect.Signature.empty, (name, missing)


def test_convert_help_lists_choices_and_every_flag_has_help():
    from hf_rfa.cli import convert_parser

    p = convert_parser()
    undocumented = [a.option_strings[0] for a in p._actions if a.option_strings and a.dest != "help" and not a.help]
    assert undocumented == []
    text = p.format_help()
    assert "favor+" in text and "hedgehog" in text
    no_progress = next(a for a in p._actions if "--no-progress" in a.option_strings)
    assert "default" not in p._get_formatter()._get_help_string(no_progress)


def test_no_public_name_shadows_a_subpackage():
    """``hf_rfa.<name>`` is the submodule whenever ``hf_rfa/<name>`` exists (no function bound over
    a module name: ``import hf_rfa.feature_maps`` gives the subpackage); the model's feature maps
    are ``hf_rfa.model_feature_maps``."""
    import pkgutil
    import types

    for info in pkgutil.iter_modules(hf_rfa.__path__):
        bound = getattr(hf_rfa, info.name, None)
        assert bound is None or isinstance(bound, types.ModuleType), (info.name, bound)
        assert info.name not in hf_rfa.__all__ or isinstance(bound, types.ModuleType), info.name
    import hf_rfa.feature_maps as fm_pkg

    assert isinstance(fm_pkg, types.ModuleType) and fm_pkg.__name__ == "hf_rfa.feature_maps"
    assert fm_pkg.build_feature_map is hf_rfa.build_feature_map
    assert "model_feature_maps" in hf_rfa.__all__ and "feature_maps" not in hf_rfa.__all__
    fm = hf_rfa.build_feature_map("favor+", head_dim=8, num_features=4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ModuleDict({"rfa": fm}))
    assert list(hf_rfa.model_feature_maps(model)) == [fm]
