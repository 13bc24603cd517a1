"""Which chunks the row tracker sees (``rows.RowChecks``): the first of each kind of input,
every one where the data chose rows, shapes or branches, and none of a steady model's later
chunks, whose numbers are then the fully tracked run's. A chunk that ran otherwise than its
tracked like is left to the exact fallback, and tracking resumes."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from outside_models import SwitchMoE
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import batchbound.diversity.rows as rows
from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.diversity.rows import UNTRACKED_CHANGE, RowChecks, RowTracker, chunk_key

N = 64


@contextmanager
def counted() -> Iterator[list[int]]:
    """The number of row trackers made inside."""
    made = [0]
    original = rows.RowTracker

    class Counted(original):  # type: ignore[misc,valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            made[0] += 1
            super().__init__(*args, **kwargs)

    rows.RowTracker = Counted  # type: ignore[misc]
    try:
        yield made
    finally:
        rows.RowTracker = original  # type: ignore[misc]


def always_tracked(self: RowChecks, key: object, given: object, fixed: Callable,
                   weights: Callable) -> RowTracker:
    return RowTracker(given, fixed(), weights())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def data(n: int = N) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


def ce(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def test_a_steady_model_is_tracked_on_its_first_chunk_only() -> None:
    x, y = data()
    with counted() as made:
        report = measure(mlp(), (x, y), ce, chunk_size=8)
    assert made[0] == 1
    loop = measure(mlp(), (x, y), ce, chunk_size=8, engine="loop")
    assert pytest.approx(loop.S, rel=1e-12) == report.S
    assert pytest.approx(loop.T, rel=1e-12) == report.T


def test_untracked_and_tracked_runs_agree_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    x, y = data()
    untracked = measure(mlp(), (x, y), ce, chunk_size=8)
    monkeypatch.setattr(RowChecks, "tracker", always_tracked)
    tracked = measure(mlp(), (x, y), ce, chunk_size=8)
    assert (untracked.S, untracked.T, untracked.loss) == (tracked.S, tracked.T, tracked.loss)


def test_a_float_a_schedule_changes_on_every_step_is_the_same_program() -> None:
    """An exponent the training loop anneals from step to step (a float the power's node
    saves) combines no other entries: the later steps are the first one's program (no
    fallback, no warning, no tracker), while the dimensions and sizes an operation saves
    are compared (tests/unit/test_outside_models.py: ``h.mean(0)`` for ``h.mean(-1)`` is
    refused)."""

    class Annealed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)
            self.gamma = 1.0

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.sigmoid(self.a(x)) ** self.gamma)

    x, y = data()
    torch.manual_seed(0)
    model, monitor = Annealed().double(), OnlineDiversity()
    with counted() as made, warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(4):
            model.gamma = 1.0 + 0.1 * step
            model.zero_grad()
            with watch(model, monitor):
                nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    assert made[0] == 1


def test_the_signature_keeps_integers_and_the_kind_of_a_float() -> None:
    """Which node type was seen first (an integer exponent or a float one) changes nothing:
    integers count by value (a dimension), floats by kind."""
    from batchbound.diversity.graph import walk

    def signature(f: Callable[[Tensor], Tensor]) -> tuple[object, ...]:
        x = torch.randn(4, 3, requires_grad=True)
        return rows.graph_structure(walk([f(x).sum().grad_fn])[0])

    for first in (2, 0.5):
        rows._CANONICAL.clear()
        rows._ARGUMENTS.clear()
        signature(lambda x, e=first: x.abs() ** e)
        assert signature(lambda x: x.abs() ** 0.5) == signature(lambda x: x.abs() ** 0.7)
        assert signature(lambda x: x.abs() ** 2) != signature(lambda x: x.abs() ** 3)
        assert signature(lambda x: x.abs() ** 2) != signature(lambda x: x.abs() ** 0.5)
        assert signature(lambda x: x.mean(0)) != signature(lambda x: x.mean(-1))
        assert signature(lambda x: x.softmax(0)) != signature(lambda x: x.softmax(1))


def test_a_chunk_of_another_shape_is_tracked() -> None:
    x, y = data(60)  # 8 chunks of 7 and one of 4
    with counted() as made:
        measure(mlp(), (x, y), ce, chunk_size=7)
    assert made[0] == 2


def test_rows_chosen_by_the_data_keep_every_chunk_tracked() -> None:
    torch.manual_seed(0)
    model = SwitchMoE().double()
    x = torch.randn(24, 5, 8, dtype=torch.float64)
    y = torch.randint(0, 4, (24,))
    with counted() as made, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the routed experts' exact fallback
        measure(model, (x, y), ce, chunk_size=4)
    assert made[0] == 6


def test_a_branch_on_the_examples_values_keeps_every_chunk_tracked() -> None:
    class Branching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x: Tensor) -> Tensor:
            # bool(): a Python branch on a value of the weights (as the examples', unseen
            # by the autograd graph), which may change between chunks
            return self.a(x) if bool(self.a.weight.sum() > -1e9) else self.b(x)

    torch.manual_seed(0)
    x, y = data()
    with counted() as made, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measure(Branching().double(), (x, y), ce, chunk_size=8)
    assert made[0] == 8


def test_a_branch_on_the_ids_alone_does_not() -> None:
    class PackedCheck(nn.Module):
        """Hugging Face's check for packed sequences: a bool read back from the position ids,
        which come from the integer inputs, not from the examples' values."""

        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)

        def forward(self, ids: Tensor) -> Tensor:
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            packed = not bool((positions[:, -1] == 0).all())
            return self.head(self.emb(ids).mean(1) if packed else self.emb(ids).sum(1))

    torch.manual_seed(0)
    ids = torch.randint(1, 20, (32, 5))
    y = torch.randint(0, 3, (32,))
    with counted() as made:
        measure(PackedCheck().double(), (ids, y), ce, chunk_size=8)
    assert made[0] == 1


