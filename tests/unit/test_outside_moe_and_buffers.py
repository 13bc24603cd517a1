"""Models outside users write that earlier passes had not tried, against ``measure``
and ``watch``, each against the float64 per-example loop (one forward of the batch, one
backward per example) or refused in one line.

- A mixture of experts whose forward returns a load-balancing auxiliary loss, one value for
  the batch (Hugging Face's Mixtral and Qwen2-MoE with ``output_router_logits=True``, and the
  same pattern written by hand): a per-example loss that adds it was measured silently
  (Mixtral: S 0.08 % off, under the float32 rounding of its norms, which hid it from the
  check against the loop), and ``watch`` gave m2 0.2 % and the cross term 8 % off on the
  hand-written one, whose layers the rules all take. Both now refuse it, read on the loss's
  graph (measure) and by
  the output's value against its examples' own (watch); without the auxiliary loss in the
  loss, both equal the loop.
- ``spectral_norm`` in train mode (its power iteration updates two buffers in every
  forward): ``watch`` replayed the forward from the buffers as the step left them, got other
  outputs and refused, blaming random numbers outside torch's generator; it now replays from
  the buffers as the forward found them, and equals the loop.
- ``nn.EmbeddingBag`` given a flat input with offsets (an example's rows inside one flat
  tensor): with as many tokens as bags, watch's check ran the model on split examples and
  let the model's RuntimeError out as a traceback; now one line.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.errors import BatchboundError

B = 5


def loop(model: nn.Module, call, loss, seed: int = 0) -> tuple[float, float]:
    """S and T from one forward of the batch (drawn from ``seed``), one backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    losses = loss(call(model))
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(losses.shape[0]):
        for t, g in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True,
                                                   materialize_grads=True), strict=True):
            t += g
            S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


def watched(model: nn.Module, call, loss, seed: int = 0) -> OnlineDiversity:
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost
        with watch(model, monitor):
            torch.manual_seed(seed)
            loss(call(model)).mean().backward()
    model.zero_grad()
    return monitor


def expected(S: float, T: float, n: int) -> OnlineDiversity:
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, T, n)
    return want


class Routed(nn.Module):
    """A soft router beside a head, written as users write a load-balancing loss: the
    router's mean probability per expert over the batch, squared and summed (one value for
    the batch), returned beside the logits. ``mean_of_examples`` returns instead the mean
    over the examples of each one's own squared probabilities: a sum of the examples' terms,
    which does not couple them."""

    def __init__(self, mean_of_examples: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.gate, self.out = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 3)
        self.mean_of_examples = mean_of_examples

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        p = self.gate(h).softmax(-1)
        aux = (p**2).sum(-1).mean() if self.mean_of_examples else (p.mean(0) ** 2).sum()
        return self.out(h), 3 * aux


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(B, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (B,), generator=g))


def with_aux(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], y, reduction="none") + 0.1 * out[1]


def test_measure_refuses_a_per_example_loss_that_adds_the_batchs_auxiliary_loss() -> None:
    x, y = data()
    with pytest.raises(BatchboundError) as info:
        measure(Routed().double(), (x, y), with_aux, chunk_size=B)
    said = str(info.value)
    assert "reads output 1 of the model, shape ()" in said and "\n" not in said
    assert "load-balancing" in said


def test_watch_refuses_a_backward_through_the_batchs_auxiliary_loss() -> None:
    x, y = data()
    model = Routed().double()
    with pytest.raises(BatchboundError) as info:
        watched(model, lambda m: m(x), lambda out: with_aux(out, y))
    said = str(info.value)
    assert said.startswith("watch(): the loss reads output 1 of the model, shape ()")
    assert "backpropagate it after the block" in said and "\n" not in said
    # the auxiliary loss backpropagated after the block: the block's own step is read exactly
    monitor = OnlineDiversity(1000, decay=0.0)
    with watch(model, monitor):
        out = model(x)
        F.cross_entropy(out[0], y).backward(retain_graph=True)
    (0.1 * out[1]).backward()
    model.zero_grad()
    S, T = loop(model, lambda m: m(x), lambda out: F.cross_entropy(out[0], y, reduction="none"))
    assert monitor.m2 == pytest.approx(expected(S, T, B).m2, rel=1e-10)


