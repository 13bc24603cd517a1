"""Examples the forward pairs only where the data says so (pairing.py): seen by shape at two
batch sizes, then every chunk checked by value, apart; exact where no chunk pairs them."""

from __future__ import annotations

import copy
import itertools
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from reference import loop_gradients
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

from batchbound.diversity import OnlineDiversity, measure, per_example_stats, watch
from batchbound.diversity.calls import Inputs
from batchbound.diversity.losses import bit_halves, split_gap
from batchbound.diversity.pairing import Joined, OpShapes, joining, written_in_place
from batchbound.diversity.rule_check import output_kinds
from batchbound.errors import BatchboundError

D, CLASSES = 6, 3


class GroupAttention(nn.Module):
    """Each example attends to the examples of its group in the batch (the group id is the
    input's last column): alone where every group differs, paired where two share one."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.out = nn.Linear(D, CLASSES)

    def forward(self, inp: Tensor) -> Tensor:
        x, group = inp[:, :-1], inp[:, -1]
        scores = (self.q(x) @ self.k(x).T).masked_fill(group[:, None] != group[None, :],
                                                        float("-inf"))
        return self.out(torch.tanh(scores.softmax(-1) @ self.v(x)) + x)


class NearestNeighbour(nn.Module):
    """Adds the nearest other example of the batch within a radius that the data sets."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, CLASSES)

    def forward(self, inp: Tensor) -> Tensor:
        x, radius = inp[:, :-1], inp[:, -1]
        h = self.a(x)
        far = torch.cdist(h, h) > radius[:, None]
        near = (~far).to(h.dtype) - torch.eye(len(h), dtype=h.dtype)
        return self.b(torch.tanh(h + near.clamp(min=0) @ h))


class GatedMean(nn.Module):
    """Adds the batch's mean to the examples the data flags (last column ≥ 100)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.v, self.b = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, CLASSES)

    def forward(self, inp: Tensor) -> Tensor:
        h, flag = torch.tanh(self.a(inp[:, :-1])), (inp[:, -1] >= 100).to(inp.dtype)
        return self.b(h + flag[:, None] * self.v(h).mean(0))


class NullKeyAttention(GroupAttention):
    """Group attention with a zero key and value to attend to (an attention sink): the
    scores are n × (n + 1), no tensor is n × n."""

    def forward(self, inp: Tensor) -> Tensor:
        x, group = inp[:, :-1], inp[:, -1]
        zero = x.new_zeros(1, D)
        k, v = torch.cat([self.k(x), zero]), torch.cat([self.v(x), zero])
        keys = torch.cat([group, group.new_full((1,), -1.0)])
        apart = (group[:, None] != keys[None, :]) & (keys[None, :] >= 0)
        scores = (self.q(x) @ k.T).masked_fill(apart, float("-inf"))
        return self.out(torch.tanh(scores.softmax(-1) @ v) + x)


class TwoViews(GroupAttention):
    """Two views of each example side by side in one batch of 2n, attending by group."""

    def forward(self, inp: Tensor) -> Tensor:
        x, group = inp[:, :-1], inp[:, -1]
        both, groups = torch.cat([x, x.flip(1)]), torch.cat([group, group])
        scores = (self.q(both) @ self.k(both).T).masked_fill(
            groups[:, None] != groups[None, :], float("-inf"))
        out = torch.tanh(scores.softmax(-1) @ self.v(both))
        return self.out(out[: len(x)] + out[len(x):])


class SequenceOfExamples(GroupAttention):
    """The batch laid out as one sequence for fused attention, groups kept apart by a sharp
    code of the group id: no tensor of the pairs, and no mask, to see."""

    def forward(self, inp: Tensor) -> Tensor:
        x, group = inp[:, :-1], inp[:, -1]
        code = torch.cat([torch.cos(group[:, None] * torch.arange(1, 5, dtype=x.dtype)),
                          torch.sin(group[:, None] * torch.arange(1, 5, dtype=x.dtype))], 1)
        q = torch.cat([self.q(x), 12 * code], 1)[None, None]
        v = torch.cat([self.v(x), torch.zeros_like(code)], 1)[None, None]
        attended = F.scaled_dot_product_attention(q, q, v)[0, 0, :, :D]
        return self.out(torch.tanh(attended) + x)


class PackedLSTM(nn.Module):
    """A padded batch packed by length: the last steps hold the longest sequences' rows
    alone, as many at 2 examples as at 3, read back into the examples' rows, though the
    examples stay apart."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.out = nn.LSTM(D, 5, batch_first=True), nn.Linear(5, CLASSES)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.out(self.lstm(packed)[1][0][-1])