class Drifting(nn.Module):
    """Once ``drift`` is set, routes its tokens through ``fc2`` sorted by a value across the
    batch and puts them back (a mixture of experts' dispatch): the layers' calls and their
    shapes are the same either way; the state that switches it is no operation's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.drift = False

    def forward(self, x: Tensor) -> Tensor:  # (n, T, 6)
        h = torch.tanh(self.fc(x))
        n, t, d = h.shape
        if self.drift:
            flat = h.reshape(n * t, d)
            order = flat[:, 0].argsort()
            out = self.fc2(flat[order].reshape(n, t, d)).reshape(n * t, d)
            h = out[order.argsort()].reshape(n, t, d)
        else:
            h = self.fc2(h)
        return self.head(torch.tanh(h).mean(1))


class WarmRouted(nn.Module):
    """A router's warm-up: tokens in a fixed order (``arange``) until ``warm`` is set, then
    sorted by a value; both through ``index_select``, so the autograd graph is the same."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.expert, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.drift = False

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        n, t, d = h.shape
        flat = h.reshape(n * t, d)
        order = flat[:, 0].argsort() if self.drift else torch.arange(n * t)
        out = self.expert(flat.index_select(0, order).reshape(n, t, d)).reshape(n * t, d)
        return self.head(torch.tanh(out.index_select(0, order.argsort()).reshape(n, t, d))
                         .mean(1))


class WarmRoutedIds(WarmRouted):
    """The warm-up on an embedding of token ids: everything after it is the examples' values
    too, not the weights' (a tracker once counted an embedding's output as a weight's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6)

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(self.emb(ids))


class HeldOrder(WarmRouted):
    """The warm-up's order held as a plain tensor attribute, made outside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.order = torch.arange(40)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        n, t, d = h.shape
        flat = h.reshape(n * t, d)
        order = flat[:, 0].argsort() if self.drift else self.order[: n * t]
        out = self.expert(flat.index_select(0, order).reshape(n, t, d)).reshape(n * t, d)
        return self.head(torch.tanh(out.index_select(0, order.argsort()).reshape(n, t, d))
                         .mean(1))


def tokens_data(n: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(n, 5, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g))


