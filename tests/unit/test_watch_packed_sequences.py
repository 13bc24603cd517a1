"""A GRU over packed sequences whose per-token outputs are padded back with
``pad_packed_sequence`` and no ``total_length``: the padded length is the longest sequence
in the batch. ``watch``'s check (a stand-in loss over the outputs, the batch beside each
example alone) then compares an output of shape (6, 7, 11) with one of (1, 3, 11), whose
padding differs, and refused as "the examples interact", which they do not: with a loss that
leaves the padding out, ``measure`` equals the float64 per-example loop. The refusal now
names the padding and what to do; with ``total_length`` watch equals the loop.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader

from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.errors import BatchboundError

N, LENGTH, VOCAB = 6, 7, 11
LENGTHS = torch.tensor([3, 2, 5, 4, 7, 1])


class Packed(nn.Module):
    def __init__(self, total_length: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn = nn.Embedding(VOCAB, 6), nn.GRU(6, 7, batch_first=True)
        self.out, self.total_length = nn.Linear(7, VOCAB), total_length

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.emb(tokens), lengths, batch_first=True,
                                      enforce_sorted=False)
        h, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True,
                                   total_length=self.total_length)
        return self.out(h)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return (torch.randint(0, VOCAB, (N, LENGTH), generator=g),
            torch.randint(0, VOCAB, (N, LENGTH), generator=g))


def token_loss(out: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per example: the cross entropy summed over its own tokens (the padding left out)."""
    T = out.shape[1]
    per = F.cross_entropy(out.transpose(1, 2), targets[:, :T], reduction="none")
    return (per * (torch.arange(T) < lengths[:, None]).to(per.dtype)).sum(1)


def loop(model: nn.Module, lengths: torch.Tensor = LENGTHS) -> tuple[float, float]:
    """S and T from the float64 per-example loop (one backward per example)."""
    tokens, targets = data()
    params = [p for p in model.parameters() if p.requires_grad]
    losses = token_loss(model(tokens, lengths), targets, lengths)
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(N):
        for t, g in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True,
                                                   materialize_grads=True), strict=True):
            t += g
            S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


def watched(model: nn.Module, lengths: torch.Tensor = LENGTHS) -> OnlineDiversity:
    tokens, targets = data()
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(model, monitor):
            token_loss(model(tokens, lengths), targets, lengths).mean().backward()
    model.zero_grad()
    return monitor


def test_watch_names_a_padding_to_the_batchs_longest_sequence() -> None:
    with pytest.raises(BatchboundError) as info:
        watched(Packed(None).double())
    said = str(info.value)
    assert said.startswith(f"watch(): output 0 of the model has shape ({N}, {LENGTH}, {VOCAB})")
    assert "its dimension 1 follows the batch" in said and "total_length" in said
    assert "interact" not in said and "\n" not in said


@pytest.mark.parametrize("lengths", [LENGTHS.tolist(), [7, 7, 6, 4, 7, 1], [7, 6, 5, 4, 7, 1]])
def test_with_total_length_watch_equals_the_loop(lengths: list[int]) -> None:
    """Whatever the first three examples' lengths: where the third ended before the first two
    (7, 7, 6: 2 rows run the last step at 2 examples and at 3), or they came sorted as a
    bucketing loader gives them, the last step's state was taken for a quantity of the
    batch, read from the whole state at 2 examples and from a narrow of it at 3, and watch
    refused the model (an outside review)."""
    model = Packed(LENGTH).double()
    S, T = loop(model, torch.tensor(lengths))
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, T, N)
    got = watched(model, torch.tensor(lengths))
    assert got.m2 == pytest.approx(want.m2, rel=1e-10)
    assert got.cross == pytest.approx(want.cross, rel=1e-9)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
def test_measure_equals_the_loop_without_total_length() -> None:
    """What the refusal points to: the padding that follows the batch is exact there."""
    model = Packed(None).double()
    S, T = loop(model)
    tokens, targets = data()
    rows = [((tokens[i], LENGTHS[i]), torch.cat([targets[i], LENGTHS[i : i + 1]]))
            for i in range(N)]
    report = measure(model, DataLoader(rows, batch_size=N), lambda out, t: token_loss(
        out, t[:, :LENGTH], t[:, LENGTH]), chunk_size=N)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(S, rel=1e-10)
    assert got_t == pytest.approx(T, rel=1e-10)
