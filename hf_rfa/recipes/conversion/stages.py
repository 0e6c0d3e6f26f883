"""The conversion workflow as ordered lists of small stages over one :class:`~.state.State`.

:data:`STAGES` gives the list per model kind; :func:`run_stages` runs it. Read a list top to
bottom to follow a run: each stage calls down into :mod:`.calibration`, :mod:`.transfer`,
:mod:`hf_rfa.recipes.evaluation` and :func:`hf_rfa.convert`, never back up.

causal LM:  texts → original → random baselines → window-only baseline → convert → init mixing →
            untrained errors → attention transfer → LoRA → metrics → generation sample
encoder:    sentences → original → random baselines → window-only baseline → convert → init mixing →
            untrained errors → attention transfer → metrics
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .. import evaluation
from ..intervals import paired_ratio_ci
from . import calibration, devices, layerwise, memory_split, transfer
from .lora import target_weights
from ...config import RFAConfig
from ...hf.convert import convert
from ...hf.rope import clamp_memory_distance
from .loading import CAUSAL_LM, CLASSIFIER, ENCODER
from .host_memory import measure_peak_rss, release_free_memory
from .state import State, classifier_scores, evaluate

logger = logging.getLogger(__name__)

ORIGINAL = "original (softmax)"


def _max_seconds(minutes: float | None) -> float | None:
    return None if minutes is None else 60 * minutes


# --------------------------------------------------------------------------- inputs and the original
def _autocast(s: State):
    """The training stages' autocast dtype (the weights' dtype when it is low precision, else
    ``cfg.train_autocast`` on the model's device; None: fp32), :func:`.devices.training_autocast`."""
    return devices.training_autocast(s.cfg.train_autocast, devices.input_device(s.model), devices.weight_dtype(s.model))