class Drives(Dataset):
    """Examples (``tokens_data``, or token ids where ``ids``) that set the model drifting
    from example ``start`` on: a DataLoader reads them chunk by chunk, as measure runs."""

    def __init__(self, model: nn.Module, start: int, ids: bool = False) -> None:
        self.model, self.start = model, start
        self.x, self.y = tokens_data(32)
        if ids:
            self.x = torch.randint(0, 20, (32, 5), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if i >= self.start:
            self.model.drift = True
        return self.x[i], self.y[i]


def drifting_run(model: type[nn.Module], start: int, engine: str = "auto"
                 ) -> tuple[float, float, list[str]]:
    torch.manual_seed(0)
    net = model().double()
    data = Drives(net, start, ids=model is WarmRoutedIds)
    loader = DataLoader(data, batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = measure(net, loader, ce, engine=engine)
    return report.S, report.T, [str(w.message) for w in caught]


@pytest.mark.parametrize("start", [8, 16])  # the first untracked chunk, or the next
def test_a_chunk_that_ran_otherwise_is_left_to_the_exact_fallback(start: int) -> None:
    S, T, said = drifting_run(Drifting, start)
    assert any(UNTRACKED_CHANGE in s for s in said)
    loop_S, loop_T, _ = drifting_run(Drifting, start, "loop")
    assert pytest.approx(loop_S, rel=1e-10) == S
    assert pytest.approx(loop_T, rel=1e-10) == T


@pytest.mark.parametrize("model", [WarmRouted, WarmRoutedIds, HeldOrder])
def test_positions_read_beside_the_examples_values_keep_every_chunk_tracked(
        model: type[nn.Module]) -> None:
    # the warm-up's arange and the later argsort make the same graph: only a tracker sees
    # which one chose the rows, so a model that indexes its activations is always tracked
    with counted() as made:
        S, T, _ = drifting_run(model, 16)
    assert made[0] == 4
    loop_S, loop_T, _ = drifting_run(model, 16, "loop")
    assert pytest.approx(loop_S, rel=1e-10) == S
    assert pytest.approx(loop_T, rel=1e-10) == T


@pytest.mark.parametrize("read", ["tolist", "numpy"])
def test_values_read_into_python_without_an_operation_make_a_chunk_unsteady(read: str) -> None:
    # tolist() and numpy() copy no ATen operation's result: Python could branch on the
    # examples' values unseen, so the tracker notes them (a read of the ids is not such)
    x, ids = torch.randn(4, 3), torch.randint(0, 5, (4, 3))
    before = getattr(torch.Tensor, read)
    for tensor, unsteady in ((ids, False), (x, True)):
        rows = RowTracker((x, ids))
        with rows:
            getattr((tensor + 1).detach(), read)()
        assert (rows.unsteady is not None) == unsteady, rows.unsteady
    assert getattr(torch.Tensor, read) == before  # the wrapped methods are put back


def test_a_models_keyword_ids_choose_nothing() -> None:
    class Keyed(nn.Module):  # called as model(**batch), Hugging Face's way
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)

        def forward(self, input_ids: Tensor, attention_mask: Tensor,
                    labels: Tensor | None = None) -> Tensor:
            if bool(attention_mask.all()):  # a read of the mask: the ids', not the values'
                return self.head(self.emb(input_ids).mean(1))
            return self.head((self.emb(input_ids) * attention_mask[..., None]).sum(1))

    torch.manual_seed(0)
    ids = torch.randint(1, 20, (32, 5))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.randint(0, 3, (32,))}

    def loss(outputs: Tensor, batch: dict) -> Tensor:
        return ce(outputs, batch["labels"])

    with counted() as made:
        measure(Keyed().double(), batch, loss, chunk_size=8)
    assert made[0] == 1


def test_the_key_follows_shapes_flags_and_autocast() -> None:
    x = torch.zeros(4, 3)
    base = chunk_key(((x,), {"flag": True}), training=False)
    assert base == chunk_key(((torch.ones(4, 3),), {"flag": True}), training=False)
    assert base != chunk_key(((torch.zeros(5, 3),), {"flag": True}), training=False)
    assert base != chunk_key(((x,), {"flag": False}), training=False)
    assert base != chunk_key(((x,), {"flag": True}), training=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert base != chunk_key(((x,), {"flag": True}), training=False)


def watched_steps(model: nn.Module, steps: int, autocast: bool = False) -> OnlineDiversity:
    monitor = OnlineDiversity()
    x, y = data(16)
    if autocast:
        x = x.float()
    for k in range(steps):
        model.zero_grad(set_to_none=True)
        with watch(model, monitor, reduction="sum"):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x[:8] if k % 2 else x[8:])
            ce(out.float(), y[:8] if k % 2 else y[8:]).sum().backward()
    return monitor


def test_watch_tracks_its_first_step_only_and_keeps_the_numbers() -> None:
    with counted() as made:
        monitor = watched_steps(mlp(), 5)
    assert made[0] == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RowChecks, "tracker", always_tracked)
        tracked = watched_steps(mlp(), 5)
    assert monitor.to_dict() == tracked.to_dict()


def test_watch_states_the_tracked_steps_precision_on_untracked_ones() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    with counted() as made, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bfloat16 statement
        monitor = watched_steps(model, 4, autocast=True)
    assert made[0] == 1
    assert monitor.precision.startswith("bfloat16")


@pytest.mark.parametrize("first", [1, 2])  # the first untracked step, or the next
def test_watch_leaves_a_step_that_ran_otherwise_to_the_fallback(first: int) -> None:
    """Also now that watch checks each program on its own step's examples: that check, on
    a few examples, does not see the rows a sort across the batch moves (S 6 % off)."""
    def steps(tracked: bool) -> tuple[list, list[str]]:
        torch.manual_seed(0)
        model, monitor = Drifting().double(), OnlineDiversity()
        x, y = tokens_data(8)
        values, said = [], []
        with pytest.MonkeyPatch.context() as patch:
            if tracked:
                patch.setattr(RowChecks, "tracker", always_tracked)
            for k in range(4):
                model.drift = k >= first  # set between steps, by nothing the tracker sees
                model.zero_grad(set_to_none=True)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with watch(model, monitor, reduction="sum"):
                        ce(model(x), y).sum().backward()
                said += [str(w.message) for w in caught]
                values += monitor.last
        return values, said

    values, said = steps(tracked=False)
    assert any(UNTRACKED_CHANGE in s for s in said)
    tracked, _ = steps(tracked=True)
    assert values == pytest.approx(tracked, rel=1e-12)


