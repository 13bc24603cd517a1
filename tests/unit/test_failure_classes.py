"""The classes of silent error found by trying models the engine was not designed around,
each as its own test: the engine is exact against the float64 per-example loop, or refuses
with a BatchboundError naming the parameter and the reason. Each failed on batchbound 0.1
(a wrong number, a raw torch error, or a crash)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from outside_models import (
    LSTMLanguageModel,
    MaskedEncoderClassifier,
    NanoGPT,
    sequence_loss,
)
from reference import assert_exact, feature_loss, feature_targets
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from batchbound.diversity import OnlineDiversity, measure, per_example_stats, watch
from batchbound.errors import BatchboundError


def tokens(n: int = 5, steps: int = 8, vocab: int = 40, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (n, steps), generator=g),
            torch.randint(0, vocab, (n, steps), generator=g))


# ---------------------------------------------- 1. a parameter used outside its module


def test_class1_tied_head_written_as_a_matmul() -> None:
    torch.manual_seed(0)
    model, (x, y) = NanoGPT(head="matmul"), tokens()
    assert_exact(model, x, y, sequence_loss, fallback=True,
                 warns=r"used outside its module's call.*transformer\.wte\.weight")
    with pytest.raises(BatchboundError, match=r"used outside its module's call.*wte\.weight"):
        per_example_stats(model, x, y, sequence_loss, engine="hooks")


class FunctionalUses(nn.Module):
    """A module's weight used again through F.linear, and an embedding table indexed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.emb = nn.Embedding(10, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.fc(x[:, :4]))
        h = F.linear(h, self.fc.weight)  # the same weight, outside fc's call
        return h + self.emb.weight[x[:, 4].long().clamp(0, 9)]  # indexing, no module call


def test_class1_weight_reused_through_functional_linear_and_indexing() -> None:
    torch.manual_seed(1)
    x = torch.cat([torch.randn(6, 4), torch.randint(0, 10, (6, 1)).float()], dim=1)
    model = FunctionalUses()
    y = feature_targets(model.double(), x.double())
    assert_exact(model, x, y, feature_loss, fallback=True,
                 warns=r"used outside its module's call.*(fc\.weight.*emb\.weight|emb\.weight"
                       r".*fc\.weight)")
    with pytest.raises(BatchboundError, match="used outside its module's call"):
        per_example_stats(model, x.double(), y, feature_loss, engine="hooks")


# ----------------------------------------- 2. dimension 0 is not the example axis


def test_class2_position_embedding_of_arange_is_exact_under_the_rules() -> None:
    torch.manual_seed(2)
    model, (x, y) = NanoGPT(head="tied"), tokens()
    assert_exact(model, x, y, sequence_loss, engine="hooks")


