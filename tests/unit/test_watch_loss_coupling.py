"""``watch`` refuses a loss that couples the batch's examples (``loss_coupling``): InfoNCE, a
batch statistic inside the loss, CLIP's two-way softmax over two outputs, before the
backward runs (``.grad`` untouched), also where the loss switches to one on a later step;
per-example losses, however written (token means, smoothing, class weights, sums), are not."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

N = 12


class Towers(nn.Module):
    """Two embeddings of each example (CLIP's image and text towers in one module)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(6, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.a(x), self.b(torch.tanh(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5))


def _x() -> Tensor:
    return torch.randn(N, 6, generator=torch.Generator().manual_seed(1))


def _infonce(z: Tensor) -> Tensor:
    z = F.normalize(z, dim=1)
    return F.cross_entropy(z @ z.T / 0.1, torch.arange(N) ^ 1)


def _centred(z: Tensor) -> Tensor:
    return ((z - z.mean(0)) ** 2).sum(1).mean()


def _softmax_over_batch(z: Tensor) -> Tensor:
    return -torch.log_softmax(z[:, 0], dim=0).mean()


COUPLED: dict[str, Callable[[Tensor], Tensor]] = {
    "infonce": _infonce, "centred": _centred, "softmax_over_batch": _softmax_over_batch}


@pytest.mark.parametrize("name", list(COUPLED))
def test_a_coupling_loss_is_refused_before_its_backward(name: str) -> None:
    model, monitor = _model(), OnlineDiversity()
    refused = pytest.raises(BatchboundError, match="couples the batch's examples")
    with refused, watch(model, monitor):
        COUPLED[name](model(_x())).backward()
    assert all(p.grad is None for p in model.parameters())


def test_clip_over_two_outputs_is_refused() -> None:
    model = Towers()
    with pytest.raises(BatchboundError, match="couples"), watch(model, OnlineDiversity()):
        a, b = model(_x())
        logits = F.normalize(a, dim=1) @ F.normalize(b, dim=1).T
        target = torch.arange(N)
        (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)).backward()


def test_a_loss_switched_to_a_coupling_one_on_a_later_step_is_refused() -> None:
    model, monitor = _model(), OnlineDiversity()
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        with watch(model, monitor):
            F.cross_entropy(model(_x()), y).backward()
    with pytest.raises(BatchboundError, match="couples"), watch(model, monitor):
        _infonce(model(_x())).backward()
    assert monitor.steps == 2


def _token_ce(out: Tensor, y: Tensor) -> Tensor:
    seq = out.reshape(N, 2, -1)  # two "positions" of 5 // ... classes each
    return F.cross_entropy(seq.reshape(-1, seq.shape[-1]), y.reshape(-1), ignore_index=0,
                           label_smoothing=0.1)


SEPARABLE: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "cross_entropy": lambda out, y: F.cross_entropy(out[:, :5], y[:, 0] % 5),
    "tokens_ignore_index_smoothing": lambda out, y: _token_ce(out[:, :4], y % 2),
    "mse_sum": lambda out, y: F.mse_loss(out, y[:, :1].double().expand(-1, out.shape[1]) / 7,
                                         reduction="sum"),
    "weighted_mean": lambda out, y: F.cross_entropy(out, y[:, 0] % 5,
                                                    weight=torch.arange(1.0, 6.0).double()),
    "linear": lambda out, y: out.sum(),
}


@pytest.mark.parametrize("name", list(SEPARABLE))
def test_per_example_losses_are_measured(name: str) -> None:
    model, monitor = _model().double(), OnlineDiversity(decay=0.0)
    y = torch.randint(0, 7, (N, 2), generator=torch.Generator().manual_seed(3))
    loss = SEPARABLE[name]
    with watch(model, monitor, reduction="sum"):
        loss(model(_x().double()), y).backward()
    assert monitor.steps == 1


class NoDoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(z)
        return (z**2).sum(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[override]
        (z,) = ctx.saved_tensors
        return 2 * z * g[:, None]


def test_a_loss_without_double_backward_is_measured_with_a_warning() -> None:
    model, monitor = _model(), OnlineDiversity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor):
            NoDoubleBackward.apply(model(_x())).mean().backward()
    assert monitor.steps == 1
    assert any("custom autograd.Function" in str(w.message) for w in caught)


