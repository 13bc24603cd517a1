"""Whole models written as their authors write them (tests/support/outside_models.py), each
exact with ``engine="auto"`` against the float64 per-example loop (≤ 1e-9 relative), through
the layer rules alone, and through ``measure``, ``watch`` and ``monitored_step``."""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from outside_models import (
    BatchCentered,
    ContrastiveTowers,
    ExpertChoiceMoE,
    LSTMLanguageModel,
    MaskedEncoderClassifier,
    NanoGPT,
    SwitchMoE,
    UnpaddedTokenMLP,
    UnpaddingEncoder,
    WordLanguageModel,
    info_nce,
    padded,
    resnet,
    sequence_loss,
)
from reference import assert_exact
from torch import Tensor, nn

from batchbound.diversity import (
    OnlineDiversity,
    differential_diversity,
    measure,
    mechanism_diversity,
    monitored_step,
    per_example_stats,
    watch,
)
from batchbound.errors import BatchboundError


def tokens(n: int, steps: int, vocab: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (n, steps), generator=g),
            torch.randint(0, vocab, (n, steps), generator=g))


def test_nanogpt_with_tied_head_and_position_embeddings() -> None:
    torch.manual_seed(0)
    x, y = tokens(6, 8, 40)
    assert_exact(NanoGPT(), x, y, sequence_loss)


@pytest.mark.parametrize("rnn_type", ["LSTM", "GRU", "RNN_TANH"])
@pytest.mark.parametrize("tie_weights", [False, True])
def test_word_language_model(rnn_type: str, tie_weights: bool) -> None:
    torch.manual_seed(1)
    model = WordLanguageModel(rnn_type, tie_weights=tie_weights).eval()
    x, y = tokens(5, 7, 30)
    assert_exact(model, x, y, sequence_loss)


@pytest.mark.parametrize("bidirectional,proj_size", [(False, 0), (True, 0), (False, 5)])
def test_lstm_language_model(bidirectional: bool, proj_size: int) -> None:
    torch.manual_seed(2)
    model = LSTMLanguageModel(bidirectional=bidirectional, proj_size=proj_size)
    x, y = tokens(5, 7, 30)
    assert_exact(model, x, y, sequence_loss)


def test_transformer_encoder_with_padding_mask() -> None:
    torch.manual_seed(3)
    x = torch.randint(1, 20, (6, 9))
    x[1, 5:] = 0
    x[4, 3:] = 0
    assert_exact(MaskedEncoderClassifier().eval(), x, torch.randint(0, 3, (6,)),
                 "cross_entropy")


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_torchvision_style_resnet(block: str) -> None:
    torch.manual_seed(4)
    assert_exact(resnet(block), torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,)),
                 "cross_entropy")


def test_measure_streams_chunks_of_outside_models() -> None:
    torch.manual_seed(5)
    model = NanoGPT().double()
    x, y = tokens(23, 8, 40)
    exact = measure(model, (x, y), sequence_loss, engine="loop")
    got = measure(model, (x, y), sequence_loss, chunk_size=8)  # 8 = the context: no matter
    assert got.extra["fallback_parameters"] == []
    assert pytest.approx(exact.S, rel=1e-10) == got.S
    assert pytest.approx(exact.T, rel=1e-10) == got.T
    for name, value in exact.per_parameter_S.items():
        assert got.per_parameter_S[name] == pytest.approx(value, rel=1e-9)


def test_mechanisms_and_differential_diversity_on_an_lstm() -> None:
    """Materialised per-example gradients fall back to the loop where vmap cannot run."""
    torch.manual_seed(6)
    model = LSTMLanguageModel(vocab=12, emb=4, hidden=5, layers=1).double()
    x, y = tokens(6, 5, 12)
    with pytest.warns(UserWarning, match="vmap cannot run this model"):
        report = mechanism_diversity(model, (x, y), sequence_loss, "quantization")
    base = measure(model, (x, y), sequence_loss)
    assert report.base_diversity == pytest.approx(base.diversity, rel=1e-9)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01 * torch.randn_like(p))
    with pytest.warns(UserWarning, match="vmap cannot run this model"):
        diff = differential_diversity(model, moved, (x, y), sequence_loss)
    assert diff.T > 0 and diff.S >= diff.T / 6 * (1 - 1e-9)  # Δ ≥ 1/n