class FrozenEncoderProbe(nn.Module):
    """A frozen nn.TransformerEncoder under a trainable linear probe: in eval mode with a
    padding mask torch runs it on nested tensors, whose shapes cannot be read."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
                                         1, enable_nested_tensor=True)
        self.enc.requires_grad_(False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        h = self.enc(x, src_key_padding_mask=pad)
        keep = (~pad).to(h.dtype)[..., None]
        return self.head((h * keep).sum(1) / keep.sum(1))


class TrimmedCausal(nn.Module):
    """Trims the padding to the chunk's longest sequence (lengths 3, 6, 8: (2, 6, d) then
    (3, 8, d) at the probe's sizes), a causal mask from ``ones_like`` of one score matrix,
    and one example's row kept for a printout: each example on its own throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qk, self.out = nn.Embedding(30, 8), nn.Linear(8, 8), nn.Linear(8, CLASSES)
        self.sample: Tensor | None = None

    def forward(self, ids: Tensor, lengths: Tensor) -> Tensor:
        h = self.emb(ids[:, : int(lengths.max())])
        self.sample = h[0].detach()
        scores = self.qk(h) @ h.transpose(1, 2)
        causal = torch.ones_like(scores[0]).tril().bool()
        h = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ h
        mask = torch.arange(h.shape[1]) < lengths[:, None]
        return self.out((h * mask[..., None]).sum(1) / lengths[:, None])


def grouped(n: int, shared_from: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Examples whose groups all differ before ``shared_from``, and repeat from there on."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    group = torch.arange(n, dtype=torch.float64)
    group[shared_from:] = torch.randint(0, 4, (n - shared_from,), generator=g).double()
    return torch.cat([x, group[:, None]], 1), torch.randint(0, CLASSES, (n,), generator=g)


def sums(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    """S and T of the float64 per-example loop, each example alone."""
    g = loop_gradients(model, x, y, lambda o, t: F.cross_entropy(o, t, reduction="none"))
    return float(g.square().sum()), float(g.sum(0).square().sum())


@pytest.mark.parametrize(("model", "said"), [
    (GroupAttention(), r"pairs the examples \(mm makes a tensor of shape \(3, 3\)"),
    (NearestNeighbour(), r"pairs the examples \(_cdist_forward makes .* \(3, 3\)"),
    (NullKeyAttention(), r"pairs the examples \(ne makes a tensor of shape \(3, 4\)"),
    (TwoViews(), r"pairs the examples \(mm makes a tensor of shape \(6, 6\)"),
    (GatedMean(), r"feeds a quantity of the whole batch back into the examples \(mean's "
                  r"output, of shape \(6,\) whatever the batch size, read by mul\)"),
    (SequenceOfExamples(), r"attends across the examples \(_scaled_dot_product_\w+ over "
                           r"sequences of 3 positions at 3 examples, 2 at 2\)"),
], ids=["group attention", "nearest neighbour", "null key", "two views", "gated mean",
        "sequence of examples"])
def test_a_forward_that_joins_examples_is_seen_by_shape(model: nn.Module, said: str) -> None:
    x, _ = grouped(8, 8)
    assert re.search(said, output_kinds(model.double(), x, dict(model.named_parameters())).joins)


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(D + 1, 8), nn.ReLU(), nn.Linear(8, CLASSES)),
    # attention over each example's own positions, with as many positions as probe examples
    lambda: nn.TransformerEncoderLayer(D + 1, 1, 8, dropout=0.0, batch_first=True),
    lambda: GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=8, n_layer=1, n_head=2,
                                       n_positions=8)),
    lambda: FrozenEncoderProbe(),
    lambda: TrimmedCausal(),
    lambda: MixtralForCausalLM(MixtralConfig(
        vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2)),
], ids=["mlp", "attention within examples", "gpt-2 with padding", "frozen encoder",
        "trimmed causal", "mixtral"])