class Upstream(nn.Module):
    """Returns a hidden state and the logits computed from it: a loss reading both would
    take the check's derivative through the model's head, which it stops before."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 5)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.body(x))
        return h, self.head(h)


def test_a_loss_reading_an_output_and_one_made_from_it_is_measured_exactly_unchecked() -> None:
    from training_models import loop_S_T

    model = Upstream().double()
    x = _x().double()
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(4))

    def loss(out: tuple[Tensor, Tensor], y: Tensor) -> Tensor:
        return F.cross_entropy(out[1], y, reduction="sum") + out[0].square().sum()

    S, T = loop_S_T(Upstream().double(), (x,), {}, lambda out, i: loss(out, y[i:i + 1]), N)
    monitor = OnlineDiversity(decay=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor, reduction="sum"):
            loss(model(x), y).backward()
    assert any("was not checked" in str(w.message) for w in caught)
    expected = OnlineDiversity(decay=0.0)
    expected.update_from_norms(S, T, N)
    assert monitor.last == pytest.approx(expected.last, rel=1e-9)


def test_a_loss_vector_backpropagated_with_its_gradient_is_checked() -> None:
    model, monitor = _model(), OnlineDiversity()
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor):
            losses = F.cross_entropy(model(_x()), y, reduction="none")
            losses.backward(torch.full_like(losses, 1 / N))
    assert monitor.steps == 1
    assert not any("was not checked" in str(w.message) for w in caught)
    with pytest.raises(BatchboundError, match="couples"), watch(model, monitor):
        z = F.normalize(model(_x()), dim=1)
        pairs = F.cross_entropy(z @ z.T, torch.arange(N), reduction="none")
        pairs.backward(torch.ones_like(pairs))


def test_the_check_runs_no_node_of_the_model() -> None:
    """A user's backward hook on the head (and the rules' hooks beside it) runs once per
    step: on a loss new to the model that reads the logits and the state they are made
    from, the check would pass through the head, and is not taken."""
    model = Upstream()
    calls = []
    model.head.register_full_backward_hook(lambda *_: calls.append(1))
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(6))
    monitor = OnlineDiversity(decay=0.0)
    with watch(model, monitor):
        F.cross_entropy(model(_x())[1], y).backward()
    calls.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor):
            h, logits = model(_x())
            (F.cross_entropy(logits, y) + h.square().sum(1).mean()).backward()
    assert len(calls) == 1 and monitor.steps == 2
    assert any("another computed from it" in str(w.message) for w in caught)


@pytest.mark.parametrize(("n", "partner"), [(4, lambda i: i ^ 1), (8, lambda i: 7 - i),
                                            (6, lambda i: (i + 3) % 6), (16, lambda i: i ^ 8)])
def test_every_pair_of_examples_is_split_by_one_probe(n: int, partner: Callable) -> None:
    """A loss that pairs each example with one other: one random half held both of each
    pair at 4 and 8 examples; a probe per bit of the examples' index splits every pair."""
    model = _model()
    x = torch.randn(n, 6, generator=torch.Generator().manual_seed(7))
    with pytest.raises(BatchboundError, match="couples"), watch(model, OnlineDiversity()):
        z = model(x)
        F.cosine_embedding_loss(z, z[partner(torch.arange(n))], torch.ones(n)).backward()


@pytest.mark.parametrize("edit", ["div_", "sub_mean_", "setitem"])
def test_an_output_edited_in_place_before_a_coupling_loss_is_refused(edit: str) -> None:
    model = _model()
    with pytest.raises(BatchboundError, match="couples"), watch(model, OnlineDiversity()):
        z = model(_x())
        if edit == "div_":
            z.div_(0.5)
        elif edit == "sub_mean_":
            z.sub_(z.mean(0, keepdim=True))
        else:
            z[:, 0] = 0.0
        _infonce(z).backward()


def test_an_output_edited_in_place_before_a_per_example_loss_is_measured() -> None:
    model, monitor = _model(), OnlineDiversity()
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor):
            z = model(_x())
            z.div_(0.5)
            F.cross_entropy(z, y).backward()
    assert monitor.steps == 1
    assert not any("not checked" in str(w.message) for w in caught)


def test_a_backward_watch_does_not_see_is_warned_once() -> None:
    model, monitor = _model(), OnlineDiversity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with watch(model, monitor):
                torch.autograd.backward(_infonce(model(_x())))
    said = [w for w in caught if "not started by loss.backward()" in str(w.message)]
    assert len(said) == 1 and monitor.steps == 2


