"""Export a converted model as a Hub-ready folder that loads *without* hf_rfa installed.

``export(model, out_dir)`` writes::

    out_dir/
      config.json              the base config + ``rfa_config`` + ``auto_map`` → the remote class
      model.safetensors        all weights, including every ``*.rfa.*`` projection / learned tensor
      generation_config.json   (decoders, as ``save_pretrained`` writes it)
      modeling_hf_rfa.py       ``RFA<Base>`` (subclass of e.g. ``LlamaForCausalLM``), the auto_map target
      hf_rfa_*.py              hf_rfa's own modules (feature maps, ops, attention, config, convert),
                               generated from the installed source at export time
      README.md                model card (:mod:`hf_rfa.model_card`)

so that, in a process where ``hf_rfa`` cannot be imported::

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)

gives the same logits as the exported model.

How the remote code is generated: the modules that ``hf_rfa.convert`` needs are found by
following its intra-package imports (AST, transitively). Each module is copied verbatim to one
flat file, ``hf_rfa/feature_maps/base.py`` → ``hf_rfa_feature_maps_base.py``; only its
intra-package import statements are rewritten to ``from .hf_rfa_<...> import Name`` — the one
form transformers follows when it copies remote code — keeping every other line (and the line
numbers) unchanged. ``from . import submodule`` becomes ``from .hf_rfa_<sub> import __name__ as
_x; from . import hf_rfa_<sub> as submodule`` (the first half makes transformers copy the file).
The remote class calls the bundled ``convert`` in ``__init__``, so layers, seeds and the ``"rfa"``
attention/mask registration are exactly the library's; the checkpoint then fills the buffers.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from torch import nn

from . import output_dir
from .config import CONFIG_ATTR, RFAConfig

logger = logging.getLogger(__name__)

PACKAGE = "hf_rfa"
#: prefix of the generated module files
FILE_PREFIX = "hf_rfa_"
#: the file holding the remote model class
MODELING_FILE = "modeling_hf_rfa.py"
#: modules whose import closure is bundled (convert pulls attention, config, feature maps, ops)
ROOT_MODULES = ("hf_rfa.convert",)
DEFAULT_TAGS = ("hf_rfa", "linear-attention", "random-feature-attention")

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


# --------------------------------------------------------------------------- source bundling
def _package_root() -> Path:
    return Path(__file__).resolve().parent


def _module_path(name: str) -> Path | None:
    """File of module ``name`` inside the package (``__init__.py`` for subpackages), or None."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    rel = name.split(".")[1:]
    base = _package_root().joinpath(*rel) if rel else _package_root()
    if base.is_dir() and (base / "__init__.py").is_file():
        return base / "__init__.py"
    file = base.with_suffix(".py")
    return file if file.is_file() else None


def _is_package(name: str) -> bool:
    path = _module_path(name)
    return path is not None and path.name == "__init__.py"


def flat_name(module: str) -> str:
    """``hf_rfa.feature_maps.base`` → ``hf_rfa_feature_maps_base`` (module name of the flat file)."""
    if module == PACKAGE:
        raise ValueError("the top-level hf_rfa package is not bundled (import its submodules)")
    return FILE_PREFIX + "_".join(module.split(".")[1:])


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    """Absolute name of the module an ImportFrom refers to, if it is inside the package."""
    if node.level == 0:
        name = node.module or ""
        return name if name == PACKAGE or name.startswith(PACKAGE + ".") else None
    package = module if _is_package(module) else module.rsplit(".", 1)[0]
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


@dataclass
class _Rewrite:
    first: int  # 1-based line numbers, inclusive
    last: int
    text: str
    deps: list[str]


def _aliases(node: ast.ImportFrom) -> str:
    return ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)


