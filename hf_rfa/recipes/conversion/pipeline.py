"""The conversion pipeline behind ``conversion/convert.py`` and the main job.

``run(ConversionConfig(...))``:

1. loads the checkpoint (Hub id, local folder, GGUF file, or an already converted folder);
2. evaluates the original (perplexity for causal LMs; for encoders the reference embeddings);
3. optionally evaluates baselines: pure random features and the untrained hybrid;
4. converts, measures per-layer attention-output error vs softmax on calibration text;
5. attention transfer (:func:`hf_rfa.recipes.conversion.transfer.attention_transfer`), error and quality again;
6. optional LoRA (:func:`hf_rfa.recipes.conversion.transfer.lora_finetune`, causal LMs), quality again;
7. exports Hub-ready (:func:`hf_rfa.export.export`, model card filled with the measured numbers)
   into a temporary folder next to ``output``, adds ``report.json``, ``layer_errors.md/png`` and
   ``RESULTS.md``, and renames it to ``output`` only at the end — a failed or interrupted run
   never leaves a folder that looks complete. ``push_to_hub`` then uploads it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ... import output_dir
from .. import evaluation, long_range
from . import calibration, transfer
from ...config import CONFIG_ATTR, RFAConfig
from ...hf.convert import convert
from .config import ConversionConfig

logger = logging.getLogger(__name__)

CAUSAL_LM, ENCODER, CLASSIFIER = "causal-lm", "encoder", "classifier"
TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------- loading
def kind_of(config) -> str:
    """``causal-lm``, ``classifier`` or ``encoder`` from a transformers config."""
    arch = " ".join(config.architectures or [])
    if "CausalLM" in arch or "LMHead" in arch:
        return CAUSAL_LM
    if "SequenceClassification" in arch:
        return CLASSIFIER
    if getattr(config, "is_decoder", False) or config.model_type in {"gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}:
        return CAUSAL_LM
    return ENCODER


def resolve_checkpoint(spec: str) -> str:
    """A loadable folder or Hub id for ``spec``; GGUF files are converted once into the asset cache."""
    if spec.endswith(".gguf"):
        from ... import assets

        if not os.path.isfile(spec):
            raise ValueError(f"model: GGUF file {spec!r} not found")
        out = assets.cache_dir() / "gguf" / f"{Path(spec).stem}-{_content_key(spec)}"  # keyed on content, not name
        if not (out / "config.json").is_file():
            assets.gguf_to_hf(spec, out, overwrite=True)
        return str(out)
    if not os.path.isdir(spec) and evaluation.looks_like_path(spec):
        raise ValueError(f"model: local folder {spec!r} not found (a Hub id looks like 'org/name')")
    return spec


def _content_key(path: str) -> str:
    """First 16 hex digits of the file's SHA-256."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Any, str]:
    """``(model, tokenizer, kind)``; a folder whose config has ``rfa_config`` loads converted."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from ...hf.convert import from_pretrained

    path = resolve_checkpoint(spec)
    cfg = AutoConfig.from_pretrained(path)
    kind = kind_of(cfg)
    cls = {CAUSAL_LM: transformers.AutoModelForCausalLM, CLASSIFIER: transformers.AutoModelForSequenceClassification, ENCODER: transformers.AutoModel}[kind]
    if getattr(cfg, CONFIG_ATTR, None):
        model = from_pretrained(path, dtype=dtype)
    else:
        model = cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok, kind


# --------------------------------------------------------------------------- helpers
class _Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60


def _tmp_dir(output: Path, overwrite: bool, inputs: tuple = ()) -> Path:
    """A staging folder next to ``output`` once ``output`` may be written: empty, or written by
    hf_rfa with --overwrite, and not containing any input (:func:`output_dir.check_target`)."""
    output_dir.check_target(output, overwrite, inputs, flag="--overwrite")
    return output_dir.staging_dir(output)


def _publish(tmp: Path, output: Path) -> None:
    output_dir.publish(tmp, output)  # old result aside, new one in, old one deleted


def _rows_markdown(rows: list[dict]) -> str:
    keys = [k for k in ("variant", "context", "perplexity", "cosine_mean", "cosine_min", "accuracy", "eval_tokens", "sentences", "train_tokens", "train_minutes") if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _generate(model: nn.Module, tok, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt")
    # a converted model gets hf_rfa's constant-memory cache from generate() itself (hf_rfa.hf.cache)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# --------------------------------------------------------------------------- the run
def run(cfg: ConversionConfig) -> dict:
    """Run one conversion; returns the report (also written to ``output/report.json``)."""
    torch.manual_seed(cfg.seed)
    report_plot = plotting_available()  # checked before any expensive stage
    output = Path(cfg.output).resolve()
    tmp = _tmp_dir(output, cfg.overwrite, (cfg.model, cfg.calibration_text, cfg.train_text, cfg.eval_text))
    try:
        report = _run(cfg, tmp, plot=report_plot)
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report["output"] = str(output)
    if cfg.push_to_hub:
        _push(cfg.push_to_hub, output, report)
    return report


def _push(repo_id: str, output: Path, report: dict) -> None:
    """Upload the (already Hub-ready) output folder; a failure is reported, never raised: the
    folder stays and ``report["push_error"]`` says how to upload it later."""
    from huggingface_hub import HfApi

    from ...hub.export import PushError

    try:
        api = HfApi()
        api.create_repo(repo_id, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(output), repo_type="model")
    except Exception as e:  # noqa: BLE001 - network / auth problems must not lose the printed results
        report["push_error"] = str(PushError(repo_id, output, e))
        logger.error("%s", report["push_error"])
        return
    logger.info("pushed %s to %s", output, repo_id)


def plotting_available() -> bool:
    """Whether matplotlib can draw ``layer_errors.png``; one warning when it cannot (the run goes on)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: layer_errors.png will be skipped (pip install matplotlib); the table is still written")
        return False
    return True