def test_watch_reads_a_batch_output_that_is_the_mean_of_the_examples_own() -> None:
    """Not over-refused: a mean of the examples' terms is a sum over examples."""
    x, y = data()
    model = Routed(mean_of_examples=True).double()
    got = watched(model, lambda m: m(x), lambda out: with_aux(out, y))
    S, T = loop(model, lambda m: m(x), lambda out: F.cross_entropy(
        out[0], y, reduction="none") + 0.1 * 3 * (model.gate(torch.tanh(model.inp(x)))
                                                  .softmax(-1) ** 2).sum(-1))
    want = expected(S, T, B)
    assert got.m2 == pytest.approx(want.m2, rel=1e-10)
    assert got.cross == pytest.approx(want.cross, rel=1e-9)


transformers = pytest.importorskip("transformers")
VOCAB, LENGTH = 40, 8
COMMON = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=12, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16,
              use_cache=False, experts_implementation="eager")  # grouped_mm: no float64


def moe(name: str, aux: bool) -> nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                            output_router_logits=aux, router_aux_loss_coef=0.1)
        return transformers.MixtralForCausalLM(config).double().eval()
    config = transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=8,
                                         shared_expert_intermediate_size=10,
                                         output_router_logits=aux, router_aux_loss_coef=0.1)
    return transformers.Qwen2MoeForCausalLM(config).double().eval()


def tokens() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (B, LENGTH), generator=g)
    mask = (torch.arange(LENGTH) < LENGTH - torch.arange(B)[:, None] % 3).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def causal(out, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                           ignore_index=-100, reduction="none").sum(1)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_hf_mixtures_of_experts_equal_the_loop_and_refuse_their_auxiliary_loss(name: str
                                                                               ) -> None:
    batch = tokens()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(B)]
    model = moe(name, aux=True)
    S, T = loop(model, lambda m: m(**batch), lambda out: causal(out, batch))
    report = measure(model, DataLoader(rows, batch_size=3), causal, chunk_size=2)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(S, rel=1e-10)
    assert got_t == pytest.approx(T, rel=1e-10)
    # the norms compute in float32 inside the float64 model: watch's batch rounds otherwise
    got = watched(model, lambda m: m(**batch), lambda o: causal(o, batch))
    want = expected(S, T, B)
    assert got.m2 == pytest.approx(want.m2, rel=1e-6)
    assert got.cross == pytest.approx(want.cross, rel=1e-6)
    with pytest.raises(BatchboundError, match=r"reads output \d+ of the model, shape \(\)"):
        measure(model, DataLoader(rows, batch_size=3),
                lambda out, b: causal(out, b) + 0.1 * out.aux_loss, chunk_size=2)
    with pytest.raises(BatchboundError, match="does not hold the 5 examples along any dimension"):
        watched(model, lambda m: m(**batch), lambda o: causal(o, batch) + 0.1 * o.aux_loss)