class OneHotDispatch(nn.Module):
    """Tokens routed by a float one-hot matrix of a sort of the raw inputs (``P @ tokens``),
    and back; no state. The tracker lost the positions at the cast to float, and the
    per-example loop's check on the first chunk passes where that chunk is sorted already."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.expert, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        flat = torch.tanh(self.fc(x)).reshape(n * t, -1)
        route = nn.functional.one_hot(x[..., 0].reshape(-1).argsort(), n * t).to(flat.dtype)
        out = self.expert((route @ flat).reshape(n, t, -1)).reshape(n * t, -1)
        return self.head(torch.tanh((route.t() @ out).reshape(n, t, -1)).mean(1))


def test_rows_moved_by_a_one_hot_matrix_of_data_chosen_positions_are_seen() -> None:
    x, y = tokens_data(32)
    x[:8, :, 0] = torch.linspace(-3, 3, 40, dtype=torch.float64).reshape(8, 5)  # sorted
    reports = []
    for engine in ("auto", "loop"):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the moved layers' exact fallback
            reports.append(measure(OneHotDispatch().double(), (x, y), ce, chunk_size=8,
                                   engine=engine))
    assert pytest.approx(reports[1].S, rel=1e-10) == reports[0].S  # was 8.8 % off



def test_a_hugging_face_models_own_loss_does_not_track_every_step() -> None:
    """Called with its labels, a Hugging Face model computes its loss inside the forward:
    the negative log-likelihood reads the labels beside the logits. Its target picks a
    class inside each row, never another row, so the steps stay steady (every one was
    tracked), and the numbers are the per-example loop's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(3))
    monitor = OnlineDiversity()
    with counted() as made:
        for _ in range(4):
            model.zero_grad()
            with watch(model, monitor):
                model(input_ids=ids, labels=ids).loss.backward()
    assert made[0] == 1

    def loss(out: object, batch: dict) -> Tensor:
        logits = out.logits[:, :-1]  # type: ignore[attr-defined]
        return nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:],
                                           reduction="none").mean(1)

    batch = {"input_ids": torch.randint(0, 50, (32, 8), generator=torch.Generator()
                                        .manual_seed(4))}
    batch["labels"] = batch["input_ids"]
    with counted() as made:
        report = measure(model, batch, loss, chunk_size=8)
    assert made[0] == 1
    exact = measure(model, batch, loss, chunk_size=8, engine="loop")
    assert pytest.approx(exact.S, rel=1e-5) == report.S
    assert pytest.approx(exact.T, rel=1e-5) == report.T


class SkipsAFullMask(nn.Module):
    """As transformers does: an attention mask without padding is dropped, and the
    forward runs another program (no multiplication by the mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x))
        if not bool(mask.all()):  # of the integer inputs: no example's values
            h = h * mask[..., None]
        return self.head(h.sum(1))


@pytest.mark.parametrize(("padded", "trackers"), [((0, 3, 5), 2), ((0, 2, 4), 3)])
def test_a_second_program_is_learned_not_tracked_for_good(
        padded: tuple[int, ...], trackers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks with padding and without: the first chunk without runs another program (the
    exact fallback, a warning); chunks are tracked until one runs it again, and it is
    remembered; every later chunk of either kind runs untracked. Padded in turn (the
    second row), a tracked padded chunk does not end the wait: that padding-free chunks
    went to the fallback every other chunk."""
    x, y = tokens_data(48)
    mask = torch.ones(48, 5, dtype=torch.long)
    for chunk in padded:  # of the 6 chunks
        mask[chunk * 8 : chunk * 8 + 8, 3:] = 0
    pairs = [((x[i], mask[i]), y[i]) for i in range(48)]
    torch.manual_seed(0)
    model = SkipsAFullMask().double()
    compared: list[bool] = []
    same = RowChecks.same
    monkeypatch.setattr(RowChecks, "same", lambda self, *args: compared.append(
        same(self, *args)) or compared[-1])
    with counted() as made, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = measure(model, DataLoader(pairs, batch_size=8), ce)
    assert made[0] == trackers
    assert compared.count(False) == 1  # one chunk to the fallback
    assert sum(UNTRACKED_CHANGE in str(w.message) for w in caught) == 1
    exact = measure(model, DataLoader(pairs, batch_size=8), ce, engine="loop")
    assert pytest.approx(exact.S, rel=1e-12) == report.S
    assert pytest.approx(exact.T, rel=1e-12) == report.T
