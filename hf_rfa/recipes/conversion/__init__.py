"""Checkpoint conversion: settings (:mod:`.config`), loading (:mod:`.loading`), the workflow as an
ordered list of stages (:mod:`.stages` over :mod:`.state`, driven by :mod:`.pipeline`), capture of
q/k/v and per-layer errors (:mod:`.calibration`), attention transfer and LoRA (:mod:`.transfer`)."""
