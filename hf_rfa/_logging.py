"""hf_rfa's loggers follow ``transformers.logging`` verbosity.

The ``hf_rfa`` logger's level is set from ``transformers.logging.get_verbosity()`` on import
(``TRANSFORMERS_VERBOSITY`` included) and again whenever ``transformers.logging.set_verbosity*``
is called, so ``transformers.logging.set_verbosity_error()`` silences hf_rfa's warnings too and
``set_verbosity_info()`` shows its progress messages. Handlers stay the application's (records
propagate to the root logger as usual); ``logging.getLogger("hf_rfa").setLevel(...)`` still
overrides until the next ``set_verbosity`` call.
"""

from __future__ import annotations

import functools
import logging

LOGGER_NAME = "hf_rfa"


def follow_transformers_verbosity() -> None:
    """Sync the ``hf_rfa`` logger level with transformers' verbosity now and on every change (idempotent)."""
    from transformers.utils import logging as hf_logging

    logging.getLogger(LOGGER_NAME).setLevel(hf_logging.get_verbosity())
    original = hf_logging.set_verbosity
    if getattr(original, "_hf_rfa_hook", False):
        return

    @functools.wraps(original)
    def set_verbosity(verbosity: int) -> None:
        original(verbosity)
        logging.getLogger(LOGGER_NAME).setLevel(verbosity)

    set_verbosity._hf_rfa_hook = True
    hf_logging.set_verbosity = set_verbosity


def error_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its class name when it has none): what a one-line error
    or a re-raised one quotes of the error it reports."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
