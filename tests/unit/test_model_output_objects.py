"""A model that returns an output object rather than a tensor (Hugging Face's ModelOutput,
or a user's dataclass), with a loss that reads its logits: ``measure`` took it already; the
trainer, advise's pilot and ``train`` must too. The loss is all a planned run needs; an
accuracy cannot be read off an object, so a target on it is refused, naming why, instead of
a pilot that fails inside the evaluation ('... has no attribute dim')."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from batchbound.advise import advise
from batchbound.errors import BatchboundError


@dataclass
class Output:
    logits: torch.Tensor


class ReturnsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.net(x))


def logits_loss(out: Output, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits, y, reduction="none")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    return x, x[:, :3].argmax(1)


def test_advise_plans_a_model_that_returns_an_object() -> None:
    advice = advise(ReturnsObject(), data(), logits_loss, optimizer="adamw", lr=3e-3,
                    batch_size=8, planned_epochs=2, critical_batch="noise", max_workers=1)
    assert advice.pilot["iterations"] > 0 and advice.batch_bound > 1


def test_an_accuracy_target_on_an_object_is_refused_naming_it() -> None:
    with pytest.raises(BatchboundError, match="output object") as info:
        advise(ReturnsObject(), data(), logits_loss, optimizer="adamw", lr=3e-3,
               batch_size=8, targets=({"metric": "train_acc", "threshold": 0.9},),
               max_workers=1)
    assert "train_acc" in str(info.value) and "dim" not in str(info.value)
