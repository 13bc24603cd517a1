"""A relative position bias built from ``arange`` (MPNet, ESM), beside a padding mask that
the model builds only for a batch with padding. watch() compares the model's operations at
2 and at 3 examples; where the first two examples had no padding and the third had, the mask's
``arange(3)`` was matched with the bias's ``arange(8)``, the bias then taken for a quantity
of the batch, and the model refused (an outside review: MPNet and ESM, by where the padding
sat). The same operation with a smaller output at more examples is now a parting of the two
runs, not a counterpart."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch


class RelativeBias(nn.Module):
    def __init__(self, t: int = 8, d: int = 4) -> None:
        super().__init__()
        self.table = nn.Embedding(2 * t, 1)
        self.proj, self.head = nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        h = self.proj(x)
        if not bool(mask.all()):  # built only where some example is padded
            rows = torch.arange(n, device=x.device)
            h = h * mask[rows].unsqueeze(-1)
        pos = torch.arange(t, device=x.device)
        bias = self.table((pos[None] - pos[:, None]).abs()).squeeze(-1)
        scores = h @ h.transpose(1, 2) + bias.unsqueeze(0).expand(n, t, t)
        return self.head((scores.softmax(-1) @ h).mean(1))


def loop_m2(model: nn.Module, x, mask, y) -> float:
    copied = copy.deepcopy(model)
    params = list(copied.parameters())
    total = 0.0
    for i in range(len(y)):
        loss = F.cross_entropy(copied(x[i : i + 1], mask[i : i + 1]), y[i : i + 1])
        total += sum(float(g.square().sum()) for g in torch.autograd.grad(loss, params))
    return total / len(y)


@pytest.mark.parametrize("lengths", [[8, 8, 7, 5, 8, 8], [7, 8, 8, 5, 8, 8]])
def test_padding_in_the_third_example_is_not_a_batch_quantity(lengths: list[int]) -> None:
    torch.manual_seed(0)
    model = RelativeBias().double()
    x = torch.randn(6, 8, 4, dtype=torch.float64)
    mask = (torch.arange(8)[None] < torch.tensor(lengths)[:, None]).double()
    y = torch.randint(0, 3, (6,))
    monitor = OnlineDiversity(100, decay=0.0)
    with watch(model, monitor):
        F.cross_entropy(model(x, mask), y).backward()
    assert monitor.last is not None
    assert monitor.last[0] == pytest.approx(loop_m2(model, x, mask, y), rel=1e-9)
