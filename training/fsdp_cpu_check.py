#!/usr/bin/env python
"""Run FSDP2 steps on CPU (gloo) with the wrap policy of one of ``training/configs/fsdp_*.yaml``.

Accelerate 1.15 never enables FSDP for CPU processes (``MULTI_CPU`` is not in the set of
distributed types it turns into ``FSDP``), so this check applies the config's policy with
``torch.distributed.fsdp.fully_shard`` directly — what Accelerate does on GPUs: one FSDP unit per
``fsdp_transformer_layer_cls_to_wrap`` module, then the root. It trains a few steps with redraws
and checks that (a) the losses equal those of the same model unsharded in every process, and
(b) the random projections are identical on every rank (FSDP does not broadcast buffers).
``--chunked_loss``: the sharded model trains with the training commands' chunked loss
(:func:`hf_rfa.recipes.conversion.lm_loss.chunked_training_loss`, ``--chunk_positions`` positions of
logits at a time), the unsharded twin with the model's own loss.

    torchrun --nproc_per_node 2 training/fsdp_cpu_check.py --config training/configs/fsdp_llama.yaml \\
        --model_name_or_path CKPT --train_file train.txt --out result.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging

import torch
import torch.distributed as dist
import yaml

from hf_rfa import RFAConfig, redraw
from hf_rfa.recipes.training import DataArguments, ModelArguments, RFAArguments, build_model, load_tokenizer, prepare, projection_fingerprint

logger = logging.getLogger("fsdp_cpu_check")
#: sequences per process and step
PER_RANK = 2


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--feature_map", default="favor+")
    p.add_argument("--num_features", type=int, default=8)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunked_loss", action="store_true", help="the sharded model trains with the chunked training loss")
    p.add_argument("--chunk_positions", type=int, default=5, help="with --chunked_loss: positions of logits per chunk")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> None:
    a = _args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import fully_shard

    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    if cfg.get("distributed_type") != "FSDP" or cfg["fsdp_config"].get("fsdp_version") != 2:
        raise ValueError(f"config {a.config} is not an FSDP2 accelerate config")
    wrap = {c.strip() for c in cfg["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"].split(",")}

    margs = ModelArguments(model_name_or_path=a.model_name_or_path)
    dargs = DataArguments(task="causal-lm", train_file=a.train_file, max_seq_length=a.block)
    rargs = RFAArguments(rfa=RFAConfig(feature_map=a.feature_map, num_features=a.num_features))
    tok = load_tokenizer(margs)
    data = prepare(dargs, tok)
    torch.manual_seed(0)
    model = build_model(margs, rargs, "causal-lm", tok)
    model.train()  # (as a trainer does; the Llama configs here have no dropout)
    reference = copy.deepcopy(model)  # unsharded twin, same init
    units = [m for m in model.modules() if type(m).__name__ in wrap]
    if not units:
        raise ValueError(f"fsdp_transformer_layer_cls_to_wrap {sorted(wrap)} matches no module of {type(model).__name__}")
    for m in units:
        fully_shard(m, reshard_after_forward=cfg["fsdp_config"].get("fsdp_reshard_after_forward", True))
    fully_shard(model)
    if a.chunked_loss:
        from hf_rfa.recipes.conversion import lm_loss

        lm_loss.LOSS_CHUNK_BYTES = 4 * model.get_output_embeddings().weight.shape[0] * PER_RANK * a.chunk_positions
        chunked = lm_loss.chunked_training_loss(model)  # (for the rest of the process)
        if not chunked.__enter__():
            raise ValueError(f"--chunked_loss: {type(model).__name__} has no plain output head")
    head_calls = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: head_calls.append(tuple(i[0].shape[:2])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses, prints = [], [], []
    for step in range(1, a.steps + 1):
        rows = list(range((step - 1) * PER_RANK * world, step * PER_RANK * world))
        full = data.collator([data.train[i % len(data.train)] for i in rows])
        mine = {k: v[rank * PER_RANK : (rank + 1) * PER_RANK] for k, v in full.items()}
        loss = model(**mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
        ref_loss = reference(**full).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        redraw(model, step)
        redraw(reference, step)
        fp = projection_fingerprint(model)
        gathered = [None] * world
        dist.all_gather_object(gathered, fp)
        prints.append(gathered)
        if rank == 0:
            logger.info("step %d: FSDP loss %.6f, unsharded loss %.6f, projections equal on %d ranks: %s", step, losses[-1], ref_losses[-1], world, len(set(gathered)) == 1)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"fsdp_units": len(units), "wrap": sorted(wrap), "losses": losses, "reference_losses": ref_losses, "fingerprints": prints, "world_size": world,
                       "chunked_loss": a.chunked_loss, "head_calls": head_calls}, f, indent=1)
    # both ranks tear gloo down together: a rank destroying its group while the other still has
    # work in flight aborted now and then ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
