"""Write a converted model's weights into its original architecture, with exact softmax attention.

    python benchmarks/softmax_weights.py out/smollm2-135m-rfa ~/runs/recipe-softmax

Every weight the original architecture has (embeddings, MLPs, norms and the attention projections,
LoRA merged) is copied from the converted checkpoint; the feature maps, decay rates and the other
``rfa`` tensors are left out, and the config is the original model type's (no ``rfa_config``). The
folder loads with plain transformers and runs softmax attention: evaluated beside the converted
model, it separates what the converted model's trained weights change (its LoRA) from what its
attention changes. Progress and results are logged; exit 0 on success.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger("softmax_weights")


def softmax_weights(converted: str, out: str) -> dict:
    """Write ``converted``'s base weights into an original-architecture model saved at ``out``;
    returns ``{"copied": n, "left_out": m}`` (tensors). ValueError when ``converted`` is not a
    converted hf_rfa checkpoint or the base architecture lacks one of the copied weights' shapes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_rfa

    model = hf_rfa.from_pretrained(converted, AutoModelForCausalLM)
    if hf_rfa.rfa_config_of(model) is None:
        raise ValueError(f"{converted!r} is not a converted hf_rfa checkpoint (its config has no rfa_config)")
    config = model.config.to_dict()
    for key in ("rfa_config", "auto_map"):
        config.pop(key, None)
    base_type = type(model.config).__mro__[1] if type(model.config).model_type.startswith("hf_rfa_") else type(model.config)
    config["model_type"] = base_type.model_type
    plain = AutoModelForCausalLM.from_config(base_type.from_dict(config), dtype=torch.float32)
    if hf_rfa.rfa_config_of(plain) is not None:
        raise ValueError(f"the base architecture of {converted!r} was built converted; nothing to write")
    theirs = model.state_dict()
    ours = plain.state_dict()
    for name, tensor in ours.items():
        if name not in theirs or theirs[name].shape != tensor.shape:
            raise ValueError(f"{converted!r} has no weight {name!r} of shape {tuple(tensor.shape)} for its base architecture")
    plain.load_state_dict({k: theirs[k] for k in ours}, strict=True)
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(converted).save_pretrained(out)
    left_out = [k for k in theirs if k not in ours]
    logger.info("%s: %d weights copied, %d rfa tensors left out -> %s", converted, len(ours), len(left_out), out)
    return {"copied": len(ours), "left_out": len(left_out)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("converted", help="a converted hf_rfa folder (or Hub id)")
    p.add_argument("out", help="the folder to write")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if Path(a.out).exists() and any(Path(a.out).iterdir()):
        p.error(f"out {a.out!r} exists and is not empty: give a new folder")
    try:
        softmax_weights(a.converted, a.out)
    except (ValueError, OSError) as e:
        p.error(str(e).splitlines()[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
