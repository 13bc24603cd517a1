"""A layer's output written in place after the call (``h[~mask] = 0``, as Hugging Face's
Wav2Vec2 with stable layer norm does to its feature projection). A Linear's output on a 3-d
input is a view; the write gives it a new history, and the layer's own node leaves the
backward pass. Its rule then saw no output gradient: zeros for that layer, in S and in the
gradient sum, in float32 where the layer held under 1e-3 of S (the check's tolerance):
S −0.08 %, T −0.27 % (an outside review; Wav2Vec2: T −1.1 %). Now such a call goes to the
exact fallback, with its tensor alive or gone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import measure, per_example_stats
from batchbound.diversity.calls import dict_batch

torch.set_num_threads(1)


class Masked(nn.Module):
    def __init__(self, keep_output: bool) -> None:
        super().__init__()
        self.keep_output = keep_output
        self.proj, self.mid, self.head = nn.Linear(4, 8), nn.Linear(8, 1024), nn.Linear(1024, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: object = None) -> torch.Tensor:
        if self.keep_output:
            h = self.proj(x)
            h[~mask] = 0  # in place on the Linear's output
        else:  # the output's own tensor is gone: a view of it is written and kept
            h = self.proj(x).view(x.shape[0], -1, 8)
            h[~mask] = 0
        return self.head(torch.tanh(self.mid(h))).mean(1)


def data() -> dict[str, torch.Tensor]:
    """A Hugging Face style dict batch: the model is called with all of it."""
    torch.manual_seed(0)
    n, t = 6, 5
    x = torch.randn(n, t, 4)
    mask = torch.arange(t)[None] < torch.tensor([5, 5, 4, 3, 5, 2])[:, None]
    return {"x": x, "mask": mask, "y": torch.randint(0, 3, (n,))}


def loss(out: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch["y"], reduction="none")


def loop(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], float]:
    """Per-parameter S and T by the per-example loop, in float64."""
    model = model.double()
    params = dict(model.named_parameters())
    grads = []
    for i in range(len(batch["y"])):
        one = {k: v[i : i + 1].double() if v.is_floating_point() else v[i : i + 1]
               for k, v in batch.items()}
        grads.append(torch.autograd.grad(loss(model(**one), one).sum(), list(params.values())))
    per = {k: sum(float(g[j].square().sum()) for g in grads) for j, k in enumerate(params)}
    total = sum(float(sum(g[j] for g in grads).square().sum()) for j in range(len(params)))
    return per, total


@pytest.mark.parametrize("keep_output", [True, False])
def test_a_layer_output_written_in_place_is_measured_exactly(keep_output: bool) -> None:
    batch = data()
    torch.manual_seed(0)
    model = Masked(keep_output)
    per, total = loop(copy.deepcopy(model), batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost, stated
        report = measure(model, batch, loss)
        given = dict_batch(batch)
        stats = per_example_stats(model, given, given, loss)
    got = {k: float(v.double().sum()) for k, v in stats.sq_norms.items()}
    assert got["proj.weight"] == pytest.approx(per["proj.weight"], rel=1e-5)
    assert sum(got.values()) == pytest.approx(sum(per.values()), rel=1e-6)
    assert "proj.weight" in stats.fallback
    t_measured = report.T
    assert t_measured == pytest.approx(total, rel=1e-5)