def _rewrites(module: str, source: str) -> list[_Rewrite]:
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == PACKAGE for a in node.names):
            raise ValueError(f"{module} line {node.lineno}: 'import {PACKAGE}...' cannot be bundled; use 'from . import ...'")
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _resolve(module, node)
        if target is None:
            continue
        head, tail = lines[node.lineno - 1][: node.col_offset], lines[node.end_lineno - 1][node.end_col_offset :]
        if head.strip() or (tail.strip() and not tail.strip().startswith("#")):
            raise ValueError(f"{module} line {node.lineno}: an intra-package import must be alone on its line(s) to be bundled")
        stmts, deps = [], []
        if node.module is None or target == PACKAGE:  # from . import a, b
            direct = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                if _module_path(sub) is not None:
                    flat = flat_name(sub)
                    stmts.append(f"from .{flat} import __name__ as _{flat}_copied")  # followed by transformers
                    stmts.append(f"from . import {flat} as {a.asname or a.name}")
                    deps.append(sub)
                else:
                    direct.append(a)
            if direct:
                if target == PACKAGE:
                    raise ValueError(f"{module} line {node.lineno}: names from the top-level hf_rfa package cannot be bundled")
                names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in direct)
                stmts.append(f"from .{flat_name(target)} import {names}")
                deps.append(target)
        else:
            if _module_path(target) is None:
                raise ValueError(f"{module} line {node.lineno}: cannot find module {target}")
            stmts.append(f"from .{flat_name(target)} import {_aliases(node)}")
            deps.append(target)
        # one statement per line: transformers only follows ``from .x import`` at a line start
        text = "\n".join(head + s for s in stmts) + tail
        n_extra = max(0, (node.end_lineno - node.lineno) - (len(stmts) - 1))  # keep line numbers where possible
        out.append(_Rewrite(node.lineno, node.end_lineno, text + "\n" * n_extra, deps))
    return out


def _generate(roots: Sequence[str]) -> dict[str, tuple[Path, str]]:
    from . import __version__

    files: dict[str, tuple[Path, str]] = {}
    todo, seen = list(roots), set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_path(module)
        if path is None:
            raise ValueError(f"cannot find the source of {module}")
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines(keepends=True)
        for rw in sorted(_rewrites(module, source), key=lambda r: -r.first):
            nl = "\n" if lines[rw.last - 1].endswith("\n") else ""
            lines[rw.first - 1 : rw.last] = [rw.text + nl]
            todo.extend(rw.deps)
        rel = path.relative_to(_package_root().parent).as_posix()
        header = f"# Generated by hf_rfa {__version__} from {rel} (only intra-package imports rewritten). Do not edit.\n"
        files[flat_name(module) + ".py"] = (path, header + "".join(lines))
    return dict(sorted(files.items()))


def bundle_sources(roots: Sequence[str] = ROOT_MODULES) -> dict[str, str]:
    """``{file name: source}`` of the flat copies of ``roots`` and every hf_rfa module they import.

    Every line but the intra-package imports is hf_rfa's own, in the same order (after a one-line
    header), so tracebacks and diffs point at the library source.
    """
    return {name: text for name, (_path, text) in _generate(roots).items()}


def bundled_modules(roots: Sequence[str] = ROOT_MODULES) -> dict[str, Path]:
    """``{file name: hf_rfa source file}`` of the modules :func:`bundle_sources` generates."""
    return {name: path for name, (path, _text) in _generate(roots).items()}


# --------------------------------------------------------------------------- model class / auto map
def auto_classes_of(model_class: type) -> list[str]:
    """Names of the Auto classes whose mapping contains ``model_class`` (preferred first)."""
    import transformers

    found = []
    for auto_name, _tag in AUTO_CLASSES:
        auto_cls = getattr(transformers, auto_name, None)
        mapping = getattr(auto_cls, "_model_mapping", None)
        names = getattr(mapping, "_model_mapping", None)
        if not names:
            continue
        for value in names.values():
            vals = value if isinstance(value, (list, tuple)) else (value,)
            if model_class.__name__ in vals:
                found.append(auto_name)
                break
    return found


def pipeline_tag_of(auto_class: str) -> str | None:
    return dict(AUTO_CLASSES).get(auto_class)


def remote_class_name(model_class: type) -> str:
    return "RFA" + model_class.__name__


def _base_import(model_class: type) -> str:
    import transformers

    if getattr(transformers, model_class.__name__, None) is model_class:
        return f"from transformers import {model_class.__name__}"
    if not model_class.__module__.startswith("transformers."):
        raise ValueError(
            f"model class {model_class.__module__}.{model_class.__name__} is not part of transformers; "
            "export supports transformers' built-in architectures"
        )
    return f"from {model_class.__module__} import {model_class.__name__}"


