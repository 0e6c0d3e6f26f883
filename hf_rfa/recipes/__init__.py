"""Workflows built on the core: checkpoint conversion (:mod:`.conversion`), training glue
(:mod:`.training`), evaluation (:mod:`.evaluation`) and approximation-error metrics
(:mod:`.approximation`). Nothing in the core (``config``, ``feature_maps``, ``ops``, ``hf``,
``hub``) imports from here."""
