"""Operations that mix the examples along the one dimension they lie on, keeping its shape
(pairing._mixes): a cumsum, a sort, a softmax over the examples. Switched on by the data
after the first chunk, each came back silently before, S 5–271 % off the in-batch value."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from reference import loop_gradients
from torch import Tensor, nn

from batchbound.diversity import OnlineDiversity, measure, per_example_stats, watch
from batchbound.diversity.pairing import OpShapes, joining
from batchbound.diversity.rule_check import output_kinds
from batchbound.errors import BatchboundError

D, CLASSES = 5, 3

MIXES: dict[str, Callable[[Tensor], Tensor]] = {
    "cumsum": lambda h: h.cumsum(0),
    "sort": lambda h: h.sort(0).values,
    "flip": lambda h: h.flip(0),
    "roll": lambda h: h.roll(1, 0),
    "cummax": lambda h: h.cummax(0).values,
    "logcumsumexp": lambda h: h.logcumsumexp(0),
    "softmax over the examples": lambda h: h.softmax(0),
    "in place": lambda h: h.clone().cumsum_(0),
    "differences of neighbours": lambda h: torch.cat([h[:1], h[1:] - h[:-1]]),
    "sums into pairs": lambda h: torch.zeros_like(h).index_add(
        0, torch.arange(len(h)) // 2, h),
    "sums into a buffer of zeros": lambda h: torch.zeros(len(h), 8, dtype=h.dtype).index_add(
        0, torch.arange(len(h)) // 2, h),
    "flip beside a mask's -1e9": lambda h: torch.cat([h, torch.full_like(h[:, :1], -1e9)],
                                                     1).flip(0)[:, :-1],
}


class Gated(nn.Module):
    """Adds ``mix(h)`` to the examples whose first column is 1 (0 in the first chunk)."""

    def __init__(self, mix: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b, self.mix = nn.Linear(D, 8), nn.Linear(8, CLASSES), mix

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x[:, 1:]))
        return self.b(h + x[:, :1] * self.mix(h))


def data(n: int = 32, flagged_from: int | None = 8) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D + 1, generator=g, dtype=torch.float64)
    x[:, 0] = 0.0
    if flagged_from is not None:
        x[flagged_from:, 0] = 1.0
    return x, torch.randint(0, CLASSES, (n,), generator=g)


class GatedBefore(Gated):
    """The flag zeroes the rows before they are mixed: the first chunk's rows are zeros."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x[:, 1:]))
        return self.b(h + self.mix(x[:, :1] * h))


@pytest.mark.parametrize("gate", [Gated, GatedBefore], ids=["flag after", "flag before"])
@pytest.mark.parametrize("mix", MIXES.values(), ids=MIXES.keys())
def test_rows_mixed_after_the_first_chunk_are_refused(mix: Callable[[Tensor], Tensor],
                                                      gate: type[Gated]) -> None:
    x, y = data()
    # a softmax over the examples mixes even zeros (1/n each): the first chunk's check sees it
    with pytest.raises(BatchboundError, match=r"on the chunk from example 8, the examples "
                       r"interact.*data joined them|^the examples interact"):
        measure(gate(mix).double().eval(), (x, y), "cross_entropy", chunk_size=8)


@pytest.mark.parametrize("name", ["cumsum", "softmax over the examples"])
def test_a_mixing_forward_whose_data_never_mixes_is_exact(name: str) -> None:
    """Checked apart on every chunk, and measured where no chunk's data mixes the rows."""
    model = Gated(MIXES[name]).double().eval()
    x, y = data(24, flagged_from=None)
    got = measure(copy.deepcopy(model), (x, y), "cross_entropy", chunk_size=8)
    g = loop_gradients(model, x, y, lambda o, t: F.cross_entropy(o, t, reduction="none"))
    S, T = float(g.square().sum()), float(g.sum(0).square().sum())
    assert abs(got.S - S) <= 1e-9 * S and abs(got.T - T) <= 1e-9 * S


def test_the_reason_names_the_operation_and_its_dimension() -> None:
    x, _ = data(8)
    kinds = output_kinds(Gated(MIXES["cumsum"]).double(), x, {})
    assert kinds.paired
    assert kinds.joins == ("its forward pass mixes the examples' rows (cumsum, along dimension "
                           "0 of a tensor of shape (3, 8) at 3 examples: an example's row run "
                           "alone differs from its row in the batch)")