def test_a_forward_that_keeps_examples_apart_joins_none(build: Callable[[], nn.Module]) -> None:
    model = build().eval()
    model = model if isinstance(model, MixtralForCausalLM) else model.double()  # float32 alone
    g = torch.Generator().manual_seed(0)
    x: Tensor | Inputs = {
        nn.TransformerEncoderLayer: lambda: torch.randn(8, 3, D + 1, dtype=torch.float64),
        GPT2LMHeadModel: lambda: Inputs((torch.randint(0, 50, (8, 6), generator=g),), {
            "attention_mask": (torch.arange(6) < torch.tensor([6, 4, 5, 6, 2, 6, 3, 6])[:, None]
                               ).long()}, 8),
        FrozenEncoderProbe: lambda: Inputs((torch.randn(8, 5, 8, dtype=torch.float64),
                                            torch.arange(5) >= torch.tensor(
                                                [5, 3, 5, 2, 4, 5, 1, 5])[:, None]), {}, 8),
        TrimmedCausal: lambda: Inputs((torch.randint(0, 30, (8, 8), generator=g),
                                       torch.tensor([3, 6, 8, 2, 6, 4, 7, 1])), {}, 8),
        MixtralForCausalLM: lambda: torch.randint(0, 50, (8, 6), generator=g),
    }.get(type(model), lambda: torch.randn(8, D + 1, dtype=torch.float64))()
    assert output_kinds(model, x, dict(model.named_parameters())).joins == ""


@pytest.mark.parametrize("engine", ["auto", "hooks"])
def test_examples_paired_after_the_first_chunk_are_refused(engine: str) -> None:
    """The first chunk's groups all differ, so the check against the per-example loop saw
    examples alone; S came back 1.5 % off the in-batch value, T 5.8 % off alone, silently."""
    torch.manual_seed(0)
    model = GroupAttention().double()
    x, y = grouped(48, 16)
    with pytest.raises(BatchboundError, match=r"on the chunk from example (16|24|32|40), "
                       r"the examples interact.*its forward pass pairs the examples \(mm .*and "
                       r"on this chunk the data joined them"):
        measure(model, (x, y), "cross_entropy", chunk_size=8, engine=engine)


def test_a_packed_lstm_is_checked_on_every_chunk_and_exact() -> None:
    """Seen as joining its examples (its last steps' rows), checked apart on every chunk
    (1.16× the time on 256 sequences in chunks of 32), and measured."""
    torch.manual_seed(4)
    model = PackedLSTM().double()
    x, lengths = torch.randn(24, 5, D, dtype=torch.float64), torch.randint(1, 6, (24,))
    y = torch.randint(0, CLASSES, (24,))
    pairs = [((x[i], lengths[i]), y[i]) for i in range(24)]
    assert "quantity of the whole batch" in output_kinds(
        model, Inputs((x[:8], lengths[:8]), {}, 8), dict(model.named_parameters())).joins
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LSTM's weights go to the exact fallback
        got = measure(model, torch.utils.data.DataLoader(pairs, batch_size=8), "cross_entropy")
        loop = measure(model, torch.utils.data.DataLoader(pairs, batch_size=8),
                       "cross_entropy", engine="loop")
    assert abs(got.S - loop.S) <= 1e-9 * loop.S and abs(got.T - loop.T) <= 1e-9 * loop.S


class GatedSum(GatedMean):
    """Sums the flagged examples into every example: zero on a chunk that flags none."""

    def forward(self, inp: Tensor) -> Tensor:
        h, flag = torch.tanh(self.a(inp[:, :-1])), (inp[:, -1] >= 100).to(inp.dtype)
        return self.b(h + (flag[:, None] * self.v(h)).sum(0))


@pytest.mark.parametrize("model", [GatedMean(), GatedSum(), NullKeyAttention(), TwoViews(),
                                   SequenceOfExamples()],
                         ids=["gated mean", "gated sum", "null key", "two views",
                              "sequence of examples"])