def test_watch_on_nanogpt_reads_the_users_backward_exactly() -> None:
    torch.manual_seed(7)
    model = NanoGPT().double()
    x, y = tokens(6, 8, 40)
    exact = per_example_stats(copy.deepcopy(model), x, y, sequence_loss, engine="loop")
    monitor = OnlineDiversity(100, decay=0.0)
    with watch(model, monitor):
        sequence_loss(model(x), y).mean().backward()
    expected = OnlineDiversity(100, decay=0.0)
    expected.update_from_stats(exact)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)


@pytest.mark.parametrize("call", ["method", "function"])
def test_watch_refuses_a_regulariser_written_into_the_loss(call: str) -> None:
    """loss.backward(): found on the loss's graph; torch.autograd.backward(loss): by the
    fingerprints of the gradient sums."""
    torch.manual_seed(8)
    model = NanoGPT().double()
    x, y = tokens(6, 8, 40)
    with pytest.raises(BatchboundError, match=r"outside the model's layers.*c_fc\.weight"), \
            watch(model, OnlineDiversity()):
        penalty = model.transformer.h[0].mlp.c_fc.weight.square().sum()
        loss = sequence_loss(model(x), y).mean() + 0.1 * penalty
        loss.backward() if call == "method" else torch.autograd.backward(loss)


def test_monitored_step_on_a_word_language_model() -> None:
    torch.manual_seed(9)
    model = WordLanguageModel("LSTM").double().eval()
    monitor, expected = OnlineDiversity(50), OnlineDiversity(50)
    for seed in range(3):
        x, y = tokens(4, 6, 30, seed)
        model.zero_grad(set_to_none=True)
        monitored_step(model, x, y, sequence_loss, monitor)
        exact = per_example_stats(model, x, y, sequence_loss, engine="loop")
        expected.update_from_stats(exact)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, exact.grad_sum[name] / 4, rtol=1e-9, atol=1e-12)
    assert monitor.steps == 3
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-7)


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(x)


def test_parameters_no_example_reaches_have_zero_norms() -> None:
    stats = per_example_stats(Unused().double(), torch.randn(4, 3, dtype=torch.float64),
                              torch.randint(0, 2, (4,)), "cross_entropy", engine="hooks")
    assert float(stats.sq_norms["spare.weight"].abs().sum()) == 0.0
    assert float(stats.grad_sum["spare.bias"].abs().sum()) == 0.0


# ------------------------------------- rows chosen by the data (issue 26): exact or refused

MOVED = "rows are (chosen|then moved) by the data"


def _exact_over_chunks(model: nn.Module, x: Tensor, y: Tensor, chunk: int) -> list[str]:
    """measure() in chunks equals the float64 loop to 1e-9; returns the fallback parameters."""
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    exact = measure(model, (x, y), "cross_entropy", engine="loop")
    with pytest.warns(UserWarning, match=MOVED):
        got = measure(model, (x, y), "cross_entropy", chunk_size=chunk)
    assert pytest.approx(exact.S, rel=1e-9) == got.S
    assert pytest.approx(exact.T, rel=1e-9) == got.T
    return got.extra["fallback_parameters"]


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_switch_moe_is_exact_on_every_chunk(seed: int, hard: bool) -> None:
    """Per-expert token counts equal the chunk size on some chunks by chance: before, the
    experts' rules were trusted there (up to 3e-3 wrong); now the routed rows are refused,
    also when the router runs under no_grad (its indices then never touch autograd)."""
    torch.manual_seed(seed)
    x, y = torch.randn(12, 2, 8), torch.randint(0, 4, (12,))
    fallback = _exact_over_chunks(SwitchMoE(hard=hard), x, y, chunk=4)
    assert "experts.0.weight" in fallback


