"""lm-evaluation-harness on converted models: the ``hf_rfa`` model entry and the ``hf-rfa-lm-eval`` command.

lm-eval 0.4 has no plugin discovery for models, so the entry is registered when this module is
imported; the command imports it, puts the offline tasks (:mod:`hf_rfa.integrations.lm_eval_tasks`)
on the include path, then runs lm-eval's own command line::

    hf-rfa-lm-eval --model hf_rfa --model_args pretrained=out/quick-rfa,dtype=float32 \\
        --tasks hf_rfa_offline --device cpu --batch_size 1
    python -m hf_rfa.integrations.lm_eval ...      # the same

``--model hf_rfa`` (:class:`RFALM`, a subclass of lm-eval's ``HFLM``) loads a folder saved from a
converted model through :func:`hf_rfa.from_pretrained` (an unconverted folder is refused unless
``rfa_<field>=...`` model arguments ask to convert it on load, e.g. the window-only baseline
``rfa_feature_map=none,rfa_window=64,rfa_sinks=4``; on a converted folder they change the settings
without parameters, e.g. ``rfa_memory=1024``) and generates with :class:`hf_rfa.RFACache`.

``--samples`` takes lm-eval's JSON of document ids per task, and also inclusive ranges written as
strings, alone or in a list: ``'{"rfa_rotten_tomatoes":"400-799","rfa_bbc_topic":["0-49",60]}'``
(the command expands them before lm-eval reads the value: :mod:`hf_rfa.integrations.lm_eval_samples`).
An exported folder (:func:`hf_rfa.export`) needs no hf_rfa at all:
``lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from lm_eval.api.registry import model_registry
from lm_eval.models.huggingface import HFLM

from ..config import CONFIG_ATTR, RFAConfig
from .lm_eval_samples import expand_samples

logger = logging.getLogger(__name__)

#: the name of the model entry (``--model hf_rfa``)
MODEL_NAME = "hf_rfa"
#: model arguments with this prefix are RFAConfig fields (convert an unconverted folder on load)
RFA_ARG_PREFIX = "rfa_"


def _rfa_overrides(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the ``rfa_<field>`` model arguments out of ``kwargs`` as RFAConfig fields."""
    return {k[len(RFA_ARG_PREFIX):]: kwargs.pop(k) for k in list(kwargs) if k.startswith(RFA_ARG_PREFIX)}


class RFALM(HFLM):
    """lm-eval's ``HFLM`` for hf_rfa checkpoints: loads them converted, generates with RFACache.

    Model arguments are ``HFLM``'s (``pretrained``, ``dtype``, ``batch_size``, ``max_length``, ...)
    plus optional ``rfa_<field>=value`` (an :class:`~hf_rfa.RFAConfig` field) to convert a folder
    that was not converted, or, on a converted folder, to change its settings that involve no
    parameters (:func:`hf_rfa.reconfigure`, e.g. ``rfa_memory=1024``). ``pretrained`` may also be a
    converted model object.
    """

    def __init__(self, pretrained: Any, **kwargs: Any) -> None:
        self._rfa_fields = _rfa_overrides(kwargs)
        if self._rfa_fields:
            RFAConfig.from_dict(self._rfa_fields)  # bad field names / values fail here, with their names
        if not isinstance(pretrained, str) and not _is_rfa(pretrained):
            raise ValueError(f"pretrained must be a converted model or the folder of one, got an unconverted {type(pretrained).__name__}")
        super().__init__(pretrained=pretrained, **kwargs)

    def _create_model(self, pretrained: str, revision: str | None = "main", dtype: Any = "auto", trust_remote_code: bool | None = False, **kwargs: Any) -> None:
        import transformers
        from lm_eval.models.utils_hf import get_dtype

        from .. import convert, from_pretrained, reconfigure

        for unsupported in ("peft", "delta", "autogptq", "gptqmodel", "gguf_file", "tp_plan"):
            if kwargs.get(unsupported):
                raise ValueError(f"{unsupported}={kwargs[unsupported]!r} is not supported by --model {MODEL_NAME}; use --model hf")
        load = {"dtype": get_dtype(dtype)}
        if revision not in (None, "main"):
            load["revision"] = revision
        config = transformers.AutoConfig.from_pretrained(pretrained, **({"revision": revision} if "revision" in load else {}))
        if getattr(config, CONFIG_ATTR, None):
            self._model = from_pretrained(pretrained, **load)
            if self._rfa_fields:  # a converted folder: only the settings without parameters can change
                reconfigure(self._model, **self._rfa_fields)
                logger.info("%s evaluated with %s", pretrained, self._rfa_fields)
        elif self._rfa_fields:
            model = transformers.AutoModelForCausalLM.from_pretrained(pretrained, **load)
            self._model = convert(model, RFAConfig.from_dict(self._rfa_fields))
            logger.info("%s converted on load: %s", pretrained, self._rfa_fields)
        else:
            raise ValueError(
                f"{pretrained} is not a converted hf_rfa checkpoint (no '{CONFIG_ATTR}' in its config.json): convert it "
                f"with hf-rfa-convert, pass rfa_<field>=... model arguments to convert it on load, or use --model hf for the original"
            )

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs: Any):
        from ..hf.cache import RFACache

        key = cache_kwarg()
        if all(generation_kwargs.get(k) is None for k in ("cache", "past_key_values")) and _is_rfa(self.model):
            generation_kwargs[key] = RFACache(self.model.config)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def cache_kwarg() -> str:
    """The name ``generate()`` takes a cache under: ``cache`` (newer transformers) or ``past_key_values``."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", None)
    return names[0] if names else "past_key_values"


def _is_rfa(model: Any) -> bool:
    from ..hf.cache import uses_rfa

    return uses_rfa(model)


def register() -> None:
    """Register :class:`RFALM` as lm-eval's ``hf_rfa`` model (idempotent)."""
    if model_registry.get(MODEL_NAME, None) is not RFALM:
        model_registry.register(MODEL_NAME, target=RFALM)


