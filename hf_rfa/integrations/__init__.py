"""Integrations with the evaluation tools of the field.

- :mod:`hf_rfa.integrations.lm_eval`: an lm-evaluation-harness model entry (``--model hf_rfa``)
  that loads converted checkpoints through hf_rfa's loader and generates with the
  constant-memory :class:`hf_rfa.RFACache`, and the ``hf-rfa-lm-eval`` command (lm-eval's command
  line with that entry registered and the offline tasks on its include path).
- :mod:`hf_rfa.integrations.lm_eval_tasks`: offline downstream tasks (Wikipedia next sentence,
  Rotten Tomatoes sentiment, BBC news topics, few-shot and many-shot) as lm-eval task configs.
- :mod:`hf_rfa.integrations.scoring`: hf_rfa's own multiple-choice scoring (the reference the
  lm-eval scores are tested against) and bootstrap intervals.
- :mod:`hf_rfa.integrations.metrics`: ``evaluate`` metrics with offline implementations as the
  fallback (``evaluate.load`` fetches metric scripts from the Hub).

Nothing here is imported by ``import hf_rfa``; lm-eval and evaluate are the optional extra
``pip install hf_rfa[eval]``.
"""
