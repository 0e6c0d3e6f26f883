"""Export a converted model as a Hub-ready folder that loads *without* hf_rfa installed.

``export(model, out_dir)`` writes::

    out_dir/
      config.json              the base config, model type ``hf_rfa_<type>``, ``rfa_config``, ``auto_map`` → the remote classes
      model.safetensors        all weights, including every ``*.rfa.*`` projection / learned tensor
      generation_config.json   (decoders, as ``save_pretrained`` writes it)
      modeling_hf_rfa.py       ``RFA<Base>`` (subclass of e.g. ``LlamaForCausalLM``), the auto_map target
      hf_rfa_*.py              hf_rfa's own modules (feature maps, ops, attention, config, convert),
                               generated from the installed source at export time
      README.md                model card (:mod:`hf_rfa.hub.model_card`)

so that, in a process where ``hf_rfa`` cannot be imported::

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)

gives the same logits as the exported model.

How the remote code is generated: :mod:`hf_rfa.hub.bundle`. The remote class calls the bundled ``convert`` in ``__init__``, so layers, seeds and the ``"rfa"``
attention/mask registration are exactly the library's; the checkpoint then fills the buffers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from torch import nn

from .. import output_dir
from ..config import CONFIG_ATTR, RFAConfig
from .bundle import PACKAGE, bundle_sources, bundled_modules, flat_name  # noqa: F401 (re-exported)
from .remote import AUTO_CLASSES, MODELING_FILE, auto_classes_of, mark_folder, modeling_source, remote_class_name  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

logger = logging.getLogger(__name__)

#: sentence-transformers files copied from the source folder when present (plus the module folders
#: named in ``modules.json``, e.g. ``1_Pooling/``)
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
DEFAULT_TAGS = ("hf_rfa", "linear-attention", "random-feature-attention")


def pipeline_tag_of(auto_class: str) -> str | None:
    return dict(AUTO_CLASSES).get(auto_class)


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
    from ..feature_maps import feature_map_class

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
    tokenizer: Any = None,
    source_dir: str | os.PathLike | None = None,
    dataset_name: str | None = None,
    published_as: str | os.PathLike | None = None,
) -> Path:
    """Write a Hub-ready folder for a converted model; returns its path.

    Args:
        model: a transformers model converted with :func:`hf_rfa.convert` (built-in architecture).
        out_dir: target folder (created; must be empty unless ``overwrite``).
        base_model: Hub id of the model it was converted from (model card ``base_model``).
        metrics: measured quality for the model card table — ``{name: value}`` or
            ``{name: {column: value}}``, a value a number, a string or ``{"value": x, "ci95": [lo, hi]}``
            (shown as ``x [lo, hi]``); nothing is reported when None (no numbers are invented).
        tags: model card tags (``hf_rfa``, ``linear-attention``, ``random-feature-attention``).
        auto_class: Auto class for the card and the first ``auto_map`` entry (default: the most
            specific one whose mapping holds the model's class, e.g. ``AutoModelForCausalLM``).
        pipeline_tag: Hub pipeline tag (default: from ``auto_class``).
        license: model card license (e.g. the base model's).
        repo_id: Hub id used in the card's loading snippets (default: the folder's path, with a
            note to replace it after uploading).
        overwrite: replace a non-empty ``out_dir`` — only one that hf_rfa wrote (it holds the
            ``.hf_rfa-output`` marker). The folder is written aside and swapped in atomically.
        tokenizer: saved with the model (default: loaded from ``source_dir`` or the model's
            ``config._name_or_path``; a warning when there is none).
        source_dir: the folder the model was loaded from (default: ``config._name_or_path`` when
            it is a folder): its sentence-transformers files are copied.
        dataset_name: the evaluation data named in the card's ``model-index``.
        published_as: the folder that the card's loading snippets and the messages name when
            ``out_dir`` is itself a staging folder that the caller renames afterwards (the
            conversion pipeline); default: ``out_dir``.
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
        _write(model, out, rfa_config, autos, base_model, metrics, tags, pipeline_tag, license, repo_id, max_shard_size,
               final=Path(published_as) if published_as is not None else final, tokenizer=tokenizer, source_dir=source_dir,
               dataset_name=dataset_name)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return output_dir.publish(out, final)


def _write(model, out: Path, rfa_config, autos, base_model, metrics, tags, pipeline_tag, license, repo_id, max_shard_size,
           final: Path, tokenizer: Any = None, source_dir=None, dataset_name: str | None = None) -> None:
    """The files of :func:`export` written into the (staging) folder ``out`` (published as ``final``)."""
    from .model_card import render_model_card

    model_class = type(model)
    logger.info("exporting %s (%s) to %s", model_class.__name__, rfa_config.feature_map, out)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)

    mark_folder(model, out, autos)  # marked model type, auto_map, rfa_config, remote code
    logger.info("wrote the remote code (%s + the bundled hf_rfa modules)", MODELING_FILE)

    card = render_model_card(
        rfa_config, model_class=model_class.__name__, auto_class=autos[0], base_model=base_model,
        metrics=metrics, tags=tags, pipeline_tag=pipeline_tag, license=license,
        num_parameters=sum(p.numel() for p in model.parameters()), repo_id=repo_id or str(Path(final).resolve()),
        dataset_name=dataset_name,
    )
    if repo_id is None:
        card += "\n(The loading snippets name this folder; after uploading, use the Hub id instead.)\n"
    (out / "README.md").write_text(card, encoding="utf-8")
    _check_saved_rfa_tensors(model, out)
    source = Path(source_dir) if source_dir is not None else _source_dir(model)
    _save_tokenizer(tokenizer, source if source is not None else getattr(model.config, "_name_or_path", None), out, final)
    if source is not None:
        _copy_sentence_transformers_files(source, out)


