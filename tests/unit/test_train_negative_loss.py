"""A loss that starts below 0 (a Gaussian negative log-likelihood, a shifted loss) trains: the
divergence rule's factor × the initial loss bounds a positive loss only. Before, −2.8 >
10 × −2.7 read every such run as diverged at its first step (advise: "the pilot diverged;
lower --lr")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts, Trainer

CONFIG = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.05,
                     max_iterations=20, eval_every_iterations=10)


def shifted(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy less 5: the same gradients, a minimum of −5."""
    return F.cross_entropy(outputs, targets, reduction="none") - 5.0


def test_a_loss_below_zero_at_the_start_trains_as_the_same_loss_above_it() -> None:
    below = Trainer(CONFIG, DistContext(), parts=Parts(loss=shifted))
    result = below.run()
    assert result.status == "complete", result.message
    assert below.iteration == 20 and below.initial_loss < 0
    plain = Trainer(CONFIG, DistContext())
    plain.run()
    # the same gradients, the same steps: the same weights
    for a, b in zip(below.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_positive_loss_still_diverges_past_the_factor() -> None:
    trainer = Trainer(CONFIG.replace(lr=50.0, max_iterations=200), DistContext())
    result = trainer.run()
    assert result.status == "diverged"
