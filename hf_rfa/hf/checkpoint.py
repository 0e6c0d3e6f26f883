"""The RFA tensors of a converted checkpoint: found, verified, loaded — every one, finite, no other.

A converted model's ``rfa.*`` tensors (projections, learned feature-map parameters) are saved with
its weights. Loading them refuses a checkpoint that lacks one, holds one of another shape, holds
``.rfa.`` tensors the model does not have (its ``rfa_config`` was edited: another feature map,
other layers) or holds a non-finite one (ValueError naming it).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn


#: ``_keys_to_ignore_on_load_unexpected`` pattern of the saved RFA tensors (loaded by hf_rfa's load hook)
RFA_KEY_PATTERN = r"(^|\.)rfa\."


def report_unexpected_rfa_keys(model: nn.Module) -> None:
    """A model that attaches its RFA modules itself (the remote code) loads the RFA tensors with the
    weights: an RFA key it has no place for must be reported as unexpected, not ignored."""
    for module in model.modules():
        keys = getattr(module, "_keys_to_ignore_on_load_unexpected", None)
        if keys and RFA_KEY_PATTERN in keys:
            module._keys_to_ignore_on_load_unexpected = {k for k in keys if k != RFA_KEY_PATTERN}


def _is_rfa_key(key: str) -> bool:
    return ".rfa." in key or key.startswith("rfa.")


def _rfa_keys(state: dict) -> list[str]:
    return [k for k in state if _is_rfa_key(k)]


_INDEXES = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json", "pytorch_model.bin"))


def checkpoint_files(path: str) -> list[str]:
    """The weight files of the checkpoint in folder ``path``: those its index names (sharded), else
    its single ``model.safetensors`` / ``pytorch_model.bin`` — never other files that happen to lie
    in the folder (a stale copy of another model). ValueError when the index is unreadable or names
    a missing or non-local file, or when there are no weights."""
    for index, single in _INDEXES:
        ipath = os.path.join(path, index)
        if os.path.isfile(ipath):
            try:
                with open(ipath, encoding="utf-8") as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"checkpoint index {ipath} is unreadable: {e}") from None
            bad = [n for n in names if not isinstance(n, str) or os.path.basename(n) != n or n in ("", ".", "..")]
            missing = [n for n in names if n not in bad and not os.path.isfile(os.path.join(path, n))]
            if bad or missing:
                raise ValueError(f"checkpoint index {ipath} names {'non-local' if bad else 'missing'} files {(bad or missing)[:3]}")
            return names
        if os.path.isfile(os.path.join(path, single)):
            return [single]
    raise ValueError(f"{path} holds no model.safetensors / pytorch_model.bin (nor a sharded index)")


def verify_safetensors(path: str) -> None:
    """ValueError naming the file when a weight file of the checkpoint is truncated or corrupt
    (its header or its data length is wrong); checked before transformers reads them."""
    from safetensors import safe_open

    for f in checkpoint_files(path):
        if not f.endswith(".safetensors"):
            continue
        full = os.path.join(path, f)
        try:
            with open(full, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 0 < n <= 100_000_000 else None
            end = max((v["data_offsets"][1] for k, v in (header or {}).items() if k != "__metadata__"), default=0)
            if header is None or os.path.getsize(full) < 8 + n + end:
                raise ValueError(f"{os.path.getsize(full)} bytes, the header needs {8 + n + end}")
            with safe_open(full, framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - any failure: a broken file, named
            raise ValueError(f"weight file {full} is truncated or corrupt ({e})") from None


def _read_rfa_tensors(path: str) -> dict[str, torch.Tensor]:
    """The ``rfa.*`` tensors of the checkpoint's own weight files; ValueError for a non-finite one."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        full = os.path.join(path, f)
        if f.endswith(".safetensors"):
            with safe_open(full, framework="pt") as fh:
                found = {k: fh.get_tensor(k) for k in fh.keys() if _is_rfa_key(k)}
        else:
            sd = torch.load(full, map_location="cpu", weights_only=True)
            found = {k: sd[k] for k in _rfa_keys(sd)}
        for k, t in found.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"feature-map tensor {k} in {full} holds NaN/inf values: refusing to load it")
        out.update(found)
    return out


def _resolve_dir(name_or_path: str, **hub_kwargs) -> str:
    if os.path.isdir(name_or_path):
        return name_or_path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.bin"], **hub_kwargs)
    except (OSError, ValueError) as e:  # the Hub's message names no folder (offline) or speaks of repo ids (a path)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(f"{name_or_path!r} is not a local folder, and as a Hub id it could not be loaded: {reason}") from e


def load_rfa_state(model: nn.Module, path: str) -> None:
    """Load saved feature-map tensors into a converted model; ValueError if one is missing, of
    another shape, or saved without a place in the model (an edited ``rfa_config``)."""
    saved = _read_rfa_tensors(path)
    own = model.state_dict()
    wanted = _rfa_keys(own)
    prefix = getattr(model, "base_model_prefix", "")
    mapped, used = {}, set()
    for key in wanted:
        for cand in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")):
            if cand in saved:
                mapped[key] = saved[cand]
                used.add(cand)
                break
    missing = sorted(set(wanted) - set(mapped))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} RFA tensors, e.g. {missing[:3]} (its rfa_config does not match its weights)")
    extra = sorted(set(saved) - used)
    if extra:
        raise ValueError(f"checkpoint {path} holds {len(extra)} RFA tensors the model built from its rfa_config does not have, e.g. {extra[:3]} (rfa_config edited? feature_map / layers must be the ones it was saved with)")
    bad = [(k, tuple(t.shape), tuple(own[k].shape)) for k, t in mapped.items() if t.shape != own[k].shape]
    if bad:
        k, got, want = bad[0]
        raise ValueError(f"checkpoint {path}: RFA tensor {k} has shape {got}, the model built from its rfa_config needs {want} ({len(bad)} such tensor(s))")
    model.load_state_dict(mapped, strict=False)


def check_loaded_rfa(model: nn.Module, info: dict) -> None:
    """After ``from_pretrained`` of a model that attaches RFA in ``__init__`` (the remote code):
    ValueError when the checkpoint lacked an RFA tensor, had one of another shape or one the model
    has no place for, or when a loaded RFA tensor is not finite."""
    missing = sorted(k for k in info.get("missing_keys", ()) if _is_rfa_key(k))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} RFA tensors (they would be uninitialised), e.g. {missing[:3]}")
    extra = sorted(k for k in info.get("unexpected_keys", ()) if _is_rfa_key(k))
    if extra:
        raise ValueError(f"checkpoint holds {len(extra)} RFA tensors the model built from its rfa_config does not have, e.g. {extra[:3]} (rfa_config edited?)")
    mismatched = [m for m in info.get("mismatched_keys", ()) if _is_rfa_key(str(m[0] if isinstance(m, (tuple, list)) else m))]
    if mismatched:
        raise ValueError(f"checkpoint holds RFA tensors of another shape than its rfa_config builds, e.g. {mismatched[:3]}")
    for k, t in model.state_dict().items():
        if _is_rfa_key(k) and t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"feature-map tensor {k} of the checkpoint holds NaN/inf values: refusing to load it")