def _source_dir(model: nn.Module) -> Path | None:
    name = getattr(model.config, "_name_or_path", None)
    return Path(name) if name and os.path.isdir(name) else None


def _save_tokenizer(tokenizer: Any, source: str | Path | None, out: Path, final: Path | None = None) -> None:
    """Save ``tokenizer`` (or the one at ``source``) into ``out``; a warning naming the published
    folder ``final`` (default ``out``) when there is none."""
    if tokenizer is None and source:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source))
        except Exception as e:  # noqa: BLE001 - no tokenizer there: the export is still complete otherwise
            logger.debug("no tokenizer at %s: %s", source, e)
    if tokenizer is None:
        logger.warning("export: no tokenizer saved (pass tokenizer=...): AutoTokenizer.from_pretrained(%s) will fail", final or out)
        return
    tokenizer.save_pretrained(out)


def _copy_sentence_transformers_files(source: Path, out: Path) -> None:
    """Copy ``modules.json``, ``sentence_bert_config.json``, … and the module folders it names."""
    copied = []
    for name in SENTENCE_TRANSFORMERS_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
            copied.append(name)
    if (source / "modules.json").is_file():
        for module in json.loads((source / "modules.json").read_text(encoding="utf-8")):
            sub = module.get("path") or ""
            if sub and (source / sub).is_dir():
                shutil.copytree(source / sub, out / sub, dirs_exist_ok=True)
                copied.append(sub + "/")
    if copied:
        logger.info("export: copied sentence-transformers files %s", copied)


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
    **export_kwargs: Any,
) -> CommitInfo:
    """:func:`export` to a temporary folder, then upload it with ``HfApi().upload_folder``.

    Returns the ``CommitInfo`` of the upload. ``export_kwargs`` go to :func:`export`.
    """
    from huggingface_hub import HfApi

    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ValueError(f"repo_id must be a non-empty string such as 'user/model-rfa', got {repo_id!r}")
    api = HfApi(token=token)
    tmp = tempfile.mkdtemp(prefix="hf_rfa_export_")
    export_kwargs.setdefault("repo_id", repo_id)
    folder = export(model, tmp, base_model=base_model, metrics=metrics, tags=tags, overwrite=True, **export_kwargs)
    try:
        if create_repo:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        logger.info("uploading %s to %s", folder, repo_id)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
            commit_message=commit_message or f"Upload {type(model).__name__} with random feature attention (hf_rfa)",
        )
    except Exception as e:  # noqa: BLE001 - network / auth: keep the export, say how to finish
        raise PushError(repo_id, folder, e) from e
    shutil.rmtree(tmp, ignore_errors=True)
    return info


class PushError(RuntimeError):
    """An upload failed; the exported folder is kept at ``folder`` (upload it later)."""

    def __init__(self, repo_id: str, folder: str | os.PathLike, cause: BaseException) -> None:
        self.repo_id, self.folder = repo_id, str(folder)
        first = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(
            f"upload to the Hub repo {repo_id!r} failed ({type(cause).__name__}: {first}). The folder is kept at "
            f"{self.folder}; upload it when the Hub is reachable and you are logged in (`hf auth login`): "
            f"hf upload {repo_id} {self.folder} --repo-type model"
        )