def test_a_check_that_would_not_fit_in_the_gpus_free_memory_is_not_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import batchbound.diversity.loss_coupling as loss_coupling

    monkeypatch.setattr(loss_coupling, "_free_bytes", lambda device: 1024)
    model, monitor = _model(), OnlineDiversity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor):
            _infonce(model(_x())).backward()
    assert monitor.steps == 1
    assert any("GiB of the GPU's free memory" in str(w.message) for w in caught)


class TwoViews(nn.Module):
    """Class logits and two views' embeddings stacked, (2, n, D): the examples on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.classify = nn.Linear(6, 5), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.classify(x[:, 0]), torch.stack([self.embed(x[:, 0]), self.embed(x[:, 1])])


def _nt_xent(views: Tensor) -> Tensor:
    z = F.normalize(torch.cat([views[0], views[1]]), dim=1)
    similarity = z @ z.T / 0.1 - 1e9 * torch.eye(2 * N)
    return F.cross_entropy(similarity, torch.cat([torch.arange(N) + N, torch.arange(N)]))


@pytest.mark.parametrize("coupled", [True, False])
def test_an_output_holding_the_examples_on_dim_1_is_probed_along_it(coupled: bool) -> None:
    model, monitor = TwoViews(), OnlineDiversity()
    x = torch.randn(N, 2, 6, generator=torch.Generator().manual_seed(9))
    y = torch.zeros(N, dtype=torch.long)

    def step() -> None:
        with watch(model, monitor):
            logits, views = model(x)
            pull = _nt_xent(views) if coupled else (views[0] - views[1]).square().sum()
            (F.cross_entropy(logits, y) + pull).backward()

    if coupled:
        with pytest.raises(BatchboundError, match="couples"):
            step()
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        assert monitor.steps == 1
        assert not any("not checked" in str(w.message) for w in caught)


def _same_label_pull(z: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy, and a pull between examples of one label: coupled only where the
    batch holds two of a label, at the same sizes either way."""
    pairs = (labels[:, None] == labels[None]) & ~torch.eye(len(labels), dtype=torch.bool)
    pull = (pairs.float() * (z[:, None] - z[None]).square().sum(-1)).sum()
    return F.cross_entropy(z, labels % 5) + pull / len(labels)


def test_a_coupling_the_data_switches_on_later_is_refused_on_a_later_check() -> None:
    """The loss is checked again on its 2nd, 4th, 8th, … steps: the batch of step 1 holds
    no two examples of a label, step 2's does, and is refused, naming the earlier steps."""
    model, monitor = _model(), OnlineDiversity()
    unpaired, paired = torch.arange(N), torch.arange(N) // 2
    with watch(model, monitor):
        _same_label_pull(model(_x()), unpaired).backward()
    with pytest.raises(BatchboundError, match="seen on step 2 of this loss"), \
            watch(model, monitor):
        _same_label_pull(model(_x()), paired).backward()
    assert monitor.steps == 1


def test_the_loss_is_checked_on_its_steps_1_2_4_8(monkeypatch: pytest.MonkeyPatch) -> None:
    import batchbound.diversity.steps as steps

    checked = []
    real = steps.loss_coupling
    monkeypatch.setattr(steps, "loss_coupling",
                        lambda *args: checked.append(len(checked)) or real(*args))
    model, monitor = _model(), OnlineDiversity()
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(10))
    seen = []
    for step in range(1, 11):
        before = len(checked)
        with watch(model, monitor):
            F.cross_entropy(model(_x()), y).backward()
        if len(checked) > before:
            seen.append(step)
    assert seen == [1, 2, 4, 8] and monitor.steps == 10


@pytest.mark.parametrize("where", ["output", "inside_the_loss", "retain_grad"])
def test_a_users_hook_on_the_losss_tensors_runs_once_a_step(where: str) -> None:
    """The check's derivatives would run a hook on a tensor they pass (a gradient logger):
    with one there the check is not taken, said once, and the hook runs once a step."""
    model, monitor = _model(), OnlineDiversity()
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(11))
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with watch(model, monitor):
                z = model(_x())
                if where == "output":
                    z.register_hook(lambda g: calls.append(1))
                log_p = F.log_softmax(z, dim=1)
                if where == "inside_the_loss":
                    log_p.register_hook(lambda g: calls.append(1))
                elif where == "retain_grad":
                    log_p.retain_grad()
                F.nll_loss(log_p, y).backward()
            if where == "retain_grad":
                calls.append(1) if log_p.grad is not None else None
    assert len(calls) == 4 and monitor.steps == 4
    said = [w for w in caught if "a hook on a tensor of the loss" in str(w.message)]
    assert len(said) == 1