register()


# --------------------------------------------------------------------------- command line
def _flag_value(argv: list[str], flag: str) -> tuple[int, str] | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if a.startswith(flag + "="):
            return i, a.split("=", 1)[1]
    return None


def with_offline_tasks(argv: list[str]) -> list[str]:
    """``argv`` with the offline tasks it names written and their folder on ``--include_path``."""
    from .lm_eval_tasks import prepare_tasks, resolve_tasks

    found = _flag_value(argv, "--tasks")
    ours = resolve_tasks(found[1].split(",")) if found else []
    if not ours:
        return list(argv)
    folder = str(prepare_tasks(tasks=ours))
    argv = list(argv)
    inc = _flag_value(argv, "--include_path")
    if inc is None:
        return argv + ["--include_path", folder]
    i, value = inc
    joined = f"{value}:{folder}" if value else folder
    argv[i] = joined if argv[i] == value else f"--include_path={joined}"
    return argv


def with_expanded_samples(argv: list[str]) -> list[str]:
    """``argv`` with the ``--samples`` ranges (:func:`expand_samples`) written out for lm-eval."""
    argv = list(argv)
    for flag in ("--samples", "-E"):
        found = _flag_value(argv, flag)
        if found is not None:
            i, value = found
            expanded = expand_samples(value)
            argv[i] = expanded if argv[i] == value else f"{flag}={expanded}"
    return argv


def main(argv: list[str] | None = None) -> int:
    """``hf-rfa-lm-eval``: lm-eval's command line with ``--model hf_rfa`` and the offline tasks.

    Returns 0 on success. A user error (``ValueError`` / ``OSError``: a folder never converted, an
    unknown task, a missing model) is one line on stderr and status 2, as the other hf_rfa
    commands do; ``--debug`` (taken out before lm-eval parses) shows the traceback instead."""
    from lm_eval.__main__ import cli_evaluate

    from ..cli import DEBUG_FLAG, USER_ERRORS, user_error

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv
    try:
        args = with_offline_tasks(with_expanded_samples([a for a in argv if a != DEBUG_FLAG]))
    except ValueError as e:
        if debug:
            raise
        return user_error("hf-rfa-lm-eval", e)
    old = sys.argv
    sys.argv = [old[0] if old else "hf-rfa-lm-eval", *args]
    try:
        cli_evaluate()
    except USER_ERRORS as e:
        if debug:
            raise
        return user_error("hf-rfa-lm-eval", e)
    finally:
        sys.argv = old
    return 0


if __name__ == "__main__":
    sys.exit(main())