def modeling_source(model_class: type, rfa_config: RFAConfig) -> str:
    """Source of ``modeling_hf_rfa.py``: ``RFA<Base>(Base)`` attaching RFA in ``__init__``."""
    from . import __version__

    base = model_class.__name__
    name = remote_class_name(model_class)
    conv = flat_name("hf_rfa.convert")
    att = flat_name("hf_rfa.attention")
    cfg = flat_name("hf_rfa.config")
    return f'''# Generated by hf_rfa {__version__} (hf_rfa.export). Do not edit.
"""{name}: {base} with random feature attention ({rfa_config.feature_map}), loadable without hf_rfa.

    AutoModel*.from_pretrained(path, trust_remote_code=True)

``__init__`` builds the base model, then attaches one ``RFAAttention`` per converted layer from
``config.rfa_config`` (the same seeds as ``hf_rfa.convert``) and selects the ``"rfa"`` attention and
mask functions; the projections and learned feature-map parameters then load from the checkpoint.
"""

{_base_import(model_class)}

from .{att} import ATTN_NAME, register
from .{cfg} import CONFIG_ATTR, RFAConfig
from .{conv} import convert


class {name}({base}):
    """{base} whose self-attention is random feature attention (settings in ``config.rfa_config``)."""

    def __init__(self, config, *args, **kwargs):
        register()
        rfa = getattr(config, CONFIG_ATTR, None)
        if not rfa:
            raise ValueError(f"config has no '{{CONFIG_ATTR}}': not an hf_rfa checkpoint")
        config._attn_implementation = ATTN_NAME
        super().__init__(config, *args, **kwargs)
        convert(self, RFAConfig.from_dict(dict(rfa)))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``{base}.from_pretrained``; raises if the checkpoint lacks any RFA tensor."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = sorted(k for k in info.get("missing_keys", ()) if ".rfa." in k or k.startswith("rfa."))
        if missing:
            raise ValueError(f"checkpoint lacks {{len(missing)}} RFA tensors (they would be uninitialised), e.g. {{missing[:3]}}")
        return (model, info) if want_info else model


__all__ = ["{name}"]
'''


# --------------------------------------------------------------------------- export
def _check_model(model: nn.Module) -> RFAConfig:
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(
            f"model must be a transformers PreTrainedModel converted with hf_rfa.convert, got {type(model).__name__} "
            "(for a PEFT model, merge_and_unload() first)"
        )
    d = getattr(model.config, CONFIG_ATTR, None)
    if not d:
        raise ValueError(f"model.config has no '{CONFIG_ATTR}': convert the model with hf_rfa.convert before exporting")
    config = RFAConfig.from_dict(dict(d))
    from .feature_maps import feature_map_class

    cls = feature_map_class(config.feature_map)
    if not cls.__module__.startswith(PACKAGE + "."):
        raise ValueError(
            f"feature_map={config.feature_map!r} is registered from {cls.__module__}, outside hf_rfa: "
            "the exported remote code only contains hf_rfa's own feature maps"
        )
    return config


def _check_tags(tags: Iterable[str]) -> list[str]:
    if isinstance(tags, str):
        tags = [tags]
    out = []
    for t in tags:
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"tags must be non-empty strings, got {t!r}")
        if t not in out:
            out.append(t)
    return out