def test_examples_joined_after_the_first_chunk_are_refused(model: nn.Module) -> None:
    """Each came back silently before, S 2–7 % off (two outside reviews)."""
    torch.manual_seed(0)
    x, y = grouped(32, 8)
    x[8:, -1] = torch.where(torch.arange(24) % 2 == 0, 100.0, x[8:, -1])  # flags, groups
    with pytest.raises(BatchboundError, match=r"on the chunk from example (8|16|24), the "
                                              r"examples interact.*data joined them"):
        measure(model.double(), (x, y), "cross_entropy", chunk_size=8)


def test_a_pairing_forward_whose_data_pairs_nothing_is_exact() -> None:
    torch.manual_seed(1)
    model = GroupAttention().double()
    x, y = grouped(24, 24)  # every group differs in every chunk
    got = measure(copy.deepcopy(model), (x, y), "cross_entropy", chunk_size=8)
    S, T = sums(model, x, y)
    assert abs(got.S - S) <= 1e-9 * S and abs(got.T - T) <= 1e-9 * S


def test_a_random_pairing_forward_is_refused_in_train_mode() -> None:
    """Dropout draws other masks on the halves: no check by value (measure runs in eval
    mode; a training step's per_example_stats does not)."""
    model = nn.Sequential(nn.Dropout(0.1), GroupAttention()).double().train()
    x, y = grouped(8, 8)
    with pytest.raises(BatchboundError, match=r"pairs the examples .*other outputs on each "
                                              r"call in this mode \(dropout\?\).*eval mode"):
        per_example_stats(model, x, y, "cross_entropy")


def test_watch_refuses_a_forward_that_pairs_examples() -> None:
    model = GroupAttention().double()
    x, y = grouped(8, 8)
    with (pytest.raises(BatchboundError, match=r"watch\(\): its forward pass pairs the "
                                               r"examples.*measure\(\) checks each chunk"),
          warnings.catch_warnings(), watch(model, OnlineDiversity())):
        warnings.simplefilter("ignore")
        F.cross_entropy(model(x), y).backward()


class GatedRow(GatedMean):
    """Adds the first example's row to the examples the data flags: a row of the batch
    broadcast over it, not a mean."""

    def forward(self, inp: Tensor) -> Tensor:
        h, flag = torch.tanh(self.a(inp[:, :-1])), (inp[:, -1] >= 100).to(inp.dtype)
        return self.b(h + flag[:, None] * self.v(h)[0])


class GatedMax(GatedMean):
    def forward(self, inp: Tensor) -> Tensor:
        h, flag = torch.tanh(self.a(inp[:, :-1])), (inp[:, -1] >= 100).to(inp.dtype)
        return self.b(h + flag[:, None] * self.v(h).amax(0))


