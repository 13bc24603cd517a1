"""A chunk whose forward ran other operations than the earlier chunks of its shape (control
flow on the data's values, which the first chunk's check did not see) is checked by value,
apart (``prepared.PreparedStats._check_program``): refused where its examples interact,
measured exactly where they do not, each program checked once per model."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from reference import loop_gradients
from torch import Tensor, nn

from batchbound.diversity import measure
from batchbound.errors import BatchboundError


class Shifted(nn.Module):
    """Where a value of the batch is large, each example gets its predecessor's row."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h = torch.tanh(self.a(x))
        if bool(x[:, 0].max() > 3):  # a Python branch on a value of the batch
            h = torch.cat([h[:1], h[:-1]])
        return self.b(h)


class Rolled(Shifted):
    """Adds its neighbour's row, rolled by an offset read off the batch."""

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + h.roll(int(x[:, 0].max() > 3), 0))


class MaskSkipped(Shifted):
    """Multiplies by its mask (last column) unless every entry is one, as Hugging Face skips
    an attention mask without padding: two programs, the examples apart in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h, mask = torch.tanh(self.a(x[:, :-1])), x[:, -1:]
        if not bool((mask == 1).all()):
            h = h * mask
        return self.b(h)


def data(n: int = 32, large: tuple[int, ...] = (20,)) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5, generator=g, dtype=torch.float64).clamp(-2.5, 2.5)
    x[list(large), 0] = 5.0
    return x, torch.randint(0, 3, (n,), generator=g)


def loop_S(model: nn.Module, x: Tensor, y: Tensor) -> float:
    g = loop_gradients(model, x, y, lambda o, t: F.cross_entropy(o, t, reduction="none"))
    return float(g.square().sum())


@pytest.mark.parametrize("build", [Shifted, Rolled], ids=["shifted rows", "rolled rows"])
def test_examples_joined_by_control_flow_on_the_data_are_refused(build: type) -> None:
    """The first two chunks take the other branch (roll by 0): their checks see nothing.
    Before, S came back 2.5 % (shifted) and 11.5 % (rolled) off the loop's, without a word."""
    torch.manual_seed(0)
    model = build().double()
    x, y = data()
    with pytest.raises(BatchboundError, match=r"on the chunk from example 16, the examples "
                                              r"interact.*ran other operations"):
        measure(model, (x, y), "cross_entropy", chunk_size=8)


def test_the_programs_checked_are_kept_with_the_model() -> None:
    """A second call whose first chunk takes the branch is checked against the first call's
    chunks, not taken as its own reference."""
    torch.manual_seed(0)
    model = Shifted().double()
    x, y = data(large=())
    got = measure(model, (x, y), "cross_entropy", chunk_size=8)
    assert abs(got.S - loop_S(model, x, y)) <= 1e-9 * got.S
    x, y = data(large=(2,))
    with pytest.raises(BatchboundError, match=r"on the chunk from example 0, the examples "
                                              r"interact.*ran other operations"):
        measure(model, (x, y), "cross_entropy", chunk_size=8)


def test_a_branch_that_keeps_the_examples_apart_is_exact_and_checked_once() -> None:
    torch.manual_seed(0)
    model = MaskSkipped().double()
    x, y = data(48, large=())
    x[:, -1] = 1.0
    x[[13, 29, 41], -1] = 0.0  # padding in the second, fourth and sixth chunks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = measure(model, (x, y), "cross_entropy", chunk_size=8)
    S = loop_S(model, x, y)
    assert abs(got.S - S) <= 1e-9 * S
    model.calls = 0
    measure(model, (x, y), "cross_entropy", chunk_size=8)
    assert model.calls == 6  # one forward a chunk: both programs known, nothing run apart


def test_a_hugging_face_model_skipping_its_mask_is_checked_once_and_measured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 drops its attention mask on a chunk without padding: the padded chunks run
    another program, checked apart once (float32), not refused; none on the next call."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import batchbound.diversity.prepared as prepared

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                       n_positions=16)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (24, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[[9, 20], 6:] = 0  # padding in the second and third chunks only

    def lm_loss(out: object, batch: dict) -> Tensor:
        logits, labels = out.logits[:, :-1], batch["input_ids"][:, 1:]  # type: ignore[attr-defined]
        per = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        return (per * batch["attention_mask"][:, 1:]).sum(1)

    checks = []
    original = prepared.PreparedStats._apart_differ

    def counted(self: prepared.PreparedStats, *args: object) -> bool:
        checks.append(1)
        return original(self, *args)

    monkeypatch.setattr(prepared.PreparedStats, "_apart_differ", counted)
    batch = {"input_ids": ids, "attention_mask": mask}
    first = measure(model, batch, lm_loss, chunk_size=8)
    assert len(checks) == 1
    again = measure(model, batch, lm_loss, chunk_size=8)
    assert len(checks) == 1 and again.S == first.S
