"""Data for the recipes: load text / CSV / JSON files or a Hub dataset, tokenise, batch.

Local files are read into in-memory ``datasets.Dataset`` objects (no Arrow cache, so several
processes can prepare them at once); Hub datasets go through ``datasets.load_dataset``.

* ``causal-lm``: documents are tokenised, concatenated and cut into blocks of
  ``max_seq_length`` tokens (``labels = input_ids``), as in transformers' ``run_clm.py``.
  A ``.txt`` file holds documents separated by blank lines.
* ``classification``: one text column and one label column; string labels are mapped to ids in
  sorted order (``label_names``).
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any, ContextManager

from datasets import Dataset, DatasetDict

from .args import DataArguments

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """Tokenised splits plus what the model needs to know about them."""

    train: Dataset
    eval: Dataset | None
    label_names: list[str] | None  # classification only
    collator: Any


def read_text_documents(path: str) -> list[str]:
    """Documents of a UTF-8 text file: blocks separated by one or more blank lines."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]


def read_records(path: str) -> list[dict[str, Any]]:
    """Rows of a CSV (header line), JSON (list of objects) or JSON-lines file."""
    if path.endswith(".csv"):
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        obj = json.load(f)
    if isinstance(obj, dict) and "data" in obj:
        obj = obj["data"]
    if not isinstance(obj, list):
        raise ValueError(f"train_file/validation_file {path}: expected a JSON list of objects (or {{'data': [...]}})")
    return obj


def _read_file(path: str, task: str) -> Dataset:
    if not os.path.isfile(path):
        raise ValueError(f"train_file/validation_file {path!r} does not exist")
    if path.endswith(".txt"):
        if task != "causal-lm":
            raise ValueError(f"a .txt file ({path}) is only valid for task='causal-lm'; use CSV/JSON for classification")
        return Dataset.from_dict({"text": read_text_documents(path)})
    return Dataset.from_list(read_records(path))


def load_raw(args: DataArguments) -> DatasetDict:
    """``DatasetDict`` with ``train`` and (if any) ``validation``."""
    splits: dict[str, Dataset] = {}
    if args.dataset_name is not None:
        from datasets import load_dataset

        raw = load_dataset(args.dataset_name, args.dataset_config_name)
        splits["train"] = raw["train"]
        for name in (args.validation_split, "validation", "test"):
            if name in raw:
                splits["validation"] = raw[name]
                break
    else:
        splits["train"] = _read_file(args.train_file, args.task)
        if args.validation_file:
            splits["validation"] = _read_file(args.validation_file, args.task)
    if "validation" not in splits and args.validation_split_percentage:
        parts = splits["train"].train_test_split(test_size=args.validation_split_percentage / 100, seed=0, shuffle=True)
        splits["train"], splits["validation"] = parts["train"], parts["test"]
    return DatasetDict(splits)


def text_column_of(ds: Dataset, requested: str | None) -> str:
    """The text column: ``requested``, else 'text' / 'sentence' / the first string column."""
    cols = ds.column_names
    if requested is not None:
        if requested not in cols:
            raise ValueError(f"text_column {requested!r} not in the data (columns: {cols})")
        return requested
    for name in ("text", "sentence", "content", "review"):
        if name in cols:
            return name
    for name in cols:
        if ds.features[name].dtype == "string":
            return name
    raise ValueError(f"no string column found for text_column (columns: {cols}); pass --text_column")


def _label_ids(raw: DatasetDict, column: str) -> tuple[list[str], dict[Any, int]]:
    if column not in raw["train"].column_names:
        raise ValueError(f"label_column {column!r} not in the data (columns: {raw['train'].column_names})")
    feature = raw["train"].features[column]
    names = getattr(feature, "names", None)
    if names:  # ClassLabel
        return list(names), {i: i for i in range(len(names))}
    values = set()
    for split in raw.values():
        values.update(split[column])
    as_int = {}
    for v in values:
        try:
            as_int[v] = int(v)
        except (TypeError, ValueError):
            as_int = None
            break
    if as_int is not None and sorted(set(as_int.values())) == list(range(len(set(as_int.values())))):
        n = len(set(as_int.values()))
        return [str(i) for i in range(n)], as_int
    ordered = sorted(values, key=str)
    return [str(v) for v in ordered], {v: i for i, v in enumerate(ordered)}


def _limit(ds: Dataset | None, n: int | None) -> Dataset | None:
    return ds.select(range(min(n, len(ds)))) if ds is not None and n is not None else ds


def prepare(args: DataArguments, tokenizer, main_process_first: ContextManager | None = None) -> PreparedData:
    """Load and tokenise. ``main_process_first``: e.g. ``accelerator.main_process_first()``."""
    from transformers import DataCollatorWithPadding, default_data_collator

    with main_process_first or nullcontext():
        raw = load_raw(args)
    text_col = text_column_of(raw["train"], args.text_column)
    if args.task == "classification":
        label_names, to_id = _label_ids(raw, args.label_column)
        padding = "max_length" if args.pad_to_max_length else False

        def encode(batch):
            enc = tokenizer(batch[text_col], truncation=True, max_length=args.max_seq_length, padding=padding)
            enc["labels"] = [to_id[v] for v in batch[args.label_column]]
            return enc

        out = {}
        for split, ds in raw.items():
            ds = _limit(ds, args.max_train_samples if split == "train" else args.max_eval_samples)
            out[split] = ds.map(encode, batched=True, remove_columns=ds.column_names, desc=f"tokenising {split}")
        collator = default_data_collator if args.pad_to_max_length else DataCollatorWithPadding(tokenizer)
        return PreparedData(out["train"], out.get("validation"), label_names, collator)

    block = args.max_seq_length

    def tokenize(batch):
        return tokenizer(batch[text_col], add_special_tokens=False)

    def group(batch):
        cat = {k: list(chain.from_iterable(batch[k])) for k in ("input_ids", "attention_mask")}
        total = (len(cat["input_ids"]) // block) * block
        res = {k: [v[i : i + block] for i in range(0, total, block)] for k, v in cat.items()}
        res["labels"] = [list(x) for x in res["input_ids"]]
        return res

    out = {}
    for split, ds in raw.items():
        tok = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc=f"tokenising {split}")
        blocks = tok.map(group, batched=True, batch_size=10_000, desc=f"grouping {split} into blocks of {block}")
        out[split] = _limit(blocks, args.max_train_samples if split == "train" else args.max_eval_samples)
        if len(out[split]) == 0:
            raise ValueError(f"{split} data has fewer than max_seq_length={block} tokens: no block to train on")
    logger.info("causal-lm blocks of %d tokens: %s", block, {k: len(v) for k, v in out.items()})
    return PreparedData(out["train"], out.get("validation"), None, default_data_collator)