def load_texts(s: State) -> None:
    """Causal: tokenised calibration / train / eval text, calibration windows of the error table."""
    cfg = s.cfg
    if cfg.calibration_text is None or cfg.eval_text is None:
        raise ValueError("calibration_text and eval_text are required for causal LMs")
    cal = evaluation.tokenize(s.tok, evaluation.load_text(cfg.calibration_text))
    train = evaluation.tokenize(s.tok, evaluation.load_text(cfg.train_text)) if cfg.train_text else cal
    s.ids = {"calibration": cal, "train": train, "eval": evaluation.tokenize(s.tok, evaluation.load_text(cfg.eval_text))}
    s.report["text_tokens"] = {k: v.numel() for k, v in s.ids.items()}
    n = max(1, cfg.error_tokens // cfg.context)
    s.error_batches = [(w.unsqueeze(0), None) for w in evaluation.token_windows(cal, min(cfg.context, cal.numel()), n)]
    s.train_stream = lambda: evaluation.shuffled_batches(train, cfg.context, cfg.batch_size, cfg.seed)


def load_sentences(s: State) -> None:
    """Encoders: calibration / train / eval sentences (eval labels), error batches, training stream."""
    cfg = s.cfg
    if cfg.calibration_text is None or cfg.eval_text is None:
        raise ValueError("calibration_text and eval_text are required for encoders")
    cal, _ = evaluation.load_labelled(cfg.calibration_text)
    train = evaluation.load_labelled(cfg.train_text)[0] if cfg.train_text else cal
    ev, labels = evaluation.load_labelled(cfg.eval_text)
    limit = getattr(s.model.config, "max_position_embeddings", None)
    if limit is not None and cfg.encoder_max_length > limit:
        raise ValueError(f"encoder_max_length must be at most the model's max_position_embeddings ({limit}), got {cfg.encoder_max_length}")
    if cfg.encoder_pack_tokens:
        if s.kind == CLASSIFIER and labels is not None:
            raise ValueError("encoder_pack_tokens must be 0 for a classifier with labelled evaluation texts (packed passages have no label)")
        cal, train, ev = (evaluation.pack_texts(s.tok, x, cfg.encoder_pack_tokens) for x in (cal, train, ev))
        labels = None
        for name, x in (("calibration_text", cal), ("train_text", train), ("eval_text", ev)):
            if not x:
                raise ValueError(f"{name} has fewer than encoder_pack_tokens={cfg.encoder_pack_tokens} tokens: no passage to evaluate")
    s.texts = {"train": train, "eval": ev[: cfg.eval_sentences], "labels": labels[: cfg.eval_sentences] if labels else None}
    s.error_batches = list(evaluation.sentence_batches(s.tok, cal[:64], 16, cfg.encoder_max_length))

    def stream():
        g = torch.Generator().manual_seed(cfg.seed)
        while True:
            order = torch.randperm(len(train), generator=g).tolist()
            yield from evaluation.sentence_batches(s.tok, [train[i] for i in order], 16, cfg.encoder_max_length)

    s.train_stream = stream


def evaluate_original(s: State) -> None:
    """Causal: the original's perplexity and long-range rows (with passkey)."""
    evaluate(s, ORIGINAL, passkey=True)


def embed_original(s: State) -> None:
    """Encoders: the original's embeddings are the reference (cosine 1), its accuracy the baseline."""
    t = s.texts
    n = s.cfg.encoder_max_length
    t["reference"] = evaluation.sentence_embeddings(s.model, s.tok, t["eval"], max_length=n, progress=s.cfg.progress)
    row = {"variant": ORIGINAL, "cosine_mean": 1.0, "cosine_min": 1.0, "sentences": len(t["eval"])}
    if s.kind == CLASSIFIER and t["labels"] is not None:
        row.update(classifier_scores(evaluation.accuracy(s.model, s.tok, t["eval"], t["labels"], max_length=n, progress=s.cfg.progress, metrics=s.cfg.metric)))
    s.rows.append(row)


# --------------------------------------------------------------------------- baselines
def random_baselines(s: State) -> None:
    """Untrained random features (``random_feature_map``), pure; for causal hybrids also with the
    same window and sinks (``random_hybrid``)."""
    cfg = s.cfg
    if not cfg.baselines:
        return
    rnd = RFAConfig(feature_map=cfg.random_feature_map, num_features=cfg.random_num_features, seed=cfg.seed)
    convert(s.model, rnd)
    evaluate(s, f"{rnd.feature_map} m={rnd.num_features}, pure, untrained")
    s.layer_errors(f"{rnd.feature_map} pure")
    window, sinks = cfg.rfa.window, cfg.rfa.sinks
    if s.kind == CAUSAL_LM and (window or sinks) and cfg.random_hybrid:
        convert(s.model, RFAConfig.from_dict({**rnd.to_dict(), "window": window, "sinks": sinks}))
        evaluate(s, f"{rnd.feature_map} m={rnd.num_features} + window {window} + sinks {sinks}, untrained")


def _lora_stream(s: State):
    cfg = s.cfg
    return evaluation.shuffled_batches(s.ids["train"], cfg.lora_context or cfg.context, cfg.batch_size, cfg.seed + 7)


def window_only_baseline(s: State) -> None:
    """Hybrids: the same window and sinks with every other key dropped (``feature_map="none"``),
    untrained and, for causal LMs, after its own LoRA with the same token budget (trained on a
    copy). Encoders have no LoRA stage and the window-only model nothing for attention transfer to
    fit: its untrained row is the baseline at the same budget."""
    cfg = s.cfg
    window, sinks = cfg.rfa.window, cfg.rfa.sinks
    if not (cfg.evaluates_window_only and (window or sinks) and cfg.rfa.feature_map != "none"):
        return
    memory = cfg.rfa.memory  # the baseline keeps any exact memory of the recipe
    convert(s.model, RFAConfig(feature_map="none", window=window, sinks=sinks, seed=cfg.seed, memory=memory, memory_every=cfg.rfa.memory_every))
    label = f"window-only: window {window} + sinks {sinks}" + (f" + memory {memory}" if memory else "") + ", no features"
    evaluate(s, f"{label}, untrained")
    s.baseline = f"{label}, untrained"
    if s.kind != CAUSAL_LM:  # encoders: more windows (e.g. the one costing what window + features cost), untrained
        for w in cfg.baseline_windows:
            if w != window:
                convert(s.model, RFAConfig(feature_map="none", window=w, sinks=sinks, seed=cfg.seed))
                evaluate(s, f"window-only: window {w} + sinks {sinks}, no features, untrained")
        return
    if cfg.lora_tokens <= 0:
        return
    res = _baseline_lora(s)
    s.stages["lora (window-only)"] = res.as_dict()
    s.baseline = f"{label}, after LoRA"
    evaluate(s, s.baseline, res.as_dict(), passkey=True)
    if cfg.memory_after_training:  # the same exact memory, switched on after the same LoRA (no features: ranked by ||v||)
        memory_split.switch_on_memory(s, "value_norm")  # the recipe's per-layer sizes (memory_split): the same decode state
        s.baseline = f"window-only: window {window} + sinks {sinks} + {memory_split.memory_label(s, 'value_norm')}, no features, after LoRA"
        evaluate(s, s.baseline, res.as_dict(), passkey=True)
    s.restore()
    for w in cfg.baseline_windows:  # e.g. the equal-decode-state window: trained rows only (causal)
        if w == window:
            continue
        convert(s.model, RFAConfig(feature_map="none", window=w, sinks=sinks, seed=cfg.seed, memory=memory, memory_every=cfg.rfa.memory_every))
        res = _baseline_lora(s)
        s.stages[f"lora (window-only {w})"] = res.as_dict()
        evaluate(s, f"window-only: window {w} + sinks {sinks}" + (f" + memory {memory}" if memory else "") + ", no features, after LoRA", res.as_dict(), passkey=True)
        s.restore()


def _baseline_lora(s: State):
    """A baseline's LoRA, trained and merged into the model itself: the weights it changes are
    copied first (:func:`.lora.target_weights`) and :meth:`State.restore` puts them back, so the
    recipe trains from the same weights without a second copy of the model in memory."""
    cfg = s.cfg
    s.saved = target_weights(s.model)
    trained, res = transfer.lora_finetune(
        s.model, _lora_stream(s), cfg.lora_tokens, lr=cfg.lora_lr, r=cfg.lora_r, progress=cfg.progress,
        max_seconds=_max_seconds(cfg.lora_minutes), autocast=_autocast(s), activation_checkpointing=cfg.activation_checkpointing,
        objective=cfg.lora_objective,
    )
    s.model = trained  # the same module tree, its target weights merged
    return res


# --------------------------------------------------------------------------- the converted model
def convert_target(s: State) -> None:
    """Convert to the run's config (``ConversionConfig.rfa_config()``)."""
    s.target = s.cfg.rfa_config()
    convert(s.model, s.target)
    devices.keep_trainable_float32(s.model)  # mixed precision: low-precision frozen weights, float32 maps
    window, sinks = s.target.window, s.target.sinks
    if s.target.feature_map == "none":  # no features: num_features means nothing
        s.label = f"window-only: window {window} + sinks {sinks}, no features"
    else:
        s.label = f"{s.target.feature_map} m={s.target.num_features}" + (f" + window {window} + sinks {sinks}" if window or sinks else ", pure")
    if s.target.memory:
        s.label += f" + memory {s.target.memory}"
    if s.target.decay:
        s.label += f" + decay {s.target.decay:g}"
    if s.target.feature_input == "unrotated":
        s.label += ", un-rotated q/k"


def _trainable(s: State) -> bool:
    return bool(transfer.rfa_parameters(s.model))


def init_mixing(s: State) -> None:
    """Hybrid-mix maps: set each head's feature/exact weight from one captured batch."""
    if _trainable(s) and getattr(next(iter(calibration.rfa_layers(s.model).values())).feature_map, "hybrid_mix", False):
        transfer.init_mixing(s.model, calibration.capture(s.model, *_mixing_batch(s)))


def _mixing_batch(s: State):
    if s.kind == CAUSAL_LM:
        return next(evaluation.shuffled_batches(s.ids["train"], s.cfg.context, 1, s.cfg.seed + 1))
    return next(s.train_stream())


def evaluate_untrained(s: State) -> None:
    """Per-layer errors and quality of the converted, untrained model (a learned map that attention
    transfer will train: only with ``evaluate_before_transfer``)."""
    s.layer_errors(f"{s.label}, untrained")
    s.final = f"{s.label}, untrained"
    if s.cfg.evaluate_before_transfer or not (_trainable(s) and s.cfg.transfer_tokens > 0):
        evaluate(s, s.final)


def train_transfer(s: State) -> dict | None:
    """Attention transfer of the learned maps (or learnable projections), nothing evaluated; its
    stage record (None: nothing to train). Shared by :func:`attention_transfer` and :func:`hf_rfa.linearize`."""
    cfg = s.cfg
    if not (_trainable(s) and cfg.transfer_tokens > 0):
        return None
    kwargs = dict(
        lr=cfg.transfer_lr, init_mix=False, progress=cfg.progress, queries=cfg.transfer_queries if s.kind == CAUSAL_LM else None,
        max_seconds=_max_seconds(cfg.transfer_minutes), autocast=_autocast(s), schedule=cfg.transfer_schedule,
        query_blocks=cfg.transfer_query_blocks if s.kind == CAUSAL_LM else 1,
    )
    if cfg.transfer_layerwise:  # one layer's captures at a time (:mod:`.layerwise`)
        res = layerwise.attention_transfer_layerwise(s.model, s.train_stream, cfg.transfer_tokens, **kwargs)
    else:
        res = transfer.attention_transfer(s.model, s.train_stream(), cfg.transfer_tokens, **kwargs)
    s.stages["transfer"] = res.as_dict()
    return s.stages["transfer"]


def attention_transfer(s: State) -> None:
    """Learned maps (or learnable projections): fit each layer's attention outputs to softmax's."""
    stage = train_transfer(s)
    if stage is None:
        return
    s.layer_errors(f"{s.label}, after transfer")
    s.final = f"{s.label}, after attention transfer"
    evaluate(s, s.final, stage)


def train_lora(s: State) -> dict | None:
    """Causal LMs: LoRA on the converted model (merged back), nothing evaluated; its stage record
    (None: no LoRA budget). Shared by :func:`lora` and :func:`hf_rfa.linearize`."""
    cfg = s.cfg
    if cfg.lora_tokens <= 0 or s.kind != CAUSAL_LM:
        return None
    s.model, res = transfer.lora_finetune(
        s.model, _lora_stream(s), cfg.lora_tokens, lr=cfg.lora_lr, r=cfg.lora_r, progress=cfg.progress,
        max_seconds=_max_seconds(cfg.lora_minutes), autocast=_autocast(s), activation_checkpointing=cfg.activation_checkpointing,
        objective=cfg.lora_objective,
    )
    s.stages["lora"] = res.as_dict()
    return s.stages["lora"]


def add_memory(s: State) -> bool:
    """Causal LMs with ``memory_after_training``: switch the exact memory on (it has no parameters)."""
    if not (s.cfg.memory_after_training and s.kind == CAUSAL_LM):
        return False
    memory_split.switch_on_memory(s, s.cfg.rfa.memory_score)
    clamp_memory_distance(s.model)  # read past its trained positions, memory keys count as the farthest trained distance
    return True


def lora(s: State) -> None:
    """Causal LMs: LoRA (its row counts transfer's budget too), then the exact memory after training."""
    stage = train_lora(s)
    if stage is not None:
        if "transfer" in s.stages:
            t = s.stages["transfer"]
            stage = {**stage, "tokens": stage["tokens"] + t["tokens"], "minutes": stage["minutes"] + t["minutes"]}
        s.final = f"{s.label}, after transfer + LoRA" if "transfer" in s.stages else f"{s.label}, after LoRA"
        evaluate(s, s.final, stage, passkey=True)
    if add_memory(s):  # published with the exact memory
        s.final = f"{s.final} + {memory_split.memory_label(s, s.cfg.rfa.memory_score)}"
        evaluate(s, s.final, stage or s.stages.get("transfer"), passkey=True)


# --------------------------------------------------------------------------- results
def causal_metrics(s: State) -> None:
    """Model-card metrics: the final variant's perplexity against the original's (and window-only's)."""
    s.report["final_variant"] = s.final
    s.report["baseline_variant"] = s.baseline
    orig = {r["context"]: r for r in s.rows if r["variant"] == ORIGINAL}
    for r in s.rows:
        if r["variant"] != s.final:
            continue
        o = orig[r["context"]]
        entry = {"converted": _ci(r["perplexity"], r.get("perplexity_ci95")), "original": _ci(o["perplexity"], o.get("perplexity_ci95")),
                 "ratio": _ci(r["perplexity"] / o["perplexity"], paired_ratio_ci(r, o, s.cfg.seed))}
        # the window-only row with the same training budget, next to the features
        b = next((x for x in s.rows if x["variant"] == s.baseline and x["context"] == r["context"]), None) if s.baseline else None
        if b is not None:
            entry["window_only"] = _ci(b["perplexity"], b.get("perplexity_ci95"))
        s.metrics[f"perplexity @{r['context']} ({r['eval_tokens']} held-out tokens, {r.get('windows', 1)} windows)"] = entry
    _long_range_metrics(s)


def _ci(value: float, ci95: list[float] | None) -> dict:
    """A model-card figure with its 95% interval (:func:`hf_rfa.hub.model_card.is_interval`)."""
    return {"value": value, "ci95": ci95}


def _long_range_metrics(s: State) -> None:
    """Model-card metrics of the long-range tasks: the final variant's copy and passkey figures next
    to the original's and the window-only baseline's (where measured), with their intervals."""
    lr = {e["variant"]: e for e in s.report.get("long_range", [])}
    final = lr.get(s.final)
    if final is None:
        return
    cols = [("converted", final), ("original", lr.get(ORIGINAL)), ("window_only", lr.get(s.baseline) if s.baseline else None)]
    for gap, c in final["copy"].items():
        entry = {k: _ci(e["copy"][gap]["second"], e["copy"][gap].get("second_ci95")) for k, e in cols if e and gap in e["copy"]}
        s.metrics[f"copy @gap {gap} (second-copy perplexity, {c['draws']} draws)"] = entry
    pk = final.get("passkey")
    for n in (pk or {}).get("mean", {}):
        entry = {k: _ci(e["passkey"]["mean"][n], (e["passkey"].get("mean_ci95") or {}).get(n)) for k, e in cols
                 if e and e.get("passkey") and n in e["passkey"]["mean"]}
        s.metrics[f"passkey @{n} (exact match, {pk['trials']} trials x {len(pk['depths'])} depths)"] = entry


def encoder_metrics(s: State) -> None:
    """Model-card metrics: the final variant's embedding cosine (and accuracy against the original's)."""
    s.report["final_variant"] = s.final
    s.report["baseline_variant"] = s.baseline
    last = [r for r in s.rows if r["variant"] == s.final][-1]
    base = next((r for r in s.rows if r["variant"] == s.baseline), None) if s.baseline else None
    entry = {"mean": last["cosine_mean"], "min": last["cosine_min"]}
    if base is not None:  # the window-only row with the same training budget, next to the features
        entry["window_only_mean"] = base["cosine_mean"]
    s.metrics[f"embedding cosine to original ({last['sentences']} held-out texts, {s.cfg.encoder_max_length} tokens at most)"] = entry
    for name in [k for k in last if k not in ("variant", "cosine_mean", "cosine_min", "sentences")]:  # accuracy and the --metric ones
        if not isinstance(last[name], float) or name not in s.rows[0]:
            continue
        entry = {"converted": last[name], "original": s.rows[0][name]}
        if base is not None and name in base:
            entry["window_only"] = base[name]
        s.metrics[name] = entry


def generation_sample(s: State) -> None:
    """Causal LMs: a greedy sample of the final model (decoded with hf_rfa's constant-memory cache)."""
    cfg = s.cfg
    if not (cfg.generate_prompt and cfg.generate_tokens):
        return
    ids = s.tok(cfg.generate_prompt, return_tensors="pt").to(devices.input_device(s.model))
    with torch.no_grad():
        out = s.model.generate(**ids, max_new_tokens=cfg.generate_tokens, do_sample=False, pad_token_id=s.tok.pad_token_id)
    s.report["generation"] = {"prompt": cfg.generate_prompt, "text": s.tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)}


