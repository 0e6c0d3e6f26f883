"""The next-token loss of a causal LM without its full logits in memory.

transformers' causal LMs compute the logits of every position (``[B, N, vocab]``), copy them to
float32 and take their log-softmax for the loss; with the graph kept for the backward that is
several float32 copies of ``B·N·vocab`` (SmolLM2's 49k vocabulary at a 4,096-token LoRA context:
0.8 GiB each; Llama 3's 128k: 2.1 GiB each), the largest activation of a LoRA step. Here the
decoder's hidden states go through the output head and the cross-entropy ``chunk`` positions at a
time (:func:`loss_chunk`: 96 MiB of float32 logits), each chunk under activation checkpointing, so only one chunk's logits exist at once, in the
forward and again in the backward: the same loss and the same gradients (the mean over the
predicted tokens, as ``ForCausalLMLoss``), a little more compute (the head runs twice).

:func:`distill_loss` is the same for distillation: the Kullback-Leibler divergence from a
teacher's next-token distribution (given by its final hidden states, through the same head) at every
predicted position, again one chunk of both models' logits at a time.

The conversion's LoRA stage calls :func:`causal_lm_loss` (or :func:`distill_loss`); ``hf-rfa-finetune`` and ``hf-rfa-train``
train through :func:`chunked_training_loss`, which gives the model's own forward this loss while
training (``--chunked_loss``).

Only for architectures whose forward is exactly ``decoder → lm_head → ForCausalLMLoss``
(:data:`PLAIN_HEADS`); anything else (logit soft-capping, scaled logits, a custom loss) keeps the
model's own loss. Under FSDP the LoRA stage calls it as a registered forward method of the sharded
root unit (:func:`.fsdp.forward_method`), so the root's own tensors — embeddings, final norm, output
head — are gathered around it as around the model's forward.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

#: causal LMs whose forward is ``lm_head(decoder(...).last_hidden_state)`` and the stock loss
PLAIN_HEADS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPT2LMHeadModel"})
#: bytes of float32 logits per chunk of the output head and the loss: 512 positions of one sequence
#: for SmolLM2's 49k vocabulary, 196 for Llama 3's 128k. Smaller chunks hold less but cost time:
#: SmolLM2's LoRA step at 4,096 tokens (activation checkpointing, one thread, bf16 AMX) took 72 /
#: 77 / 84 / 106 s for 512 / 341 / 170 / 85 positions and peaked at 1.84 / 1.79 / 1.70 / 1.66 GiB
#: (``benchmarks/lora_stage_memory.py``).
LOSS_CHUNK_BYTES = 96 * 2**20


def loss_chunk(vocab: int, batch: int = 1) -> int:
    """Positions per chunk: as many as keep one chunk's float32 logits (``batch × positions ×
    vocab``) within :data:`LOSS_CHUNK_BYTES`, at least one."""
    return max(1, LOSS_CHUNK_BYTES // (4 * max(1, vocab) * max(1, batch)))


def _model_class(lm: nn.Module) -> type:
    """``lm``'s class, or under FSDP2 (``fully_shard`` makes it ``FSDP<Class>``) the class it wraps."""
    cls = type(lm)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # (a build without distributed)
        return cls
    if issubclass(cls, FSDPModule):
        return next((b for b in cls.__bases__ if b is not FSDPModule), cls)
    return cls


def supports_chunked_loss(lm: nn.Module) -> bool:
    """Whether :func:`causal_lm_loss` computes ``lm``'s own loss (see the module docstring)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if _model_class(lm).__name__ not in PLAIN_HEADS or lm.get_output_embeddings() is None:
        return False
    return getattr(lm, "loss_function", None) is ForCausalLMLoss


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 (losses are never taken in half precision)."""
    return torch.promote_types(dtype, torch.float32)


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(_loss_dtype(x.dtype))


