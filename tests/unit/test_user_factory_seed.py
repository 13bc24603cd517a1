"""A user's factory (``MODULE:CALLABLE``) gets an int seed from every build, also the ones
that only count parameters or check shapes (advise's payload, a config's validation): a
factory that calls ``torch.manual_seed(seed)`` must never be handed None."""

from __future__ import annotations

import sys

import pytest
import torch

from batchbound.data import load_dataset
from batchbound.models import build_model
from batchbound.train.config import TrainConfig

FACTORY = '''
import torch
from torch import nn

SEEDS = []


def seeded(input_shape, num_outputs, seed):
    SEEDS.append(seed)
    torch.manual_seed(seed)  # raises for None, as the issue's user factory did
    return nn.Sequential(nn.Linear(input_shape[0], 8), nn.Tanh(), nn.Linear(8, num_outputs))
'''


@pytest.fixture()
def factory(tmp_path, monkeypatch):
    (tmp_path / "seedmodels.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("seedmodels", None)


def test_a_build_without_a_seed_hands_the_factory_zero(factory) -> None:
    import seedmodels

    state = torch.random.get_rng_state()
    unseeded = build_model("seedmodels:seeded", (64,), 10)
    zero = build_model("seedmodels:seeded", (64,), 10, seed=0)
    seven = build_model("seedmodels:seeded", (64,), 10, seed=7)
    assert seedmodels.SEEDS == [0, 0, 7]
    assert all(torch.equal(a, b) for a, b in zip(unseeded.parameters(), zero.parameters(),
                                                  strict=True))
    assert not torch.equal(next(zero.parameters()), next(seven.parameters()))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's stream untouched


def test_advise_payload_and_validation_build_a_seeded_factory(factory) -> None:
    import seedmodels

    from batchbound.advise.advice import _payload

    digits = load_dataset("digits")
    config = TrainConfig(dataset="digits", model="seedmodels:seeded", batch_size=16, lr=0.1,
                         seed=3, max_epochs=1)
    config.validate_against(digits)
    assert _payload(config, digits) == (64 * 8 + 8 + 8 * 10 + 10 + 3) * 4
    assert seedmodels.SEEDS[-1] == 3  # the run's own seed, not None