def _run(cfg: ConversionConfig, tmp: Path, plot: bool = True) -> dict:
    total = _Timer()
    model, tok, kind = load_model(cfg.model)
    report: dict[str, Any] = {"model": cfg.model, "kind": kind, "config": cfg.to_dict(), "rows": [], "stages": {}}
    if kind == CAUSAL_LM:
        model = _run_causal(cfg, model, tok, report)
    else:
        model = _run_encoder(cfg, model, tok, kind, report)
    errors = report.pop("_errors")
    metrics = report.pop("_metrics")
    from ...hub.export import export

    local = os.path.exists(cfg.model)
    export(
        model, tmp, base_model=cfg.base_model or (None if local else cfg.model), metrics=metrics, repo_id=cfg.push_to_hub,
        overwrite=True, tokenizer=tok, source_dir=cfg.model if os.path.isdir(cfg.model) else None,
    )
    if errors:
        (tmp / "layer_errors.md").write_text(calibration.error_table(errors) + "\n", encoding="utf-8")
        if plot:
            calibration.plot_errors(errors, str(tmp / "layer_errors.png"), title=f"{cfg.model}: attention-output error vs softmax")
        report["layer_errors"] = {k: [asdict(e) for e in v] for k, v in errors.items()}
    report["minutes_total"] = total.minutes()
    (tmp / "RESULTS.md").write_text(_rows_markdown(report["rows"]) + "\n", encoding="utf-8")
    (tmp / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return report


def _error_batches(cfg: ConversionConfig, ids: torch.Tensor) -> list:
    n = max(1, cfg.error_tokens // cfg.context)
    return [(w.unsqueeze(0), None) for w in evaluation.token_windows(ids, min(cfg.context, ids.numel()), n)]


def _evaluate_long_range(cfg: ConversionConfig, model: nn.Module, tok, ev: torch.Tensor, name: str, passkey: bool, report: dict) -> None:
    """Copy task at ``cfg.copy_gaps`` and (``passkey``) passkey retrieval, into ``report["long_range"]``."""
    if not cfg.copy_gaps and not (passkey and cfg.passkey_lengths):
        return
    entry: dict[str, Any] = {"variant": name, "copy": {}, "passkey": None}
    for gap in cfg.copy_gaps:
        r = long_range.copy_task(model, ev, gap=gap, draws=cfg.copy_draws, seed=cfg.seed, progress=cfg.progress)
        r.pop("per_draw")
        entry["copy"][str(gap)] = r
        logger.info("%s copy @gap %d: second copy %.2f (first %.2f)", name, gap, r["second"], r["first"])
    if passkey and cfg.passkey_lengths:
        entry["passkey"] = long_range.passkey_task(model, tok, cfg.passkey_lengths, trials=cfg.passkey_trials, seed=cfg.seed, progress=cfg.progress)
        logger.info("%s passkey: %s", name, entry["passkey"]["mean"])
    report.setdefault("long_range", []).append(entry)


def _window_only_baseline(cfg: ConversionConfig, model: nn.Module, lora_stream, evaluate, report: dict) -> str:
    """The strongest trivial baseline of a hybrid: the same window and sinks with every other key
    dropped (``feature_map="none"``), untrained and after its own LoRA with the same token budget
    (trained on a copy: ``model`` stays the original for the recipe). Returns the final row's name."""
    convert(model, RFAConfig(feature_map="none", window=cfg.rfa.window, sinks=cfg.rfa.sinks, seed=cfg.seed))
    label = f"window-only: window {cfg.rfa.window} + sinks {cfg.rfa.sinks}, no features"
    evaluate(f"{label}, untrained")
    if cfg.lora_tokens <= 0:
        return f"{label}, untrained"
    trained, res = transfer.lora_finetune(
        copy.deepcopy(model), lora_stream(), cfg.lora_tokens, lr=cfg.lora_lr, r=cfg.lora_r, progress=cfg.progress,
        max_seconds=None if cfg.lora_minutes is None else 60 * cfg.lora_minutes,
    )
    report["stages"]["lora (window-only)"] = res.as_dict()
    evaluate(f"{label}, after LoRA", res.as_dict(), of=trained, passkey=True)
    return f"{label}, after LoRA"


def _run_causal(cfg: ConversionConfig, model: nn.Module, tok, report: dict) -> nn.Module:
    if cfg.calibration_text is None or cfg.eval_text is None:
        raise ValueError("calibration_text and eval_text are required for causal LMs")
    cal = evaluation.tokenize(tok, evaluation.load_text(cfg.calibration_text))
    train = evaluation.tokenize(tok, evaluation.load_text(cfg.train_text)) if cfg.train_text else cal
    ev = evaluation.tokenize(tok, evaluation.load_text(cfg.eval_text))
    report["text_tokens"] = {"calibration": cal.numel(), "train": train.numel(), "eval": ev.numel()}
    rows = report["rows"]
    metrics: dict[str, dict] = {}

    def evaluate(name: str, stage: dict | None = None, of: nn.Module | None = None, passkey: bool = False) -> None:
        m = model if of is None else of
        _evaluate_long_range(cfg, m, tok, ev, name, passkey, report)
        for ctx in cfg.eval_contexts:
            twin = ctx <= cfg.eval_twin_max and getattr(m.config, CONFIG_ATTR, None) is not None
            transfer.register_train()
            with calibration.attn_implementation(m, transfer.TRAIN_NAME) if twin else nullcontext():
                r = evaluation.perplexity(m, ev, ctx, cfg.eval_tokens, progress=cfg.progress, desc=name)
            row = {"variant": name, "context": ctx, "perplexity": r["perplexity"], "eval_tokens": r["tokens"], "op": "quadratic twin" if twin else "chunked op"}
            if stage:
                row.update({"train_tokens": stage["tokens"], "train_minutes": stage["minutes"]})
            rows.append(row)
            logger.info("%s @%d: perplexity %.2f (%d tokens)", name, ctx, r["perplexity"], r["tokens"])

    evaluate("original (softmax)", passkey=True)
    target = cfg.rfa_config()
    errors: dict[str, list] = {}
    err_batches = _error_batches(cfg, cal)
    if cfg.baselines:
        rnd = RFAConfig(feature_map=cfg.random_feature_map, num_features=cfg.random_num_features, seed=cfg.seed)
        convert(model, rnd)
        evaluate(f"{rnd.feature_map} m={rnd.num_features}, pure, untrained")
        errors[f"{rnd.feature_map} pure"] = calibration.layer_errors(model, err_batches, progress=cfg.progress)
        if (cfg.rfa.window or cfg.rfa.sinks) and cfg.random_hybrid:
            convert(model, RFAConfig.from_dict({**rnd.to_dict(), "window": cfg.rfa.window, "sinks": cfg.rfa.sinks}))
            evaluate(f"{rnd.feature_map} m={rnd.num_features} + window {cfg.rfa.window} + sinks {cfg.rfa.sinks}, untrained")
    lora_stream = lambda: evaluation.shuffled_batches(train, cfg.lora_context or cfg.context, cfg.batch_size, cfg.seed + 7)  # noqa: E731
    if cfg.rfa.window_only_baseline and (cfg.rfa.window or cfg.rfa.sinks) and target.feature_map != "none":
        baseline = _window_only_baseline(cfg, model, lora_stream, evaluate, report)
    else:
        baseline = None
    convert(model, target)
    label = f"{target.feature_map} m={target.num_features}" + (f" + window {cfg.rfa.window} + sinks {cfg.rfa.sinks}" if cfg.rfa.window or cfg.rfa.sinks else ", pure")
    trainable = bool(transfer.rfa_parameters(model))
    stream = evaluation.shuffled_batches(train, cfg.context, cfg.batch_size, cfg.seed)
    if trainable and getattr(next(iter(calibration.rfa_layers(model).values())).feature_map, "hybrid_mix", False):
        transfer.init_mixing(model, calibration.capture(model, *next(evaluation.shuffled_batches(train, cfg.context, 1, cfg.seed + 1))))
    errors[f"{label}, untrained"] = calibration.layer_errors(model, err_batches, progress=cfg.progress)
    evaluate(f"{label}, untrained")
    final = f"{label}, untrained"
    if trainable and cfg.transfer_tokens > 0:
        res = transfer.attention_transfer(
            model, stream, cfg.transfer_tokens, lr=cfg.transfer_lr, init_mix=False, progress=cfg.progress, queries=cfg.transfer_queries,
            max_seconds=None if cfg.transfer_minutes is None else 60 * cfg.transfer_minutes,
        )
        report["stages"]["transfer"] = res.as_dict()
        errors[f"{label}, after transfer"] = calibration.layer_errors(model, err_batches, progress=cfg.progress)
        final = f"{label}, after attention transfer"
        evaluate(final, res.as_dict())
    if cfg.lora_tokens > 0:
        model, res = transfer.lora_finetune(
            model, lora_stream(), cfg.lora_tokens, lr=cfg.lora_lr, r=cfg.lora_r, progress=cfg.progress,
            max_seconds=None if cfg.lora_minutes is None else 60 * cfg.lora_minutes,
        )
        stage = res.as_dict()
        if "transfer" in report["stages"]:
            t = report["stages"]["transfer"]
            stage = {**stage, "tokens": stage["tokens"] + t["tokens"], "minutes": stage["minutes"] + t["minutes"]}
        report["stages"]["lora"] = res.as_dict()
        final = f"{label}, after transfer + LoRA" if "transfer" in report["stages"] else f"{label}, after LoRA"
        evaluate(final, stage, passkey=True)
    report["final_variant"] = final
    orig = {r["context"]: r for r in rows if r["variant"] == "original (softmax)"}
    for r in rows:
        if r["variant"] == final:
            metrics[f"perplexity @{r['context']} ({r['eval_tokens']} held-out tokens)"] = {
                "converted": r["perplexity"], "original": orig[r["context"]]["perplexity"], "ratio": r["perplexity"] / orig[r["context"]]["perplexity"],
            }
            if baseline is not None:  # the window-only row with the same training budget, next to the features
                b = next((x for x in rows if x["variant"] == baseline and x["context"] == r["context"]), None)
                if b is not None:
                    metrics[f"perplexity @{r['context']} ({r['eval_tokens']} held-out tokens)"]["window_only"] = b["perplexity"]
    if cfg.generate_prompt and cfg.generate_tokens:
        report["generation"] = {"prompt": cfg.generate_prompt, "text": _generate(model, tok, cfg.generate_prompt, cfg.generate_tokens)}
    report["_errors"], report["_metrics"] = errors, metrics
    return model


def _run_encoder(cfg: ConversionConfig, model: nn.Module, tok, kind: str, report: dict) -> nn.Module:
    if cfg.calibration_text is None or cfg.eval_text is None:
        raise ValueError("calibration_text and eval_text are required for encoders")
    cal_texts, _ = evaluation.load_labelled(cfg.calibration_text)
    train_texts = evaluation.load_labelled(cfg.train_text)[0] if cfg.train_text else cal_texts
    ev_texts, ev_labels = evaluation.load_labelled(cfg.eval_text)
    ev_texts = ev_texts[: cfg.eval_sentences]
    ev_labels = ev_labels[: cfg.eval_sentences] if ev_labels else None
    rows = report["rows"]
    ref = evaluation.sentence_embeddings(model, tok, ev_texts, progress=cfg.progress)

    def evaluate(name: str, stage: dict | None = None) -> None:
        row = {"variant": name}
        row.update(evaluation.embedding_cosine(ref, evaluation.sentence_embeddings(model, tok, ev_texts, progress=cfg.progress)))
        if kind == CLASSIFIER and ev_labels is not None:
            row["accuracy"] = evaluation.accuracy(model, tok, ev_texts, ev_labels, progress=cfg.progress)["accuracy"]
        if stage:
            row.update({"train_tokens": stage["tokens"], "train_minutes": stage["minutes"]})
        rows.append(row)
        logger.info("%s: %s", name, row)

    base_row = {"variant": "original (softmax)", "cosine_mean": 1.0, "cosine_min": 1.0, "sentences": len(ev_texts)}
    if kind == CLASSIFIER and ev_labels is not None:
        base_row["accuracy"] = evaluation.accuracy(model, tok, ev_texts, ev_labels, progress=cfg.progress)["accuracy"]
    rows.append(base_row)
    err_batches = list(evaluation.sentence_batches(tok, cal_texts[:64], 16))
    errors: dict[str, list] = {}
    if cfg.baselines:
        rnd = RFAConfig(feature_map=cfg.random_feature_map, num_features=cfg.random_num_features, seed=cfg.seed)
        convert(model, rnd)
        evaluate(f"{rnd.feature_map} m={rnd.num_features}, pure, untrained")
        errors[f"{rnd.feature_map} pure"] = calibration.layer_errors(model, err_batches, progress=cfg.progress)
    target = cfg.rfa_config()
    convert(model, target)
    label = f"{target.feature_map} m={target.num_features}" + (f" + window {cfg.rfa.window} + sinks {cfg.rfa.sinks}" if cfg.rfa.window or cfg.rfa.sinks else ", pure")

    def stream():
        g = torch.Generator().manual_seed(cfg.seed)
        while True:
            order = torch.randperm(len(train_texts), generator=g).tolist()
            texts = [train_texts[i] for i in order]
            yield from evaluation.sentence_batches(tok, texts, 16)

    trainable = bool(transfer.rfa_parameters(model))
    if trainable and getattr(next(iter(calibration.rfa_layers(model).values())).feature_map, "hybrid_mix", False):
        transfer.init_mixing(model, calibration.capture(model, *next(stream())))
    errors[f"{label}, untrained"] = calibration.layer_errors(model, err_batches, progress=cfg.progress)
    evaluate(f"{label}, untrained")
    final = f"{label}, untrained"
    if trainable and cfg.transfer_tokens > 0:
        res = transfer.attention_transfer(
            model, stream(), cfg.transfer_tokens, lr=cfg.transfer_lr, init_mix=False, progress=cfg.progress,
            max_seconds=None if cfg.transfer_minutes is None else 60 * cfg.transfer_minutes,
        )
        report["stages"]["transfer"] = res.as_dict()
        errors[f"{label}, after transfer"] = calibration.layer_errors(model, err_batches, progress=cfg.progress)
        final = f"{label}, after attention transfer"
        evaluate(final, res.as_dict())
    report["final_variant"] = final
    last = [r for r in rows if r["variant"] == final][-1]
    metrics = {f"embedding cosine to original ({last['sentences']} held-out sentences)": {"mean": last["cosine_mean"], "min": last["cosine_min"]}}
    if "accuracy" in last:
        metrics["accuracy"] = {"converted": last["accuracy"], "original": base_row["accuracy"]}
    report["_errors"], report["_metrics"] = errors, metrics
    return model


__all__ = ["CAUSAL_LM", "CLASSIFIER", "ENCODER", "ConversionConfig", "kind_of", "load_model", "resolve_checkpoint", "run"]
