"""``hf-rfa-lm-eval`` reports a user error as the other hf_rfa commands do: one stderr line, status 2."""

from __future__ import annotations

import sys
from unittest import mock

import pytest

pytest.importorskip("lm_eval")

from hf_rfa.integrations import lm_eval as ours  # noqa: E402

REFUSAL = "plain is not a converted hf_rfa checkpoint (no 'rfa_config' in its config.json): convert it first\nsecond line"


def test_user_error_is_one_line_and_status_2(capsys):
    seen = []

    def refuse():
        seen.append(list(sys.argv[1:]))
        raise ValueError(REFUSAL)

    with mock.patch("lm_eval.__main__.cli_evaluate", refuse):
        assert ours.main(["--model", "hf_rfa", "--model_args", "pretrained=plain", "--tasks", "piqa"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"hf-rfa-lm-eval: error: {REFUSAL.splitlines()[0]} (--debug shows the traceback)"]
        with pytest.raises(ValueError, match="not a converted"):
            ours.main(["--model", "hf_rfa", "--model_args", "pretrained=plain", "--tasks", "piqa", "--debug"])
    assert seen[1] == ["--model", "hf_rfa", "--model_args", "pretrained=plain", "--tasks", "piqa"]  # --debug is not lm-eval's


def test_success_returns_0():
    with mock.patch("lm_eval.__main__.cli_evaluate", lambda: None):
        assert ours.main(["--model", "hf", "--tasks", "piqa"]) == 0