class GatedHeadMean(GatedMean):
    """The first two examples' mean, laid over the flagged ones by ``expand`` and ``cat``."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(2 * D, CLASSES)

    def forward(self, inp: Tensor) -> Tensor:
        h, flag = torch.tanh(self.a(inp[:, :-1])), (inp[:, -1] >= 100).to(inp.dtype)
        head = self.v(h)[:2].mean(0).expand(len(h), D)
        return self.b(torch.cat([h, flag[:, None] * head], 1))


GATED = [GatedMean, GatedSum, GatedRow, GatedMax, GatedHeadMean]
GATED_IDS = ["mean", "sum", "one example's row", "max", "two examples' mean, expanded"]


def flagged_later(n: int) -> tuple[Tensor, Tensor]:
    """No example flagged in the first 8, every other one after."""
    x, y = grouped(n, n)
    x[8:, -1] = torch.where(torch.arange(n - 8) % 2 == 0, 100.0, x[8:, -1])
    return x, y


@pytest.mark.parametrize("build", GATED, ids=GATED_IDS)
def test_watch_refuses_a_quantity_of_the_batch_the_data_may_switch_on(build: type) -> None:
    """The first step flags no example, so its check sees them apart; watch sees each step
    once and cannot run a later one apart: refused at the first step. Before, each gave its
    numbers for every step without a word (without the dropout, S on the first flagged step
    was 46–427 times the per-example loop's)."""
    torch.manual_seed(0)
    model = nn.Sequential(build(), nn.Dropout(0.1)).double().train()
    x, y = flagged_later(16)
    with (pytest.raises(BatchboundError, match=r"watch\(\): its forward pass feeds a quantity "
                                               r"of the whole batch back.*measure\(\) checks"),
          warnings.catch_warnings(), watch(model, OnlineDiversity())):
        warnings.simplefilter("ignore")
        F.cross_entropy(model(x[:8]), y[:8]).backward()


@pytest.mark.parametrize("build", GATED, ids=GATED_IDS)
def test_a_random_forward_feeding_back_a_batch_quantity_is_refused(build: type) -> None:
    """Dropout draws other masks on the halves: a training step's chunk cannot be checked
    by value, so such a forward is refused as a pairing one is."""
    torch.manual_seed(0)
    model = nn.Sequential(build(), nn.Dropout(0.1)).double().train()
    x, y = flagged_later(8)
    with pytest.raises(BatchboundError, match=r"feeds a quantity of the whole batch back.*"
                                              r"other outputs on each call in this mode"):
        per_example_stats(model, x, y, "cross_entropy")


def test_bit_halves_part_every_two_positions() -> None:
    for n in (2, 3, 5, 8, 13, 64):
        parts = bit_halves(n)
        assert len(parts) == 2 * max(1, (n - 1).bit_length())
        for i, j in itertools.combinations(range(n), 2):
            assert any((part == i).any() and not (part == j).any() for part in parts)


def test_the_loss_split_sees_any_two_coupled_examples() -> None:
    """A loss that couples one pair of a chunk's examples is seen wherever the pair sits
    (three fixed splits left one pair in eight together in every part)."""
    out = torch.randn(8, 3, dtype=torch.float64)
    y = torch.stack([torch.randint(0, 3, (8,)), torch.arange(8)], 1)  # class, example id
    for i, j in itertools.combinations(range(8), 2):
        def coupled(o: Tensor, t: Tensor, i: int = i, j: int = j) -> Tensor:
            own = F.cross_entropy(o, t[:, 0], reduction="none")
            pair = (t[:, 1] == i) | (t[:, 1] == j)
            return own + pair.to(o.dtype) * o[pair, 0].prod() if int(pair.sum()) == 2 else own
        gap = split_gap(coupled, out, y, coupled(out, y))
        assert gap is not None and gap > 0, (i, j)


def label_pulled(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy plus a pull towards the other examples of the chunk with its label (a
    supervised contrastive term): each example's own where the labels all differ."""
    same = (y[:, None] == y[None, :]).to(out.dtype) - torch.eye(len(y), dtype=out.dtype)
    others = same @ out / same.sum(1, keepdim=True).clamp(min=1)
    pull = (out - others).square().sum(1) * (same.sum(1) > 0)
    return F.cross_entropy(out, y, reduction="none") + pull


def test_a_loss_that_pairs_examples_is_split_on_every_chunk() -> None:
    """100 classes in chunks of 8: the first chunk's labels all differ three times in four.
    The loss was split on the first chunk only, and S came back without a word."""
    torch.manual_seed(3)
    x, y = torch.randn(32, 5, dtype=torch.float64), torch.randint(0, 100, (32,))
    y[:8], y[20] = torch.arange(8), y[17]  # labels shared in the third chunk only
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 100)).double()
    with pytest.raises(BatchboundError, match=r"on the chunk from example 16, the loss of a "
                                              r"part of its examples is not their loss"):
        measure(model, (x, y), label_pulled, chunk_size=8)
    y = torch.arange(32)  # no label shared in any chunk: each example's own loss
    got = measure(copy.deepcopy(model), (x, y), label_pulled, chunk_size=8)
    g = loop_gradients(model, x, y, label_pulled)
    S = float(g.square().sum())
    assert abs(got.S - S) <= 1e-9 * S


