"""Hugging Face Transformers integration: the ``"rfa"`` attention and mask functions
(:mod:`.attention`), the constant-memory generation cache (:mod:`.cache`) and
convert / redraw / from_pretrained (:mod:`.convert`)."""
