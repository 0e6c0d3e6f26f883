"""Every resume path restores exactly or refuses with a message: 'latest' without a checkpoint,
an unreadable or missing RNG state, and 'latest' in the Trainer recipe."""

from __future__ import annotations

import pytest
import torch

from hf_rfa.recipes.training.loop import load_state_exactly, resolve_resume
from hf_rfa.recipes.training.trainer import trainer_resume


def test_latest_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume("latest", str(tmp_path))
    assert resolve_resume(None, str(tmp_path)) is None
    assert resolve_resume(str(tmp_path / "step_3"), str(tmp_path)) == str(tmp_path / "step_3")


def test_trainer_recipe_accepts_latest(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint-N"):
        trainer_resume("latest", str(tmp_path))
    for n in (2, 10):
        (tmp_path / f"checkpoint-{n}").mkdir()
    assert trainer_resume("latest", str(tmp_path)) == str(tmp_path / "checkpoint-10")
    assert trainer_resume(None, str(tmp_path)) is None


@pytest.fixture
def saved_state(tmp_path):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.save_state(str(tmp_path / "step_1"))
    return acc, tmp_path / "step_1"


def test_intact_rng_state_loads(saved_state):
    acc, folder = saved_state
    torch.manual_seed(123)
    load_state_exactly(acc, str(folder))


def test_corrupt_rng_state_is_refused(saved_state):
    acc, folder = saved_state
    (folder / "random_states_0.pkl").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(ValueError, match="random_states_0.pkl is unreadable"):
        load_state_exactly(acc, str(folder))


def test_missing_rng_state_is_refused(saved_state):
    acc, folder = saved_state
    (folder / "random_states_0.pkl").unlink()
    with pytest.raises(ValueError, match="lacks random_states_0.pkl"):
        load_state_exactly(acc, str(folder))