def test_the_first_chunks_loss_split_is_kept_with_the_models_check() -> None:
    """A second ``measure`` of the same model and loss calls the loss once per chunk: its
    first chunk's split (``split_gap``) spoke for every later chunk, of this call and the
    next; a loss that may pair the examples is still split on every chunk of every call."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 32)).double()
    x, y = torch.randn(32, 5, dtype=torch.float64), torch.randint(0, 32, (32,))
    calls = []

    def own(out: Tensor, t: Tensor) -> Tensor:
        calls.append(len(t))
        return F.cross_entropy(out, t, reduction="none")

    first = measure(model, (x, y), own, chunk_size=8)
    split = len(calls)
    calls.clear()
    again = measure(model, (x, y), own, chunk_size=8)
    assert split > 4 and calls == [8, 8, 8, 8]
    assert again.S == first.S and again.T == first.T
    y = torch.arange(32)  # no label shared: measured, and the loss's check kept
    measure(model, (x, y), label_pulled, chunk_size=8)
    y[20] = y[17]  # shared in the third chunk, on the next call
    with pytest.raises(BatchboundError, match=r"on the chunk from example 16, the loss of a "
                                              r"part of its examples is not their loss"):
        measure(model, (x, y), label_pulled, chunk_size=8)


def test_a_random_packed_lstm_is_measured_in_train_mode() -> None:
    """Dropout draws other masks on halves, so no chunk can be checked apart: a quantity of
    the batch flowing back (packed sequences' last steps) is left to the first chunk's
    check, as before, where a tensor pairing the examples is refused."""
    torch.manual_seed(5)
    model = PackedLSTM().double().train()
    model.out = nn.Sequential(nn.Dropout(0.2), model.out)
    x = Inputs((torch.randn(8, 5, D, dtype=torch.float64), torch.randint(1, 6, (8,))), {}, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LSTM's weights go to the exact fallback
        stats = per_example_stats(model, x, torch.randint(0, CLASSES, (8,)), "cross_entropy")
    assert stats.S > 0


class FreedThenConstant(nn.Module):
    """Takes the batch's mean and lets it go, then scales by a constant made on the host:
    the constant's memory is often the freed mean's (the allocator hands it back), and no
    operation shows where it came from (Longformer's global attention does so)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, CLASSES)

    def forward(self, inp: Tensor) -> Tensor:
        h = torch.tanh(self.a(inp[:, :D]))
        for _ in range(8):
            h.sum().detach()  # a quantity of the batch, read by nothing
            h = h * torch.tensor(1.0, dtype=h.dtype)
        return self.b(h)


def test_memory_freed_in_the_forward_is_not_taken_for_its_old_tensor() -> None:
    """The shapes' record knew tensors by their memory's address; a freed tensor's address,
    reused by a constant made on the host, gave the constant the freed tensor's history.
    Longformer with global attention was refused in 3–5 of 6 dropout seeds so."""
    joins_none_and_is_watched(FreedThenConstant, width=D)


class MaskedInPlace(nn.Module):
    """Multiplies a constant mask into the examples' scores in place, then uses the mask
    again, pooled (Funnel's ``cls_mask``): the mask is read there, not written."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, CLASSES)

    def forward(self, inp: Tensor) -> Tensor:
        h = torch.tanh(self.a(inp[:, :D]))
        mask = h.new_ones(D, D).tril()
        scores = h[:, :, None] * h[:, None, :]
        scores *= mask
        pooled = torch.cat([mask[:1], mask])[::2]
        return self.b(scores.sum(-1) * pooled[0])


def test_a_tensor_an_in_place_operation_only_reads_keeps_its_history() -> None:
    """``scores *= mask`` was taken to write the mask too, with the scores' history: the
    pooled mask then looked like a quantity of the batch fed back into the examples, and
    watch refused Hugging Face's Funnel, whose examples never meet."""
    a, b = torch.zeros(3), torch.ones(3)
    assert written_in_place(torch.ops.aten.mul_.Tensor, (a, b), {}) == [a]
    out = torch.empty(3)
    assert written_in_place(torch.ops.aten.add.out, (a, b), {"out": out}) == [out]
    joins_none_and_is_watched(MaskedInPlace)


def joins_none_and_is_watched(build: type, width: int = D + 1) -> None:
    """The model's shapes at 2 and 3 examples (of ``width`` numbers) show no join, and watch
    takes it with dropout."""
    ops = []
    for n in (2, 3):
        x = torch.zeros(n, width, dtype=torch.float64)
        with OpShapes(x, n) as shapes:
            build().double()(x)
        ops.append(shapes.ops)
    assert joining(*ops, (2, 3)) == Joined()
    torch.manual_seed(0)
    model = nn.Sequential(build(), nn.Dropout(0.1)).double().train()
    x, y = grouped(8, 8)
    with warnings.catch_warnings(), watch(model, OnlineDiversity()):
        warnings.simplefilter("ignore")
        F.cross_entropy(model(x), y).backward()