def _chunk_nll(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = _wide(head(hidden))
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")


def causal_lm_loss(lm: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``lm(input_ids=ids, attention_mask=mask, labels=labels).loss`` for a model of
    :data:`PLAIN_HEADS` (check with :func:`supports_chunked_loss`), with the output head and the
    loss run ``chunk`` positions at a time under activation checkpointing (default:
    :func:`loss_chunk` of the head's vocabulary and the batch)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    hidden = lm.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    total, count = _chunked_nll(lm.get_output_embeddings(), hidden, labels, chunk)
    return total / count


def _chunked_sum(fn, head: nn.Module, chunk: int | None, hidden: torch.Tensor, *per_position: torch.Tensor) -> torch.Tensor:
    """``Σ fn(head, hidden[:, part], *(t[:, part] for t in per_position))`` over parts of ``chunk``
    positions (default: :func:`loss_chunk`), each under activation checkpointing, in float32 (float64
    for a float64 model)."""
    chunk = chunk or loss_chunk(head.weight.shape[0], hidden.shape[0])
    total = hidden.new_zeros((), dtype=_loss_dtype(hidden.dtype))
    for i in range(0, hidden.shape[1], chunk):
        part = slice(i, i + chunk)
        total = total + checkpoint(fn, head, hidden[:, part], *(t[:, part] for t in per_position), use_reentrant=False)
    return total


def _chunked_nll(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the next-token losses, number of predicted tokens)`` of ``hidden`` (``[B, N, h]``)
    against ``labels`` (``[B, N]``, -100 ignored), the head and the loss ``chunk`` positions at a
    time under activation checkpointing."""
    target = labels[:, 1:].to(hidden.device)
    return _chunked_sum(_chunk_nll, head, chunk, hidden[:, :-1], target), (target != -100).sum()


def kl_from_logits(logits: torch.Tensor, teacher_logits: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ KL(teacher ‖ student)`` over the positions where ``valid`` (``[...]`` bool; None: all) of
    two ``[..., vocab]`` logit tensors, in float32 (float64 for float64 logits):
    ``Σ_v p_t (log p_t − log p_s)`` per position."""
    log_s = torch.log_softmax(_wide(logits), dim=-1)
    log_t = torch.log_softmax(_wide(teacher_logits), dim=-1)
    per_position = (log_t.exp() * (log_t - log_s)).sum(-1)
    if valid is not None:
        per_position = per_position.masked_fill(~valid, 0.0)
    return per_position.sum()


def _chunk_kl(head: nn.Module, hidden: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        teacher_logits = head(teacher)
    return kl_from_logits(head(hidden), teacher_logits, valid)


def distill_loss(
    lm: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, labels: torch.Tensor, teacher_hidden: torch.Tensor, chunk: int | None = None,
) -> torch.Tensor:
    """The mean over the predicted positions (those whose next label is not -100, as
    :func:`causal_lm_loss`) of ``KL(teacher ‖ student)`` between the next-token distributions of a
    teacher, given by its final hidden states ``teacher_hidden`` (``[B, N, h]``, no gradient) through
    ``lm``'s output head, and ``lm`` itself; both heads' logits ``chunk`` positions at a time (the
    student's under activation checkpointing). A model of :data:`PLAIN_HEADS` only."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    hidden = lm.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    if teacher_hidden.shape != hidden.shape:
        raise ValueError(f"teacher_hidden must have the student's hidden shape {tuple(hidden.shape)}, got {tuple(teacher_hidden.shape)}")
    valid = labels[:, 1:].to(hidden.device) != -100
    teacher = teacher_hidden[:, :-1].detach().to(hidden.dtype)
    return _chunked_sum(_chunk_kl, lm.get_output_embeddings(), chunk, hidden[:, :-1], teacher, valid) / valid.sum().clamp(min=1)


@contextlib.contextmanager
def chunked_training_loss(lm: nn.Module):
    """Inside the block, ``lm``'s forward in training mode with ``labels`` computes its loss by
    :func:`_chunked_nll` (the same loss and gradients, one chunk's logits at a time) and returns no
    logits; everything else (evaluation, no labels) runs the model's own forward. For trainers that
    call the model with labels and read only the loss (``transformers.Trainer``'s training step,
    including its ``num_items_in_batch`` normalisation under gradient accumulation) through any
    wrapper that ends in ``lm.forward`` (PEFT, DDP); a PEFT model gives its base model's. Nothing is
    changed for a model :func:`supports_chunked_loss` refuses."""
    lm = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # (PEFT)
    if not supports_chunked_loss(lm):
        yield False
        return
    from transformers.modeling_outputs import CausalLMOutputWithPast

    own = lm.forward
    had_own = "forward" in vars(lm)  # (an instance forward set before: put back afterwards)

    @functools.wraps(own)  # (its signature: Trainer keeps the dataset columns the forward names)
    def forward(*args, labels=None, **kwargs):
        if labels is None or args or not lm.training:
            return own(*args, labels=labels, **kwargs)
        items = kwargs.pop("num_items_in_batch", None)
        for unused in ("logits_to_keep", "return_dict", "use_cache", "past_key_values"):
            kwargs.pop(unused, None)
        hidden = lm.base_model(use_cache=False, **kwargs).last_hidden_state
        total, count = _chunked_nll(lm.get_output_embeddings(), hidden, labels, None)
        if items is None:  # ForCausalLMLoss: the mean over the predicted tokens, else their sum / num_items_in_batch
            return CausalLMOutputWithPast(loss=total / count)
        return CausalLMOutputWithPast(loss=total / (items.to(total.device) if torch.is_tensor(items) else items))

    lm.forward = forward
    try:
        yield True
    finally:
        if had_own:
            lm.forward = own
        else:
            del lm.forward  # the class's forward again


__all__ = ["LOSS_CHUNK_BYTES", "PLAIN_HEADS", "causal_lm_loss", "chunked_training_loss", "distill_loss", "kl_from_logits", "loss_chunk", "supports_chunked_loss"]
