"""``watch`` on a model in train mode with dropout whose parameters the layer rules cannot all
take: the exact fallback used to run a second forward, one example at a time or
under vmap, that drew dropout masks of its own, so S came from other masks than the step's
gradient (m2 1 % and cross 12 % off on a tiny T5 with dropout 0.1). The batch's forward is now
replayed from the random state the user's call began with; each is checked against the
per-example gradients of the user's own forward (one backward per example on its graph),
in float64."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

B = 6


class Adapter(nn.Module):
    """A LoRA-style adapter written as users write it (a raw matmul with its parameters, which
    no layer rule covers: the fallback), between dropouts."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(5, 8), nn.Linear(8, 3)
        self.a, self.b = nn.Parameter(torch.randn(2, 8)), nn.Parameter(torch.randn(8, 2))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.inp(x)))
        h = h + self.drop(h @ self.a.t()) @ self.b.t()
        return self.out(self.drop(h))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,),
                                                                              generator=g)


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> OnlineDiversity:
    """One forward of the batch from ``seed`` (the step's masks), one backward per example."""
    torch.manual_seed(seed)
    losses = F.cross_entropy(model(x), y, reduction="none")
    params = [p for p in model.parameters() if p.requires_grad]
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(B):
        for t, g in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True,
                                                   materialize_grads=True), strict=True):
            t += g
            S += float(g.square().sum())
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, float(sum(t.square().sum() for t in total)), B)
    return want


def watched(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> OnlineDiversity:
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost
        with watch(model, monitor):
            torch.manual_seed(seed)
            F.cross_entropy(model(x), y).backward()
    model.zero_grad()
    return monitor


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dropout_masks_are_the_steps_own(seed: int) -> None:
    model, (x, y) = Adapter().double().train(), data()
    got = watched(model, x, y, seed)
    want = reference(model, x, y, seed)
    assert got.m2 == pytest.approx(want.m2, rel=1e-10)
    assert got.cross == pytest.approx(want.cross, rel=1e-10)


def test_the_users_random_state_goes_on_as_without_watch() -> None:
    model, (x, y) = Adapter().double().train(), data()
    watched(model, x, y, 3)
    after_watch = torch.rand(4)
    torch.manual_seed(3)
    model(x)
    assert torch.equal(after_watch, torch.rand(4))


class NumpyDropout(Adapter):
    """Masks from numpy's generator, which no replay of torch's state draws again."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) @ self.a.t() @ self.b.t()
        mask = torch.from_numpy(np.random.rand(*h.shape) > 0.5).to(h.dtype)
        return self.out(h * mask * 2)


def test_random_numbers_from_outside_torch_are_refused_in_one_line() -> None:
    model, (x, y) = NumpyDropout().double().train(), data()
    with pytest.raises(BatchboundError) as info:  # by the self-check (its loop's masks
        # differ from the batch's: read as examples that interact) or by the replay
        watched(model, x, y, 0)
    assert "\n" not in str(info.value).strip()


def test_a_t5_with_dropout_equals_its_own_forwards_per_example_gradients() -> None:
    """Encoder-decoder, decoder_input_ids, dropout 0.1: its relative position biases and its
    layer norms go to the fallback."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=30, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False)).double().train()
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(1, 30, (B, 4), generator=g)
    batch = {"input_ids": torch.randint(1, 30, (B, 6), generator=g), "labels": labels,
             "decoder_input_ids": torch.cat([torch.zeros(B, 1, dtype=torch.long),
                                             labels[:, :-1]], 1)}

    def loss(out, b):  # each sequence's summed token loss
        return F.cross_entropy(out.logits.transpose(1, 2), b["labels"],
                               reduction="none").sum(1)

    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(model, monitor):
            torch.manual_seed(5)
            loss(model(**batch), batch).mean().backward()
    model.zero_grad()
    torch.manual_seed(5)
    losses = loss(model(**batch), batch)
    params = [p for p in model.parameters() if p.requires_grad]
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(B):
        for t, gr in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True,
                                                    materialize_grads=True), strict=True):
            t += gr
            S += float(gr.square().sum())
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, float(sum(t.square().sum() for t in total)), B)
    # T5's layer norm computes its variance in float32 inside the float64 model
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-6)
    assert monitor.cross == pytest.approx(want.cross, rel=1e-5)


class UpdatesItsBuffer(Adapter):
    """A running mean it updates on every call, in every mode, before using it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return self.out(h - self.mean)


def test_a_buffer_updated_in_every_mode_is_refused_naming_that_cause() -> None:
    model, (x, y) = UpdatesItsBuffer().double(), data()
    with pytest.raises(BatchboundError, match="a buffer it updates in every mode") as info:
        watched(model.eval(), x, y, 0)
    assert "\n" not in str(info.value)


class SizedOnFirstCall(Adapter):
    """A buffer its forward sizes on its first call (a quantisation observer's min and max,
    empty until then) and then updates from the batch, in every mode."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("peak", torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        with torch.no_grad():
            if self.peak.numel() == 0:
                self.peak.resize_(h.shape[1]).fill_(0)
            self.peak.copy_(torch.maximum(self.peak, h.abs().amax(0)))
        return self.out(h / (1 + self.peak))


def test_a_buffer_sized_by_the_forward_is_restored_and_the_model_refused() -> None:
    """The checks restore the buffers after their forward passes; one the forward had sized
    could not take its old, empty value back (torch.ao's fake quantisation: a RuntimeError
    from inside batchbound)."""
    from batchbound.diversity.rule_check import buffers_kept

    model, (x, y) = SizedOnFirstCall().double(), data()
    with buffers_kept(model):
        model(x)
        model.peak = torch.ones(3)  # replaced, not written: the old tensor is put back
    assert model.peak.shape == (0,)
    with pytest.raises(BatchboundError, match="the whole batch") as info:
        watched(model.eval(), x, y, 0)
    assert "\n" not in str(info.value)