class SequenceFirst(nn.Module):
    """Outputs (T, n, V), as pytorch/examples' word language model returns them: the loss
    reads the examples along dim 1, which is no quantity of the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(11, 6), nn.GRU(6, 7), nn.Linear(7, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(tokens.t()))
        return self.out(h)


def sequence_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.permute(1, 2, 0), y, reduction="none").sum(1)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
def test_a_sequence_first_output_is_not_taken_for_a_batch_quantity() -> None:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 11, (B, 4), generator=g), torch.randint(0, 11, (B, 4), generator=g)
    model = SequenceFirst().double()
    S, T = loop(model, lambda m: m(x), lambda out: sequence_loss(out, y))
    report = measure(model, (x, y), sequence_loss, chunk_size=B)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(S, rel=1e-10)
    assert got_t == pytest.approx(T, rel=1e-10)
    # watch's check reads the examples along dim 0 of the outputs: refused, in one line
    with pytest.raises(BatchboundError, match="none of the model's outputs holds the 5"):
        watched(model, lambda m: m(x), lambda out: sequence_loss(out, y))


def test_spectral_norm_in_train_mode_is_read_from_the_steps_own_forward() -> None:
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    model = nn.Sequential(spectral_norm(nn.Linear(4, 6)), nn.Tanh(),
                          spectral_norm(nn.Linear(6, 3))).double().train()
    x, y = data()
    start = copy.deepcopy(model.state_dict())
    S, T = loop(model, lambda m: m(x), lambda out: F.cross_entropy(out, y, reduction="none"))
    after = copy.deepcopy(model.state_dict())  # the power iteration's vectors, one step on
    model.load_state_dict(start)
    got = watched(model, lambda m: m(x), lambda out: F.cross_entropy(out, y, reduction="none"))
    want = expected(S, T, B)
    assert got.m2 == pytest.approx(want.m2, rel=1e-10)
    assert got.cross == pytest.approx(want.cross, rel=1e-9)
    for key, value in model.state_dict().items():  # left as the user's forward left them
        assert torch.equal(value, after[key]), key


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.out = nn.EmbeddingBag(20, 6, mode="sum"), nn.Linear(6, 3)

    def forward(self, flat: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.out(self.bag(flat, offsets))


def test_embedding_bag_with_offsets_is_refused_in_one_line() -> None:
    """Bags inside one flat tensor; with as many tokens as bags watch splits both."""
    torch.manual_seed(0)
    model, y = Bag().double(), torch.randint(0, 3, (B,))
    flat, offsets = torch.randint(0, 20, (B,)), torch.tensor([0, 2, 2, 3, 4])
    with pytest.raises(BatchboundError) as info:
        watched(model, lambda m: m(flat, offsets), lambda out: F.cross_entropy(
            out, y, reduction="none"))
    said = str(info.value)
    assert said.startswith("the model raised on a few examples split from this call")
    assert "offsets[0] has to be 0" in said and "\n" not in said


class Float32Only(nn.Module):
    """A kernel that takes float32 alone (as grouped matrix products of experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, y: object = None) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise RuntimeError(f"expected a Float32 matrix, got {x.dtype}")
        return self.a(x) * scale[:, None]


def test_a_model_that_fails_in_measures_dtype_is_not_blamed_on_the_split() -> None:
    """measure(dtype=torch.float64) on a model one of whose kernels takes float32 alone
    (Hugging Face Qwen3-MoE's experts): it said the split of the call's tensors by example
    had failed; the chunk as given fails too, and that is said."""
    torch.manual_seed(0)
    data = {"x": torch.randn(B, 6), "scale": torch.ones(B), "y": torch.randint(0, 3, (B,))}
    with pytest.raises(BatchboundError) as info:
        measure(Float32Only(), data, lambda out, batch: F.cross_entropy(
            out, batch["y"], reduction="none"), dtype=torch.float64)
    said = str(info.value)
    assert said.startswith("the model raised on the chunk from example 0 as given, before any "
                           "split (RuntimeError: expected a Float32 matrix, got torch.float64)")
    assert "\n" not in said
    assert measure(Float32Only(), data, lambda out, batch: F.cross_entropy(
        out, batch["y"], reduction="none")).S > 0
    model = Float32Only().double()
    with pytest.raises(BatchboundError, match=r"^the model raised on the batch as given, "
                                              r"before any split \(RuntimeError"), \
            watch(model, OnlineDiversity()):
        model(data["x"].double(), scale=data["scale"].double()).sum().backward()