def test_expert_choice_moe_is_refused() -> None:
    """Experts take their top n·T/E tokens of the batch, so tokens compete across examples:
    an example routed alone is routed differently. Each expert holds exactly n rows here."""
    torch.manual_seed(3)
    x, y = torch.randn(12, 3, 6, dtype=torch.float64), torch.randint(0, 3, (12,))
    for engine in ("auto", "hooks"):
        with pytest.raises(BatchboundError, match=r"interact.*capacity"):
            measure(ExpertChoiceMoE().double(), (x, y), "cross_entropy", chunk_size=4,
                    engine=engine)


def test_unpadded_token_mlp_is_exact() -> None:
    torch.manual_seed(10)
    fallback = _exact_over_chunks(UnpaddedTokenMLP(), padded(12, 5, 6), torch.randint(0, 3, (12,)),
                                  chunk=4)
    assert "fc.weight" in fallback


def test_unpadding_encoder_is_exact() -> None:
    torch.manual_seed(11)
    ids = torch.randint(1, 20, (12, 5)) * (torch.rand(12, 5) > 0.3)
    ids[:, 0] = 3  # every example keeps a token
    assert "fc.weight" in _exact_over_chunks(UnpaddingEncoder(), ids, torch.randint(0, 3, (12,)),
                                             chunk=4)


def test_watch_computes_routed_rows_by_the_fallback() -> None:
    """Rows routed by the data are no rule's: the exact fallback takes them, in the step."""
    torch.manual_seed(12)
    model = SwitchMoE().double()
    x, y = torch.randn(6, 2, 8, dtype=torch.float64), torch.randint(0, 4, (6,))
    exact = per_example_stats(copy.deepcopy(model), x, y, "cross_entropy", engine="loop")
    monitor = OnlineDiversity(100, decay=0.0)
    with pytest.warns(UserWarning, match="no layer rule|" + MOVED), watch(model, monitor):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = OnlineDiversity(100, decay=0.0)
    expected.update_from_stats(exact)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)


# -------------------------------------------- examples that interact (issue 26): refused


def test_batch_centering_in_the_forward_is_refused() -> None:
    torch.manual_seed(13)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    for engine in ("auto", "hooks"):
        with pytest.raises(BatchboundError, match=r"interact.*h - h\.mean\(0\).*running"):
            measure(BatchCentered().double(), (x, y), "cross_entropy", engine=engine)