Stage = Callable[[State], None]
_ENCODER: list[Stage] = [load_sentences, embed_original, random_baselines, window_only_baseline, convert_target, init_mixing, evaluate_untrained, attention_transfer, encoder_metrics]
#: the stages of a run, in order, per model kind
STAGES: dict[str, list[Stage]] = {
    CAUSAL_LM: [
        load_texts, evaluate_original, memory_split.measure_split, random_baselines, window_only_baseline, convert_target, init_mixing,
        evaluate_untrained, attention_transfer, lora, causal_metrics, generation_sample,
    ],
    ENCODER: _ENCODER,
    CLASSIFIER: _ENCODER,
}


def run_stages(s: State) -> State:
    """Run ``STAGES[s.kind]`` in order over ``s``; each stage's peak resident memory (on Linux, sampled) goes
    into ``report["memory"]["peak_rss_bytes"]`` under the stage's name (the measured side of the
    memory plan, ``--dry-run``). Before each stage the C heap's free pages go back to the system
    (:func:`.host_memory.release_free_memory`)."""
    peaks = s.report.setdefault("memory", {}).setdefault("peak_rss_bytes", {})
    for stage in STAGES[s.kind]:
        logger.debug("stage %s", stage.__name__)
        release_free_memory()  # what the last stage freed leaves the resident set (host_memory)
        with measure_peak_rss() as peak:
            stage(s)
        if peak[0] is not None:
            peaks[stage.__name__] = peak[0]
            logger.debug("stage %s: peak RSS %.2f GiB", stage.__name__, peak[0] / 2**30)
    return s


__all__ = ["STAGES", "Stage", "run_stages"]