def export(
    model: nn.Module,
    out_dir: str | os.PathLike,
    base_model: str | None = None,
    metrics: dict[str, Any] | None = None,
    tags: Iterable[str] = DEFAULT_TAGS,
    *,
    auto_class: str | None = None,
    pipeline_tag: str | None = None,
    license: str | None = None,
    repo_id: str | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
) -> Path:
    """Write a Hub-ready folder for a converted model; returns its path.

    Args:
        model: a transformers model converted with :func:`hf_rfa.convert` (built-in architecture).
        out_dir: target folder (created; must be empty unless ``overwrite``).
        base_model: Hub id of the model it was converted from (model card ``base_model``).
        metrics: measured quality for the model card table — ``{name: value}`` or
            ``{name: {column: value}}``; nothing is reported when None (no numbers are invented).
        tags: model card tags (``hf_rfa``, ``linear-attention``, ``random-feature-attention``).
        auto_class: Auto class for the card and the first ``auto_map`` entry (default: the most
            specific one whose mapping holds the model's class, e.g. ``AutoModelForCausalLM``).
        pipeline_tag: Hub pipeline tag (default: from ``auto_class``).
        license: model card license (e.g. the base model's).
        repo_id: Hub id used in the card's loading snippets (default: a placeholder).
        overwrite: replace a non-empty ``out_dir`` — only one that hf_rfa wrote (it holds the
            ``.hf_rfa-output`` marker). The folder is written aside and swapped in atomically.
    Raises:
        ValueError: the model is not converted / not a transformers model, ``out_dir`` is not
            empty (or not hf_rfa's, or a file), or a bad ``tags`` / ``metrics`` / ``auto_class`` value (the message names it).
    """
    rfa_config = _check_model(model)
    tags = _check_tags(tags)
    model_class = type(model)
    autos = auto_classes_of(model_class)
    if auto_class is not None:
        if auto_class not in autos:
            raise ValueError(f"auto_class={auto_class!r} does not map to {model_class.__name__}; candidates: {autos}")
        autos = [auto_class] + [a for a in autos if a != auto_class]
    if not autos:
        raise ValueError(f"no transformers Auto class maps to {model_class.__name__}; pass a model of a built-in architecture")
    if pipeline_tag is None:
        pipeline_tag = next((pipeline_tag_of(a) for a in autos if pipeline_tag_of(a)), None)
    final = output_dir.check_target(out_dir, overwrite, flag="overwrite=True", name="out_dir")
    out = output_dir.staging_dir(final)  # written aside, swapped in at the end (nothing lost)
    try:
        _write(model, out, rfa_config, autos, base_model, metrics, tags, pipeline_tag, license, repo_id, max_shard_size)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return output_dir.publish(out, final)


def _write(model, out: Path, rfa_config, autos, base_model, metrics, tags, pipeline_tag, license, repo_id, max_shard_size) -> None:
    """The files of :func:`export` written into the (staging) folder ``out``."""
    from .model_card import render_model_card

    model_class = type(model)
    logger.info("exporting %s (%s) to %s", model_class.__name__, rfa_config.feature_map, out)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)

    remote = f"{MODELING_FILE[:-3]}.{remote_class_name(model_class)}"
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["auto_map"] = {a: remote for a in autos}
    cfg[CONFIG_ATTR] = rfa_config.to_dict()
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    sources = bundle_sources()
    sources[MODELING_FILE] = modeling_source(model_class, rfa_config)
    for name, text in sources.items():
        (out / name).write_text(text, encoding="utf-8")
    logger.info("wrote %d remote-code files (%s + %d hf_rfa modules)", len(sources), MODELING_FILE, len(sources) - 1)

    card = render_model_card(
        rfa_config, model_class=model_class.__name__, auto_class=autos[0], base_model=base_model,
        metrics=metrics, tags=tags, pipeline_tag=pipeline_tag, license=license,
        num_parameters=sum(p.numel() for p in model.parameters()), repo_id=repo_id or "<this-repo>",
    )
    (out / "README.md").write_text(card, encoding="utf-8")
    _check_saved_rfa_tensors(model, out)


def _check_saved_rfa_tensors(model: nn.Module, out: Path) -> None:
    """Every rfa.* tensor of the model must be in the written safetensors files."""
    from safetensors import safe_open

    keys: set[str] = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            keys.update(fh.keys())
    wanted = [k for k in model.state_dict() if ".rfa." in k or k.startswith("rfa.")]
    missing = [k for k in wanted if k not in keys]
    if missing:
        raise RuntimeError(f"save_pretrained dropped {len(missing)} RFA tensors, e.g. {missing[:3]}")


def push_to_hub(
    model: nn.Module,
    repo_id: str,
    base_model: str | None = None,
    metrics: dict[str, Any] | None = None,
    tags: Iterable[str] = DEFAULT_TAGS,
    *,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_repo: bool = True,
    **export_kwargs,
):
    """:func:`export` to a temporary folder, then upload it with ``HfApi().upload_folder``.

    Returns the ``CommitInfo`` of the upload. ``export_kwargs`` go to :func:`export`.
    """
    from huggingface_hub import HfApi

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(f"repo_id must be a non-empty string such as 'user/model-rfa', got {repo_id!r}")
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="hf_rfa_export_") as tmp:
        export_kwargs.setdefault("repo_id", repo_id)
        folder = export(model, tmp, base_model=base_model, metrics=metrics, tags=tags, overwrite=True, **export_kwargs)
        if create_repo:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        logger.info("uploading %s to %s", folder, repo_id)
        return api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
            commit_message=commit_message or f"Upload {type(model).__name__} with random feature attention (hf_rfa)",
        )
