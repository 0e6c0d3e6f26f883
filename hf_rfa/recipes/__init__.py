"""Workflows built on the core: checkpoint conversion (:mod:`.conversion`), training glue
(:mod:`.training`), evaluation (:mod:`.evaluation`, :mod:`.long_range`, the grids of
:mod:`.grid` and the intervals of :mod:`.intervals`) and approximation-error metrics
(:mod:`.approximation`). Nothing in the core (``config``, ``feature_maps``, ``ops``, ``hf``,
``hub``) imports from here."""
