"""Checkpoint conversion: settings (:mod:`.config`), loading (:mod:`.loading`), the workflow as an
ordered list of stages (:mod:`.stages` over :mod:`.state`, driven by :mod:`.pipeline`), capture of
q/k/v and per-layer errors (:mod:`.calibration`), attention transfer and LoRA (:mod:`.transfer`,
layer by layer: :mod:`.layerwise`); device and precision (:mod:`.devices`), the memory plan
(:mod:`.memory_plan`) and several processes under ``accelerate launch`` (:mod:`.distributed`)."""
