"""An output of the whole batch whose size equals the number of examples by coincidence: a
mixture of experts' load per expert, shape (E,), at a batch of E examples. Whether an output
holds the examples was decided by ``n in shape``, so it passed for one:

- the trainer (``online_diversity="two_batch"``, micro-batches of E) trained on the coupled
  objective and reported an online diversity (0.032 at the first step) where micro-batches
  of another size were refused; with ``online_diversity="off"`` it trained silently;
- ``measure`` and ``monitored_step`` refused, but naming another cause (the examples
  interact, or "use reduction='none'");
- ``watch`` read the loads as the examples' rows in its check and refused every step as
  "the examples interact", also when the loss leaves them out (8 experts, batches of ≥ 8).

An output holds the examples when its shape follows their number: it is now read at 2 and
at 3 examples (``rule_check.output_kinds``), and one whose shape stays is the batch's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, measure, monitored_step, watch
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts, Trainer

E = 8  # experts, and the batch


class Loads(nn.Module):
    """Logits, and each expert's load over the batch (the router's mean probability,
    squared): a load-balancing term of shape (E,) that couples the examples."""

    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.out = nn.Linear(features, E), nn.Linear(features + E, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.gate(x).softmax(-1)
        return self.out(torch.cat([x, p], dim=-1)), E * p.mean(0) ** 2


def data(n: int = E, features: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, features, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def added(out, y: torch.Tensor) -> torch.Tensor:
    """The batch's term added to every example's loss."""
    return F.cross_entropy(out[0], y, reduction="none") + 0.1 * out[1].sum()


def aligned(out, y: torch.Tensor) -> torch.Tensor:
    """Expert i's load added to example i's loss: the shapes agree by coincidence."""
    return F.cross_entropy(out[0], y, reduction="none") + 0.1 * out[1]


def plain(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], y, reduction="none")


def refused_naming_the_output(info: pytest.ExceptionInfo) -> None:
    said = str(info.value)
    assert f"reads output 1 of the model, shape ({E},) at any batch size" in said, said
    assert "\n" not in said


@pytest.mark.parametrize("online", ["off", "two_batch"])
def test_the_trainer_refuses_a_batch_output_of_the_batchs_size(online: str) -> None:
    config = TrainConfig(dataset="digits", batch_size=2 * E, micro_batch=E, lr=0.1,
                         max_iterations=2, eval_every_iterations=2, dtype="float64",
                         online_diversity=online)
    trainer = Trainer(config, DistContext(), parts=Parts(model=Loads(64, 10), loss=added))
    with pytest.raises(BatchboundError) as info:
        trainer.run()
    refused_naming_the_output(info)


@pytest.mark.parametrize("loss", [added, aligned])
def test_measure_and_monitored_step_name_the_batch_output(loss) -> None:
    x, y = data()
    with pytest.raises(BatchboundError) as info:
        measure(Loads().double(), (x, y), loss, chunk_size=E)
    refused_naming_the_output(info)
    with pytest.raises(BatchboundError) as info:
        monitored_step(Loads().double(), x, y, loss, OnlineDiversity(10))
    refused_naming_the_output(info)


def loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """S and T from the float64 per-example loop (one backward per example)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = plain(model(x), y)
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(losses.shape[0]):
        for t, g in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True,
                                                   materialize_grads=True), strict=True):
            t += g
            S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


@pytest.mark.parametrize("n", [E, 2 * E])
def test_watch_reads_a_model_with_e_experts_at_batches_of_e_and_more(n: int) -> None:
    x, y = data(n)
    model = Loads().double()
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(model, monitor):
            plain(model(x), y).mean().backward()
    model.zero_grad()
    S, T = loop(model, x, y)
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, T, n)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-10)
    assert monitor.cross == pytest.approx(want.cross, rel=1e-9)


def test_watch_refuses_the_loads_in_the_loss_naming_them() -> None:
    x, y = data()
    model = Loads().double()
    with pytest.raises(BatchboundError) as info, watch(model, OnlineDiversity(10)):
        added(model(x), y).mean().backward()
    refused_naming_the_output(info)
    assert str(info.value).startswith("watch(): ")


class PerClass(nn.Module):
    """A learned temperature per class, returned beside the logits: E classes, a batch of E.
    Of the parameters alone, so it couples no examples, but its rows are no examples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = nn.Linear(6, E)
        self.log_t = nn.Parameter(0.1 * torch.randn(E))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out(x), self.log_t.exp()


def per_class(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0] / out[1], y, reduction="none")


def test_a_temperature_per_class_is_measured_and_watch_refuses_its_rows() -> None:
    """watch's fallback reads the gradient on row i of each output as example i's: read off
    this output, whose E rows are classes, it would have been wrong; refused."""
    x, y = data()
    model = PerClass().double()
    params = list(model.parameters())
    losses = per_class(model(x), y)
    S, total = 0.0, [torch.zeros_like(p) for p in params]
    for i in range(E):
        for t, g in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True),
                        strict=True):
            t += g
            S += float(g.square().sum())
    T = float(sum(t.square().sum() for t in total))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure(model, (x, y), per_class, chunk_size=E)
        got_s, got_t = report.S, report.T
        assert got_s == pytest.approx(S, rel=1e-10)
        assert got_t == pytest.approx(T, rel=1e-10)
        with pytest.raises(BatchboundError) as info, watch(model, OnlineDiversity(10)):
            per_class(model(x), y).mean().backward()
    assert f"output 1 of the model, shape ({E},), receives a gradient" in str(info.value)


def test_measuring_the_same_model_again_reuses_its_output_kinds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The outputs' kinds (two forward passes at 2 and 3 examples) are kept with the model's
    other checks: a second ``measure`` of the same model and loss does not run them again,
    and gives the same numbers."""
    import batchbound.diversity.prepared as prepared

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(12, 4), torch.randint(3, (12,))
    runs = []
    real = prepared.output_kinds
    monkeypatch.setattr(prepared, "output_kinds",
                        lambda *a, **k: runs.append(1) or real(*a, **k))
    first = measure(model, (x, y), "cross_entropy", chunk_size=5)
    second = measure(model, (x, y), "cross_entropy", chunk_size=5)
    assert len(runs) == 1
    # the first call's first chunk is summed apart (it may run again): the float32 sums
    # of the gradient differ in their last bits
    assert pytest.approx((first.S, first.T), rel=1e-6) == (second.S, second.T)