class FeatureSoftmax(nn.Module):
    """A softmax over 3 features, and a sort over a sequence of 3 steps: at a batch of 3,
    a dimension of 3 beside the examples', which does not grow with them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x.view(len(x), 3, D)).softmax(-1)
        return h.sort(1).values.flatten(1)


class CausalHead(nn.Module):
    """Attention over 3 steps masked by a fixed lower triangle, and the last unpadded step
    found as Hugging Face's sequence classifiers do (``(arange(T) * mask).argmax(-1)``):
    integers of the steps' length, broadcast along the steps, not the examples."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(D, D), nn.Linear(D, CLASSES)
        self.register_buffer("tril", torch.tril(torch.ones(3, 3)))

    def forward(self, x: Tensor) -> Tensor:
        h = x.view(len(x), 3, D)
        w = (self.q(h) @ h.transpose(1, 2)).masked_fill(self.tril == 0, float("-inf"))
        h = w.softmax(-1) @ h
        last = (torch.arange(3) * (h[..., 0] > -9).int()).argmax(-1)
        return self.out(h[torch.arange(len(x)), last] * torch.tensor([1, 0, 1, 1, 0]))


class Recurrent(nn.Module):
    """An LSTM over 3 steps of the input, sequence first: its input's examples lie on
    dimension 1, its state's on dimension 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(D, 8), nn.Linear(8, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.lstm(x.view(len(x), 3, D).transpose(0, 1))[0][-1])


class SparseFeatures(nn.Module):
    """The features through a sparse tensor, whose rows are not read (and raise nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3 * D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x.to_sparse().to_dense())


@pytest.mark.parametrize("model", [FeatureSoftmax(), CausalHead(), Recurrent(),
                                   SparseFeatures()],
                         ids=["feature softmax", "causal head", "lstm", "sparse"])
def test_a_dimension_the_size_of_the_batch_by_chance_mixes_nothing(model: nn.Module) -> None:
    x = torch.randn(8, 3 * D)
    assert output_kinds(model.eval(), x, {}).joins == ""


def test_a_mixing_forward_is_refused_where_it_cannot_be_checked() -> None:
    """Dropout (train mode) draws other masks on each call: no chunk can be run apart, and
    ``watch`` checks no step; both refuse rows the forward mixes, whatever the data."""
    x, y = data(8, flagged_from=None)
    model = nn.Sequential(nn.Dropout(0.1), Gated(MIXES["cumsum"])).double().train()
    with pytest.raises(BatchboundError, match=r"mixes the examples' rows \(cumsum.*other "
                                              r"outputs on each call in this mode"):
        per_example_stats(model, x, y, "cross_entropy")
    model = Gated(MIXES["cumsum"]).double()
    with (pytest.raises(BatchboundError, match=r"watch\(\): its forward pass mixes the "
                                               r"examples' rows \(cumsum"),
          warnings.catch_warnings(), watch(model, OnlineDiversity())):
        warnings.simplefilter("ignore")
        F.cross_entropy(model(x), y).backward()


def test_a_loss_that_mixes_rows_is_split_on_every_chunk() -> None:
    """Each example's loss plus its predecessor's where the target says so (none in the
    first chunk)."""
    def chained(out: Tensor, t: Tensor) -> Tensor:
        own = F.cross_entropy(out, t[:, 0], reduction="none")
        return own + t[:, 1].to(out.dtype) * own.roll(1, 0)

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, CLASSES)).double()
    x = torch.randn(24, D, dtype=torch.float64)
    y = torch.stack([torch.randint(0, CLASSES, (24,)), (torch.arange(24) >= 12).long()], 1)
    with pytest.raises(BatchboundError, match=r"on the chunk from example 8, the loss of a "
                                              r"part of its examples is not their loss in the "
                                              r"whole chunk \(the loss mixes the examples' "
                                              r"rows \(roll"):
        measure(model, (x, y), chained, chunk_size=8)


def test_rows_are_read_below_the_modes_around_the_recording() -> None:
    """The operations run again on each row alone are not seen by a dispatch mode the
    recording sits inside (another check's, a user's): it sees the forward's own."""
    seen: list[str] = []

    class Names(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    h = torch.randn(3, 4, dtype=torch.float64)
    with Names(), OpShapes(h, 3, replay_rows=True) as recorded:
        h.cumsum(0)
    assert seen == ["cumsum"]
    assert recorded.ops[0].mixes == frozenset({(0, 0)})
    part = h[:2]
    small = OpShapes(part, 2, replay_rows=True)
    with small:
        part.cumsum(0)
    assert joining(small.ops, recorded.ops, (2, 3)).paired