class LateBatchCentered(nn.Module):
    """Centred per example, then, from its ``after``-th call on (a flag or a counter), on the
    batch: the same operations with another dimension, so the graph's node types are the
    same and only the mean's saved dimension tells the chunks apart."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)
        self.calls, self.after = 0, after

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h = self.a(x)
        return self.b(torch.tanh(h - h.mean(0 if self.calls > self.after else -1,
                                            keepdim=True)))


def test_batch_centering_switched_on_after_the_first_chunk_is_refused() -> None:
    """The first chunk, which the per-example loop checks, is centred per example; later
    ones on the batch. Its S came back, from the rules or from the fallback computing each
    example alone, without a word."""
    torch.manual_seed(13)
    x, y = torch.randn(64, 5, dtype=torch.float64), torch.randint(0, 3, (64,))
    model = LateBatchCentered(after=10**9).double()
    exact = measure(copy.deepcopy(model), (x, y), "cross_entropy", chunk_size=8)
    assert exact.S > 0  # a steady model measures
    model.after = model.calls + 12  # past the first call's checks and first chunks
    with pytest.raises(BatchboundError,
                       match=r"on the chunk from example \d+, the examples interact"):
        measure(model, (x, y), "cross_entropy", chunk_size=8)
    torch.manual_seed(13)
    late, monitor = LateBatchCentered(after=10**9).double(), OnlineDiversity()
    for step in range(3):
        if step == 2:
            late.after = late.calls  # from this step's forward on
        late.zero_grad()
        with pytest.raises(BatchboundError, match="the examples interact") if (
                step == 2) else contextlib.nullcontext(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with watch(late, monitor):
                F.cross_entropy(late(x[:8]), y[:8]).backward()


def label_pulled(out: Tensor, y: Tensor) -> Tensor:
    """A supervised-contrastive-style term: each example's cross-entropy plus its distance
    to the mean of the other examples in the chunk that share its label (zero where none
    does, so a chunk whose labels all differ is each example's own)."""
    same = (y[:, None] == y[None, :]).to(out.dtype) - torch.eye(len(y), dtype=out.dtype)
    others = same @ out / same.sum(1, keepdim=True).clamp(min=1)
    pull = (out - others).square().sum(1) * (same.sum(1) > 0)
    return F.cross_entropy(out, y, reduction="none") + pull


def test_a_loss_coupling_examples_of_one_label_is_refused_wherever_they_sit() -> None:
    """The first chunk's labels repeat on rows 3 and 5 only, which the per-example loop's
    check (first, middle and last rows) does not run: S came back 15 % off. The loss is now
    also computed on halves of the first chunk, three ways."""
    torch.manual_seed(2)
    x, y = torch.randn(32, 5, dtype=torch.float64), torch.randint(0, 10, (32,))
    y[:8] = torch.tensor([3, 6, 7, 8, 9, 8, 0, 4])
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    with pytest.raises(BatchboundError, match="the loss of a part of its examples"):
        measure(model, (x, y), label_pulled, chunk_size=8)
    y[:8] = torch.arange(8)  # no label shared in the first chunk: nothing to see there
    assert measure(model, (x, y), lambda out, t: F.cross_entropy(out, t, reduction="none"),
                   chunk_size=8).S > 0


def test_a_coupled_loss_is_seen_beside_a_hugging_face_models_cache() -> None:
    """A causal LM in eval mode returns its keys' and values' cache beside the logits: the
    split of the loss passes it whole (it skipped the check before)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=8)
    torch.manual_seed(17)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (16, 8))

    def token_loss(out: Any, y: Tensor) -> Tensor:
        return F.cross_entropy(out.logits.transpose(1, 2), y, reduction="none").mean(1)

    def pulled(out: Any, y: Tensor) -> Tensor:
        """Plus the mean loss of the other sequences that start with the same token."""
        losses = token_loss(out, y)
        same = (y[:, :1] == y[:, :1].T).to(losses.dtype) - torch.eye(len(y))
        return losses + same @ losses / same.sum(1).clamp(min=1)

    ids[:8, 0] = torch.tensor([1, 2, 3, 4, 5, 4, 6, 7])  # rows 3 and 5: not the loop's rows
    assert measure(model, (ids, ids), token_loss, chunk_size=8).S > 0
    with pytest.raises(BatchboundError, match="the loss of a part of its examples"):
        measure(model, (ids, ids), pulled, chunk_size=8)


def test_contrastive_loss_over_the_batch_is_refused() -> None:
    """Each example alone has a 1×1 similarity matrix and zero loss: S = T = 0 and Δ = NaN
    came back before, after a warning."""
    torch.manual_seed(14)
    x, y = torch.randn(8, 11, dtype=torch.float64), torch.zeros(8)
    with pytest.raises(BatchboundError, match=r"interact.*contrastive.*update_from_gradients"):
        measure(ContrastiveTowers().double(), (x, y), info_nce)


# ------------------------------------------------------- low precision (issue 26)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mlp", "nanogpt", "lstm"])
def test_low_precision_models_state_their_precision(dtype: torch.dtype, name: str) -> None:
    """Norms and sums in float32/float64: S and T within a few unit roundoffs of the float64
    copy, and the report and a warning say what precision the numbers carry."""
    torch.manual_seed(15)
    if name == "mlp":
        model: nn.Module = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        data, loss = (torch.randn(40, 10), torch.randint(0, 4, (40,))), "cross_entropy"
    else:
        model = NanoGPT() if name == "nanogpt" else LSTMLanguageModel()
        data, loss = tokens(24, 8, 30), sequence_loss
    model = model.to(dtype)
    exact = measure(model, data, loss, dtype=torch.float64)
    assert "precision" not in exact.extra
    with pytest.warns(UserWarning, match=f"computes in {str(dtype)[6:]}.*dtype=torch.float64"):
        got = measure(model, data, loss, chunk_size=8)
    assert got.extra["precision"].startswith(str(dtype)[6:])
    assert got.extra["fallback_parameters"] == []
    roundoff = torch.finfo(dtype).eps / 2
    assert pytest.approx(exact.S, rel=4 * roundoff) == got.S
    assert pytest.approx(exact.T, rel=4 * roundoff) == got.T


# -------------------------------- what an outside review saw leak as torch's or Python's errors


def test_uninitialised_lazy_layers_are_named() -> None:
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.LazyLinear(3))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    with pytest.raises(BatchboundError, match=r"lazy parameters not yet initialised \(0\.weight"):
        measure(model, (x, y), "cross_entropy")
    model(x)  # their shapes exist now
    assert measure(model, (x, y), "cross_entropy").S > 0


def test_a_float64_copy_of_a_model_deepcopy_cannot_copy_is_refused() -> None:
    """torch.nn.utils.weight_norm (the old one) keeps a computed weight deepcopy refuses."""
    model = nn.Sequential(nn.utils.weight_norm(nn.Linear(5, 7)), nn.Tanh(), nn.Linear(7, 3))
    model(torch.randn(2, 5))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    with pytest.raises(BatchboundError, match=r"dtype=torch.float64 .* copy.deepcopy cannot"):
        measure(model, (x, y), "cross_entropy", dtype=torch.float64)


class SqueezedRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x))).squeeze()  # (n,), and a number on one example


@pytest.mark.parametrize("engine", ["auto", "hooks", "vmap", "loop"])
def test_mse_on_a_squeezed_output_takes_one_example_as_one(engine: str) -> None:
    """The checks run single examples, whose squeezed output is a number: mse read its
    first dimension (IndexError)."""
    torch.manual_seed(15)
    model = SqueezedRegression().double()
    x, y = torch.randn(24, 8, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    S = 0.0
    for i in range(24):
        model.zero_grad()
        ((model(x[i : i + 1]) - y[i]) ** 2).backward()
        S += sum(float(p.grad.square().sum()) for p in model.parameters())
    got = measure(model, (x, y), "mse", chunk_size=8, engine=engine).S
    assert got == pytest.approx(S, rel=1e-9)


class SharedMaskAttention(nn.Module):
    """Called as ``model(ids, causal)``, the (T, T) mask shared by the batch."""

    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.e, self.q, self.o = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, ids: Tensor, causal: Tensor) -> Tensor:
        h = self.e(ids)
        a = (self.q(h) @ h.transpose(1, 2)).masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((a @ h)[:, -1])


def test_a_shared_argument_with_the_batchs_rows_is_named_when_the_split_fails() -> None:
    """A (T, T) mask whose T equals the batch's size is split as if it held the examples;
    the model's own error on the split came out as torch's RuntimeError."""
    torch.manual_seed(16)
    steps = 8
    pairs = [(torch.randint(1, 30, (steps,)), int(torch.randint(0, 3, ()))) for _ in range(24)]

    def collate(batch: list) -> tuple[tuple[Tensor, Tensor], Tensor]:
        causal = torch.tril(torch.ones(steps, steps, dtype=torch.bool))
        return (torch.stack([t for t, _ in batch]), causal), torch.tensor([c for _, c in batch])

    loader = torch.utils.data.DataLoader(pairs, batch_size=steps, collate_fn=collate)
    with pytest.raises(BatchboundError, match=r"splits by example every tensor whose first "
                                              r"dimension is the batch's 8, here argument 0, "
                                              r"argument 1"):
        measure(SharedMaskAttention(), loader, "cross_entropy")
