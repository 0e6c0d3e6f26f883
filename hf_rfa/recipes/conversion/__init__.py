"""Checkpoint conversion: the workflow (:mod:`.pipeline`), capture of q/k/v and per-layer errors
(:mod:`.calibration`), attention transfer and LoRA (:mod:`.transfer`)."""
