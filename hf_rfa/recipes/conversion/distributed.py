"""Several processes for one conversion, through Accelerate (``accelerate launch hf-rfa-convert ...``).

No launcher of hf_rfa's own: under ``accelerate launch`` (or ``torchrun``) every process runs the
whole conversion, and

- each global batch of attention transfer and LoRA is split by rows over the processes
  (:func:`shard`: rank ``r`` takes rows ``r, r + W, ...``), each process back-propagates the mean
  loss of its rows, and the gradients are averaged over the processes (:func:`all_reduce_grads`)
  before every optimiser step: with equal rows per process that is the gradient of the global
  batch's mean loss, so N processes train what one process does with the same global batch
  (``--batch-size`` is the global batch; it must be a multiple of the process count);
- the token budgets count the global batch (:func:`global_tokens`), so every process stops at the
  same step;
- perplexity windows are split over the processes and the per-window sums gathered and added in
  window order (:func:`gather_window_sums`): the figures equal one process's;
- only the main process writes the output folder (``pipeline.run``); the others wait for it.

With FSDP (:func:`fsdp_active`: ``accelerate launch`` with an FSDP config, i.e.
``ACCELERATE_USE_FSDP=true`` in the environment, or ``--fsdp``), the training stages shard their
model instead (:mod:`.fsdp`) and FSDP reduce-scatters the gradients: :func:`all_reduce_grads` is
not called there. The other stages (per-layer errors, long-range tasks, generation sample) are
cheap next to training and run the same in every process. One process (no ``WORLD_SIZE`` > 1 in the environment)
never touches ``torch.distributed``: everything here is then a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Processes:
    """This process's place: ``rank`` of ``world``; ``device`` the one Accelerate gives it."""

    rank: int = 0
    world: int = 1
    device: torch.device | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_STATE: list[Processes] = []


def world_size_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def processes() -> Processes:
    """The process group of this run (started through ``accelerate.PartialState`` on first use when
    launched with more than one process; one process otherwise)."""
    if _STATE:
        return _STATE[0]
    if world_size_from_env() <= 1:
        p = Processes()
    else:
        from accelerate import PartialState
        from accelerate.utils import parse_flag_from_env

        s = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # what Accelerator() reads: CPU processes over gloo
        p = Processes(s.process_index, s.num_processes, s.device)
    _STATE.append(p)
    return p


_FSDP: list[bool | None] = [None]


def use_fsdp(flag: bool | None) -> None:
    """Shard the training stages with FSDP: True / False, or None to follow the launcher
    (``ACCELERATE_USE_FSDP``, set by ``accelerate launch`` with an FSDP config or ``--use_fsdp``)."""
    _FSDP[0] = flag


def fsdp_requested() -> bool:
    """Whether FSDP was asked for (:func:`use_fsdp`, else Accelerate's environment)."""
    if _FSDP[0] is not None:
        return bool(_FSDP[0])
    from accelerate.utils import parse_flag_from_env

    return parse_flag_from_env("ACCELERATE_USE_FSDP")


def fsdp_active() -> bool:
    """Whether the training stages shard (:mod:`.fsdp`): FSDP asked for and more than one process."""
    return fsdp_requested() and processes().world > 1


def _dist():
    import torch.distributed as dist

    return dist if processes().world > 1 and dist.is_available() and dist.is_initialized() else None


def check_batch(batch_size: int) -> None:
    """The global batch must split evenly over the processes."""
    w = processes().world
    if w > 1 and batch_size % w:
        raise ValueError(f"batch_size must be a multiple of the {w} processes (the global batch is split by rows), got {batch_size}")


def shard(ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This process's rows of a global batch ``ids [B, N]`` (and its mask)."""
    p = processes()
    if p.world == 1:
        return ids, mask
    if ids.shape[0] % p.world:
        raise ValueError(f"a batch of {ids.shape[0]} rows cannot be split over {p.world} processes (batch_size must be a multiple of it)")
    return ids[p.rank :: p.world], None if mask is None else mask[p.rank :: p.world]


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Average the gradients of ``params`` over the processes (in place; one flat buffer)."""
    dist = _dist()
    if dist is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= processes().world
    i = 0
    for g in grads:
        g.copy_(flat[i : i + g.numel()].view_as(g).to(g.dtype))
        i += g.numel()


def global_tokens(n: int) -> int:
    """The real tokens of the global batch, from this process's ``n``."""
    dist = _dist()
    if dist is None:
        return n
    t = torch.tensor([n], dtype=torch.long, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true in any process (one all-reduce; ``flag`` itself with one process)."""
    dist = _dist()
    if dist is None:
        return bool(flag)
    t = torch.tensor([int(bool(flag))], dtype=torch.long, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def window_indices(count: int) -> range:
    """The evaluation windows (of ``count``) this process measures."""
    p = processes()
    return range(p.rank, count, p.world)


def gather_window_sums(local: dict[int, tuple[float, int]], count: int) -> list[tuple[float, int]]:
    """Every window's ``(nll, tokens)`` in window order, from each process's ``{index: ...}``."""
    dist = _dist()
    if dist is None:
        return [local[i] for i in range(count)]
    parts: list = [None] * processes().world
    dist.all_gather_object(parts, local)
    merged = {k: v for part in parts for k, v in part.items()}
    return [merged[i] for i in range(count)]


def barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _comm_device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


__all__ = [
    "Processes", "all_reduce_grads", "any_process", "barrier", "check_batch", "fsdp_active", "fsdp_requested", "gather_window_sums", "global_tokens", "processes", "shard",
    "use_fsdp", "window_indices",
]