def test_advise_trains_a_model_with_an_output_its_loss_ignores() -> None:
    """The router (``gate``) feeds only the auxiliary output, which this loss leaves out: its
    parameters get no gradient. The trainer's two-batch norms read ``p.grad`` and stopped the
    pilot ("failed: TypeError: linalg_vector_norm(): ... not NoneType"); they are zeros now."""
    from batchbound.advise import advise

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        advice = advise(Routed(), (x, y), lambda out, t: F.cross_entropy(out[0], t,
                                                                         reduction="none"),
                        batch_size=8, lr=0.1, planned_epochs=8, max_workers=1,
                        critical_batch="noise")
    assert advice.rows and all(r.iterations > 0 for r in advice.rows)
    # the same model with the batch's auxiliary loss in each example's: the objective would
    # change with how the batch is split among workers; advise answered for it, now refused
    with pytest.raises(BatchboundError) as info:
        advise(Routed(), (x, y), with_aux, batch_size=8, lr=0.1, planned_epochs=8,
               max_workers=1, critical_batch="noise")
    assert "reads output 1 of the model, shape ()" in str(info.value)
    assert "\n" not in str(info.value)


class SpecAugmented(nn.Module):
    """Wav2Vec2's SpecAugment in miniature: in train mode, time steps drawn by numpy's
    generator are overwritten in place, on the projection's output (a view), by a learned
    vector."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.out = nn.Linear(4, 6), nn.Linear(6, 3)
        self.masked = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.training:
            h[torch.tensor(np.random.rand(*h.shape[:2]) < 0.3)] = self.masked
        return self.out(torch.tanh(h).mean(1))


def test_a_layer_output_written_in_place_by_numpy_masks_is_refused_naming_it() -> None:
    x, y = torch.randn(B, 7, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    model = SpecAugmented().double().train()
    with pytest.raises(BatchboundError) as info:
        watched(model, lambda m: m(x), lambda out: F.cross_entropy(out, y, reduction="none"))
    said = str(info.value)
    # the projection goes to the fallback (its output written in place after the call), and
    # the fallback's replay of the step meets numpy's draws
    assert "random numbers from outside torch's generator" in said and "proj.weight" in said
    assert "\n" not in said


class DropAdapter(nn.Module):
    """A LoRA-style adapter as users write it (a raw matmul with its own parameters, which
    no layer rule takes: the fallback), between dropouts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 3)
        self.a, self.b = nn.Parameter(torch.randn(2, 8)), nn.Parameter(torch.randn(8, 2))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.inp(x)))
        return self.out(self.drop(h + self.drop(h @ self.a.t()) @ self.b.t()))


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("make", ["dropout", "spectral_norm"])
def test_monitored_step_in_train_mode_reads_the_steps_own_forward(make: str) -> None:
    """monitored_step ran the fallback's parameters one example at a time: each forward drew
    its own dropout masks (cross term 180 % off, m2 0.5 %) or ran spectral norm's power
    iteration again (m2 2 %, cross 10 % off; the buffers then n steps on). The chunk's
    forward is now replayed from the random state and buffers it began with."""
    from torch.nn.utils.parametrizations import spectral_norm

    from batchbound.diversity import monitored_step

    torch.manual_seed(0)
    model = (DropAdapter() if make == "dropout" else nn.Sequential(
        spectral_norm(nn.Linear(4, 6)), nn.Tanh(), spectral_norm(nn.Linear(6, 3))))
    model = model.double().train()
    x, y = data()
    start = copy.deepcopy(model.state_dict())
    torch.manual_seed(3)
    plain = F.cross_entropy(model(x), y)
    params = [p for p in model.parameters() if p.requires_grad]
    want_grads = torch.autograd.grad(plain, params)
    model.load_state_dict(start)
    S, T = loop(model, lambda m: m(x), lambda out: F.cross_entropy(out, y, reduction="none"),
                seed=3)
    after = copy.deepcopy(model.state_dict())
    model.load_state_dict(start)
    monitor = OnlineDiversity(1000, decay=0.0)
    torch.manual_seed(3)
    monitored_step(model, x, y, "cross_entropy", monitor)
    want = expected(S, T, B)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-10)
    assert monitor.cross == pytest.approx(want.cross, rel=1e-9)
    for p, g in zip(params, want_grads, strict=True):  # the step's own gradient
        torch.testing.assert_close(p.grad, g, rtol=1e-12, atol=1e-14)
    for key, value in model.state_dict().items():  # one forward's buffers
        assert torch.equal(value, after[key]), key
