"""Refusals that name the cause the user can act on: a matrix over pairs of examples (a
contrastive model's similarities) was called a padding to the longest example, and a model
that counts its own calls was said to draw random numbers only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError


class Similarities(nn.Module):
    """CLIP's shape of output: every example's embedding against every other's."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.image(x) @ self.text(x).T


class Counting(nn.Module):
    """Flips its features on every other call: a step counter kept in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.calls = nn.Linear(4, 3), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.a(x.flip(-1) if self.calls % 2 else x)


def test_a_matrix_over_pairs_of_examples_is_named() -> None:
    model, x = Similarities(), torch.randn(4, 4)
    with pytest.raises(BatchboundError, match=r"every pair of examples.*interact"), \
            watch(model, OnlineDiversity()):
        out = model(x)
        F.cross_entropy(out, torch.arange(4)).backward()


def test_a_counter_of_calls_is_named() -> None:
    model, x = Counting(), torch.randn(4, 4)
    with pytest.raises(BatchboundError, match="a counter of its calls"), \
            watch(model, OnlineDiversity()):
        F.cross_entropy(model(x), torch.arange(3).repeat(2)[:4]).backward()


def test_a_gradient_penalty_is_named() -> None:
    """WGAN-GP's penalty takes torch.autograd.grad of the critic with create_graph=True
    inside the step; the refusal named only retain_graph, which the user never wrote."""
    critic, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), torch.randn(5, 4)
    with pytest.raises(BatchboundError, match="gradient penalty"), \
            watch(critic, OnlineDiversity(10)):
        given = x.clone().requires_grad_(True)
        out = critic(given)
        slope, = torch.autograd.grad(out.sum(), given, create_graph=True)
        (out.squeeze(1) + 10 * (slope.norm(dim=1) - 1) ** 2).mean().backward()


class LoRA(nn.Module):
    """A frozen Linear beside trainable low-rank factors no layer rule takes (the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 3).requires_grad_(False)
        self.A, self.B = nn.Parameter(torch.randn(2, 6) * 0.1), nn.Parameter(torch.randn(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.T) @ self.B.T


def test_an_optimizer_step_inside_the_block_before_the_fallback_is_named() -> None:
    """An outside review: refused as "a regulariser in the loss, a loss that is not a sum
    over the examples, or examples that interact"; the weights had moved under the
    fallback, which runs at the block's end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), LoRA())
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="torch.func vmap"), \
            watch(model, OnlineDiversity(100)):  # the step after the block: measured
        F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    with pytest.raises(BatchboundError, match=r"changed inside the block after the backward "
                                              r"\(an optimizer step inside it\?\)"), \
            watch(model, OnlineDiversity(100)):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_a_hook_that_changes_a_parameters_gradient_is_named() -> None:
    """A clamp registered on a weight's gradient: refused as a regulariser or a loss that is
    not a sum before (an outside review)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model[2].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with pytest.raises(BatchboundError, match=r"a hook on its gradient \(register_hook\) "
                                              r"changes \.grad.*: 2\.weight"), \
            watch(model, OnlineDiversity(100)):
        F.cross_entropy(model(x), y).backward()
