"""Bad input gets a BatchboundError that names the problem, before work starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from batchbound.diversity import measure, per_example_stats, resolve_loss
from batchbound.errors import BatchboundError


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randint(0, 3, (n,))


def test_no_trainable_parameters() -> None:
    frozen = model().requires_grad_(False)
    with pytest.raises(BatchboundError, match="no trainable parameters"):
        measure(frozen, data(), "cross_entropy")
    with pytest.raises(BatchboundError, match="no trainable parameters"):
        measure(nn.ReLU(), data(), "cross_entropy")


@pytest.mark.parametrize(
    "empty", [(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)), "dataset"]
)
def test_empty_data(empty: object) -> None:
    if empty == "dataset":
        empty = TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    with pytest.raises(BatchboundError, match="empty"):
        measure(model(), empty, "cross_entropy")


def test_non_finite_loss_names_the_example() -> None:
    x, y = data(10)
    x[7, 2] = float("nan")
    for engine in ("hooks", "auto", "vmap", "loop"):
        with pytest.raises(BatchboundError, match="example 7 is not finite"):
            measure(model(), (x, y), "cross_entropy", chunk_size=3, engine=engine)


@pytest.mark.parametrize("bad", [3, 40, 77, 99])  # in the first chunk, later blocks, the last
def test_a_non_finite_loss_read_later_is_still_named(bad: int) -> None:
    # after the first chunk the losses' check is read once a block of chunks (no host read
    # per chunk): the first example not finite is still the one named
    x, y = data(100)
    x[bad, 0] = float("inf")
    x[min(bad + 5, 99), 1] = float("nan")  # a later one, in the same block or the next
    with pytest.raises(BatchboundError, match=f"example {bad} is not finite"):
        measure(model(), (x, y), "cross_entropy", chunk_size=2)


@pytest.mark.parametrize(
    "loss,targets,pattern",
    [
        ("cross_entropy", torch.randn(10, 1), r"labels of shape \(10, 3\)"),
        ("cross_entropy", torch.randint(0, 3, (10, 2)), r"integer class labels of shape \(10,\)"),
        ("cross_entropy", torch.full((10,), 5), r"class indices in \[0, 3\)"),
        ("mse", torch.randn(10, 2), r"targets shaped like the outputs \(10, 3\)"),
    ],
)
def test_label_shape_mismatch(loss: str, targets: torch.Tensor, pattern: str) -> None:
    with pytest.raises(BatchboundError, match=pattern):
        measure(model(), (torch.randn(10, 4), targets), loss)


def test_mismatched_lengths() -> None:
    with pytest.raises(BatchboundError, match="share their first"):
        measure(model(), (torch.randn(10, 4), torch.zeros(9, dtype=torch.long)), "cross_entropy")


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_bad_chunk_size(chunk_size: object) -> None:
    with pytest.raises(BatchboundError, match="chunk_size must be a positive integer"):
        measure(model(), data(), "cross_entropy", chunk_size=chunk_size)  # type: ignore[arg-type]


def test_unknown_names() -> None:
    with pytest.raises(BatchboundError, match="unknown engine 'fast'; choose from auto, hooks"):
        measure(model(), data(), "cross_entropy", engine="fast")
    with pytest.raises(BatchboundError, match="unknown loss 'hinge'; choose from cross_entropy"):
        measure(model(), data(), "hinge")
    with pytest.raises(BatchboundError, match="no loss given"):
        measure(model(), data())
    with pytest.raises(BatchboundError, match="floating torch dtype"):
        measure(model(), data(), "cross_entropy", dtype=torch.int32)
    with pytest.raises(BatchboundError, match="batchbound Dataset, a torch Dataset"):
        measure(model(), [1, 2, 3], "cross_entropy")  # type: ignore[arg-type]


def test_custom_loss_must_return_one_value_per_example() -> None:
    def mean_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    with pytest.raises(BatchboundError, match=r"one value per example, shape \(10,\), got \(\)"):
        measure(model(), data(), mean_loss)
    ok = measure(model(), data(), lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"))
    assert ok.n == 10


def test_resolve_loss_defaults() -> None:
    assert resolve_loss(None, "classification").__name__ == "cross_entropy"
    assert resolve_loss(None, "regression").__name__ == "mse"
    with pytest.raises(BatchboundError, match="unknown task"):
        resolve_loss(None, "ranking")


def test_train_mode_batchnorm_is_refused_by_per_example_stats() -> None:
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).train()
    with pytest.raises(BatchboundError, match=r"call model\.eval"):
        per_example_stats(net, *data(), "cross_entropy")
    assert measure(net, data(), "cross_entropy").n == 10  # measure switches to eval
    assert net.training
