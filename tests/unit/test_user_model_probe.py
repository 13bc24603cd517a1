"""The check a ``--model MODULE:CALLABLE`` model gets before any work (models/user.py,
``probe_user_model``), on a user's MLP with BatchNorm1d: run on one example in
train mode it raised BatchNorm's "Expected more than 1 value per channel", and every
command refused the model as one that "does not take this data's examples". The probe
runs in eval mode: the model's mode, its buffers and the random state are left as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.user import probe_user_model


def bn_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(8, 3))


def test_a_batch_norm_mlp_in_train_mode_passes_and_is_left_as_it_was() -> None:
    model = bn_mlp().train()
    buffers = [b.clone() for b in model.buffers()]
    torch.manual_seed(1)
    probe_user_model("mine:bn_mlp", model, torch.randn(1, 6), 3, "classification")
    after = torch.rand(3)
    torch.manual_seed(1)
    torch.randn(1, 6)
    assert torch.equal(after, torch.rand(3))  # the probe drew no random numbers
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))


def test_a_model_that_does_not_fit_the_data_is_still_one_line() -> None:
    with pytest.raises(BatchboundError, match="does not take this data's examples") as info:
        probe_user_model("mine:bn_mlp", bn_mlp(), torch.randn(1, 5), 3, "classification")
    assert "\n" not in str(info.value)


def test_the_modes_of_a_model_mixing_them_are_restored() -> None:
    model = bn_mlp().train()
    model[3].eval()  # a user's own choice per module
    probe_user_model("mine:bn_mlp", model, torch.randn(1, 6), 3, "classification")
    assert [m.training for m in model.modules()] == [True, True, True, True, False, True]
