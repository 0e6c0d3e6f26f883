"""lm-eval's ``--samples`` with ranges: ``{"task": "400-799"}`` for ``{"task": [400, ..., 799]}``.

lm-eval takes the documents to score per task as JSON lists of ids; a run over documents 400–799
then needs 400 numbers on its command line. ``hf-rfa-lm-eval`` also takes inclusive ranges as
strings, alone or in a list (``"0-49"``, ``["0-49", 60, "70-79"]``), and expands them before lm-eval
reads the value (:func:`expand_samples`); :func:`compact_samples` writes the short form of a run's
documents, as ``benchmarks/downstream_table.py`` prints its commands.
"""

from __future__ import annotations

import json
import re
from typing import Any

_RANGE_FORMS = "a list of document ids, an inclusive range 'A-B', or a list mixing both"


def _expand_ids(task: str, value: Any) -> list[int]:
    items = value if isinstance(value, list) else [value]
    out: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.append(item)
            continue
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item) if isinstance(item, str) else None
        if m is not None and m.group(2) is None:
            out.append(int(m.group(1)))
            continue
        if m is None or int(m.group(1)) > int(m.group(2)):
            raise ValueError(f"--samples: task {task!r} has {item!r}; each task takes {_RANGE_FORMS} "
                             "(ids ≥ 0, A ≤ B)")
        out.extend(range(int(m.group(1)), int(m.group(2)) + 1))
    return out


def expand_samples(value: str) -> str:
    """lm-eval's ``--samples`` JSON (``{task: [ids]}``) from ``value``, whose tasks may also give
    inclusive ranges as strings (``"400-799"``, ``["0-49", 60]``). A value that is not JSON (a
    file, as lm-eval also takes) is returned unchanged."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    if not isinstance(parsed, dict):
        raise ValueError(f"--samples: {value[:60]!r} is not a JSON object of task -> documents; "
                         f"each task takes {_RANGE_FORMS}")
    return json.dumps({t: _expand_ids(t, v) for t, v in parsed.items()}, separators=(",", ":"))


def compact_samples(tasks: dict[str, list[int]]) -> str:
    """The short ``--samples`` value of ``tasks`` (``{task: [ids]}``): each run of 3 or more
    consecutive ids as ``"A-B"``, a task that is one run as that string alone. Its
    :func:`expand_samples` is ``tasks`` again."""
    out: dict[str, Any] = {}
    for task, ids in tasks.items():
        parts: list[Any] = []
        i = 0
        while i < len(ids):
            j = i
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                j += 1
            parts += [f"{ids[i]}-{ids[j]}"] if j - i >= 2 else list(ids[i:j + 1])
            i = j + 1
        out[task] = parts[0] if len(parts) == 1 and isinstance(parts[0], str) else parts
    return json.dumps(out, separators=(",", ":"))