class LearnedQuery(nn.Module):
    """Learned queries through a Linear: the Linear's input has no example axis, and its
    output meets the examples through a matrix product, not a broadcast addition."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(3, 4))
        self.q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:  # x: (n, T, 4)
        weights = torch.softmax(self.q(self.queries) @ x.transpose(1, 2), dim=-1)  # (n, 3, T)
        return self.out(weights @ x).mean(dim=1)


def test_class2_learned_query_through_a_linear() -> None:
    torch.manual_seed(3)
    model, x = LearnedQuery(), torch.randn(4, 3, 4)  # 3 queries, 3 positions: n is neither
    y = feature_targets(model.double(), x.double())
    assert_exact(model, x, y, feature_loss, fallback=True, warns=r"no example axis.*q\.weight")
    with pytest.raises(BatchboundError, match=r"no example axis"):
        per_example_stats(model, x.double(), y, feature_loss, engine="hooks")


class SequenceFirstInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (n, T, 4), batch first
        h = self.norm(self.fc(x.transpose(0, 1)))  # (T, n, 4): sequence first
        return self.out(torch.tanh(h).mean(dim=0))


def test_class2_sequence_first_inside_a_batch_first_model_when_T_equals_n() -> None:
    torch.manual_seed(4)
    model, x = SequenceFirstInside(), torch.randn(5, 5, 4)  # T == n: dim 0 looks right
    y = torch.randint(0, 3, (5,))
    assert_exact(model, x, y, "cross_entropy", engine="hooks")


class Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        n, steps, width = x.shape
        h = self.fc(x.reshape(n * steps, width)).reshape(n, steps, width)
        return self.out(torch.tanh(h).mean(dim=1))


def test_class2_rows_flattened_to_n_times_T() -> None:
    torch.manual_seed(5)
    model, x, y = Flattened(), torch.randn(5, 6, 4), torch.randint(0, 3, (5,))
    assert_exact(model, x, y, "cross_entropy", fallback=True, warns=r"flattened.*fc\.weight")
    with pytest.raises(BatchboundError, match="flattened"):
        per_example_stats(model, x.double(), y, "cross_entropy", engine="hooks")


def test_class2_a_chunk_the_size_of_a_model_dimension_does_not_fool_measure() -> None:
    torch.manual_seed(6)
    model, x = SequenceFirstInside().double(), torch.randn(12, 4, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    exact = measure(model, (x, y), "cross_entropy", engine="loop")
    for chunk in (4, 5, 12):  # 4 = T: a (T, n, d) chunk is (4, 4, d)
        got = measure(model, (x, y), "cross_entropy", chunk_size=chunk, engine="hooks")
        assert pytest.approx(exact.S, rel=1e-10) == got.S
        assert pytest.approx(exact.T, rel=1e-10) == got.T


# ------------------------------------------------------- 3. keyword arguments


class KeywordCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        self.norm = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(24, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.conv(input=x))
        return self.fc(input=h.flatten(1))


def test_class3_modules_called_with_keyword_arguments() -> None:
    torch.manual_seed(7)
    model, x, y = KeywordCalls(), torch.randn(4, 3, 8), torch.randint(0, 5, (4,))
    assert_exact(model, x, y, "cross_entropy", engine="hooks")


# ------------------------------- 4. a per-example gradient unlike the rule's assumption


def test_class4_embedding_scale_grad_by_freq_counts_within_each_example() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Embedding(6, 4, scale_grad_by_freq=True), nn.Flatten(),
                          nn.Linear(20, 3))
    x = torch.tensor([[1, 1, 2, 1, 5], [1, 3, 3, 3, 0], [2, 2, 2, 2, 2], [1, 2, 3, 4, 5]])
    assert_exact(model, x, torch.randint(0, 3, (4,)), "cross_entropy", engine="hooks",
                 warns=r"scale_grad_by_freq=True\): each example's gradient")


def test_class4_watch_states_that_scale_grad_by_freq_counts_within_each_example() -> None:
    """Its T is the examples' own gradients' sum, not the step's .grad (2.5 % apart in an
    outside review): said, at the user's backward line, not torch's."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Embedding(6, 4, scale_grad_by_freq=True), nn.Flatten(),
                          nn.Linear(20, 3))
    x = torch.tensor([[1, 1, 2, 1, 5], [1, 3, 3, 3, 0], [2, 2, 2, 2, 2], [1, 2, 3, 4, 5]])
    with (pytest.warns(UserWarning, match="counts over the whole batch") as caught,
          watch(model, OnlineDiversity(100))):
        F.cross_entropy(model(x), torch.randint(0, 3, (4,))).backward()
    assert {w.filename for w in caught if "scale_grad_by_freq" in str(w.message)} == {__file__}


def test_class4_embedding_max_norm_renormalises_rows_it_uses() -> None:
    torch.manual_seed(9)
    model = nn.Sequential(nn.Embedding(6, 4, max_norm=0.5), nn.Flatten(), nn.Linear(12, 3))
    x = torch.randint(0, 6, (5, 3))
    assert_exact(model, x, torch.randint(0, 3, (5,)), "cross_entropy")


# --------------------------------------------------------- 5. fallbacks that crashed


class RecurrentWithOutsideUse(nn.Module):
    """An LSTM whose input weights are also read outside its call: they need the fallback,
    and torch.func vmap cannot run an LSTM."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = LSTMLanguageModel(vocab=12, emb=4, hidden=5, layers=2)

    def forward(self, idx: Tensor) -> Tensor:
        return self.lm(idx) + self.lm.rnn.weight_ih_l0.sum()


def test_class5_recurrent_layers_when_vmap_cannot_run_them() -> None:
    torch.manual_seed(10)
    model = RecurrentWithOutsideUse()
    x, y = tokens(n=4, steps=5, vocab=12)
    assert_exact(model, x, y, sequence_loss, fallback=True,
                 warns=r"per-example loop.*vmap cannot run this model")
    with pytest.raises(BatchboundError, match=r"torch\.func\.vmap cannot run this model"):
        per_example_stats(model, x, y, sequence_loss, engine="vmap")


def test_class5_transformer_encoder_with_a_padding_mask() -> None:
    torch.manual_seed(11)
    model = MaskedEncoderClassifier().eval()
    x = torch.randint(1, 20, (5, 7))
    x[0, 4:] = 0
    x[3, 2:] = 0
    y = torch.randint(0, 3, (5,))
    assert_exact(model, x, y, "cross_entropy", engine="hooks")
    with pytest.raises(BatchboundError, match=r"torch\.func\.vmap cannot run this model"):
        per_example_stats(model.double(), x, y, "cross_entropy", engine="vmap")


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.pre, self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        def segment(t: Tensor) -> Tensor:
            return torch.tanh(self.a(t))

        return self.b(checkpoint(segment, self.pre(x), use_reentrant=self.reentrant))


def test_class5_activation_checkpointing() -> None:
    torch.manual_seed(12)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    assert_exact(Checkpointed(reentrant=False), x, y, "cross_entropy", engine="hooks")
    for engine in ("auto", "hooks", "loop"):
        with pytest.raises(BatchboundError, match="use_reentrant=False"):
            per_example_stats(Checkpointed(reentrant=True), x, y, "cross_entropy", engine=engine)


# ------------------------------------------------------------ beyond the five classes


class BatchMixing(nn.Module):
    """Each example sees the batch's mean: f_i depends on the other examples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x + 0.5 * x.mean(dim=0, keepdim=True))


def test_examples_that_interact_are_refused() -> None:
    """f_i depends on the other examples: per-example gradients are not defined (issue 26)."""
    torch.manual_seed(13)
    model, x, y = BatchMixing().double(), torch.randn(6, 4), torch.randint(0, 3, (6,))
    for engine in ("auto", "hooks"):
        with pytest.raises(BatchboundError, match=r"examples interact within a batch.*Ways out"):
            per_example_stats(model, x.double(), y, "cross_entropy", engine=engine)


# ---------------------------------------- found by an independent pass over the engine


class HeadInTheLoss(nn.Module):
    """The model returns features; the loss applies the model's own head to them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh())
        self.head = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def test_parameters_the_loss_itself_uses_go_to_the_loop() -> None:
    """functional_call swaps parameters inside the model's forward only: torch.func would see
    no gradient for a head (or a penalty) written into the loss."""
    torch.manual_seed(14)
    model = HeadInTheLoss().double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))

    def head_loss(features: Tensor, t: Tensor) -> Tensor:
        return F.cross_entropy(model.head(features), t, reduction="none")

    def penalised(features: Tensor, t: Tensor) -> Tensor:
        return head_loss(features, t) + 0.1 * model.body[0].weight.square().sum()

    for loss in (head_loss, penalised):
        assert_exact(model, x, y, loss, fallback=True, warns="used by the loss function")
        with pytest.raises(BatchboundError, match="loss"):
            per_example_stats(model, x, y, loss, engine="vmap")
        with pytest.raises(BatchboundError, match="used by the loss function"):
            per_example_stats(model, x, y, loss, engine="hooks")
    exact = measure(model, (x, y), penalised, engine="loop")
    assert pytest.approx(exact.S, rel=1e-10) == measure(model, (x, y), penalised).S


class ScalarIndexed(nn.Module):
    """One learned segment vector, looked up with a 0-dim index and broadcast over (n, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.seg, self.out = nn.Embedding(17, 8), nn.Embedding(2, 8), nn.Linear(8, 3)

    def forward(self, t: Tensor) -> Tensor:
        return self.out(torch.tanh(self.tok(t) + self.seg(torch.tensor(0))).mean(dim=1))


def test_batchless_call_broadcast_over_several_dimensions() -> None:
    torch.manual_seed(15)
    x = torch.randint(0, 17, (5, 6))
    assert_exact(ScalarIndexed(), x, torch.randint(0, 3, (5,)), "cross_entropy", engine="hooks")


class TwoHeads(nn.Module):
    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.body, self.cls, self.reg = nn.Linear(5, 8), nn.Linear(8, 3), nn.Linear(8, 1)
        self.as_dict = as_dict

    def forward(self, x: Tensor) -> dict[str, Tensor] | tuple[Tensor, Tensor]:
        h = torch.tanh(self.body(x))
        logits, value = self.cls(h), self.reg(h)
        return {"logits": logits, "value": value} if self.as_dict else (logits, value)


@pytest.mark.parametrize("as_dict", [True, False])
def test_models_that_return_dicts_or_tuples(as_dict: bool) -> None:
    def loss(out: dict | tuple, y: Tensor) -> Tensor:
        logits, value = (out["logits"], out["value"]) if isinstance(out, dict) else out
        return F.cross_entropy(logits, y, reduction="none") + value.squeeze(1).square()

    torch.manual_seed(16)
    assert_exact(TwoHeads(as_dict), torch.randn(6, 5), torch.randint(0, 3, (6,)), loss,
                 engine="hooks")


class Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.rnn, self.out = nn.LSTM(6, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, t: Tensor) -> Tensor:
        from torch.nn.utils.rnn import pack_padded_sequence

        lengths = (t != 0).sum(dim=1).clamp(min=1)
        packed = pack_padded_sequence(self.emb(t), lengths, batch_first=True,
                                      enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.out(h[-1])


def test_packed_sequences_go_to_the_loop() -> None:
    torch.manual_seed(17)
    x = torch.randint(1, 11, (5, 4))
    x[0, -1] = 0
    x[2, -2:] = 0
    assert_exact(Packed(), x, torch.randint(0, 3, (5,)), "cross_entropy", fallback=True,
                 warns=r"PackedSequence, not a tensor.*rnn\.weight_ih_l0")


# ---------------------------------------------- found after the five: reordering, state, closures


class SortsItsBatch(nn.Module):
    """Sorts the examples by a feature, runs the layers, and restores the order: rows inside
    the layers are not the examples' rows, though every shape is."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        order = torch.argsort(x[:, 0])
        return self.b(torch.tanh(self.a(x[order])))[torch.argsort(order)]


class SortsByItsFeatures(nn.Module):
    """The same, sorted by a hidden feature read through ``detach`` or ``.data``: indices
    from values autograd never records."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.a, self.b, self.read = nn.Linear(5, 7), nn.Linear(7, 3), read

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        key = h.detach() if self.read == "detach" else h.data
        order = torch.argsort(key[:, 0])
        return self.b(h[order])[torch.argsort(order)]


@pytest.mark.parametrize("read", ["detach", "data"])
def test_rows_sorted_by_values_autograd_never_saw(read: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    with pytest.raises(BatchboundError, match=r"b \(Linear\): its input's rows are chosen"):
        per_example_stats(SortsByItsFeatures(read).double(), x, y, "cross_entropy",
                          engine="hooks")


@pytest.mark.parametrize("train", [False, True])
def test_a_model_that_reorders_its_batch(train: bool) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    model = SortsItsBatch().train(train)
    assert_exact(model, x, y, "cross_entropy", fallback=True, warns="rows are chosen by the data")
    with pytest.raises(BatchboundError, match="rows are chosen by the data"):
        per_example_stats(SortsItsBatch().double().train(train), x.double(), y, "cross_entropy",
                          engine="hooks")


class BatchStatistics(nn.Module):
    """A hand-written batch norm: batch statistics in training (updating running ones), the
    running ones otherwise. Not an nn.BatchNorm, so no list of modules can know it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("var", torch.ones(width))

    def forward(self, h: Tensor) -> Tensor:
        if self.training and h.shape[0] > 1:
            mu, var = h.mean(0), h.var(0, unbiased=False)
            with torch.no_grad():
                self.mean.lerp_(mu, 0.1)
                self.var.lerp_(var, 0.1)
        else:
            mu, var = self.mean, self.var
        return (h - mu) / torch.sqrt(var + 1e-5)


def test_examples_that_interact_only_in_train_mode_are_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), BatchStatistics(7), nn.ReLU(), nn.Linear(7, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    model.double().train()
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(BatchboundError, match=r"interact.*running statistics"):
        per_example_stats(model, x.double(), y, "cross_entropy")
    # the checks' own forward passes leave the running statistics as they were
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))


class ClosureParameters(nn.Module):
    """Weights held in a plain list and used through a closure: torch.func's functional_call
    replaces module attributes only, so vmap differentiates a constant there."""

    def __init__(self) -> None:
        super().__init__()
        self.w0, self.w1 = nn.Parameter(torch.randn(5, 7)), nn.Parameter(torch.randn(7, 3))
        held = [self.w0, self.w1]
        self.apply_weights = lambda x: torch.tanh(x @ held[0]) @ held[1]

    def forward(self, x: Tensor) -> Tensor:
        return self.apply_weights(x)


def test_parameters_reached_outside_module_attributes_leave_vmap_for_the_loop() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    assert_exact(ClosureParameters(), x, y, "cross_entropy", fallback=True,
                 warns="vmap disagreed with the per-example loop")
    # refused on every call by the vmap call's own graph (the check against the loop, once
    # per model, would say "vmap disagreed")
    with pytest.raises(BatchboundError, match="outside their modules' attributes"):
        per_example_stats(ClosureParameters().double(), x.double(), y, "cross_entropy",
                          engine="vmap")
