"""The language-model families gpt and lstm: shapes, options and one-line errors; the summed
token loss; Δ exact on both against the float64 per-example loop; next-token accuracy in
evaluation; and what TrainConfig accepts for a text task."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import assert_exact
from torch.func import vmap

from batchbound.data import load_dataset
from batchbound.diversity import measure, per_example_stats, resolve_loss, sequence_cross_entropy
from batchbound.errors import BatchboundError
from batchbound.models import build_model, count_parameters, describe_model, model_shape
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.evaluate import evaluate

VOCAB = 98


def tokens(n: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, steps), generator=g),
            torch.randint(0, VOCAB, (n, steps), generator=g))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"Line {i}: a small text, with words.\n" for i in range(40)))
    return path


@pytest.mark.parametrize("spec,resolved", [
    ("gpt", "gpt(depth=2,width=64,heads=4,context=12,tie=true)"),
    ("gpt(depth=1,width=16,heads=2,context=12,tie=false)",
     "gpt(depth=1,width=16,heads=2,context=12,tie=false)"),
    ("lstm", "lstm(layers=1,hidden=64,emb=64,tie=false)"),
    ("lstm(layers=2,hidden=8,tie=true)", "lstm(layers=2,hidden=8,emb=8,tie=true)"),
])
def test_families_build_per_token_logits(spec: str, resolved: str) -> None:
    model = build_model(spec, (12,), VOCAB, seed=0)
    shape = model_shape(model)
    assert shape is not None and shape.resolved == resolved and shape.tokens
    x, _ = tokens(3, 12)
    assert model(x).shape == (3, 12, VOCAB)
    assert model(x[:, :5]).shape == (3, 5, VOCAB)  # shorter prompts work too
    rebuilt = build_model(resolved, (12,), VOCAB, seed=0)
    assert count_parameters(rebuilt) == count_parameters(model)
    described = describe_model(spec, (12,), VOCAB)  # meta device, int64 dummy batch
    assert described.params == count_parameters(model) and described.resolved == resolved


def test_tied_head_shares_the_embedding() -> None:
    tied = build_model("gpt(width=16,heads=2)", (8,), VOCAB, seed=0)
    untied = build_model("gpt(width=16,heads=2,tie=false)", (8,), VOCAB, seed=0)
    assert tied.lm_head.weight is tied.wte.weight
    assert count_parameters(untied) - count_parameters(tied) == VOCAB * 16


@pytest.mark.parametrize("spec,shape,message", [
    ("gpt(context=16)", (12,), "context=16 does not match the data's context 12"),
    ("gpt", (1, 28, 28), r"needs token input of shape \(context,\)"),
    ("gpt(width=10,heads=4)", (12,), "width 10 must be a multiple of heads 4"),
    ("gpt(tie=yes)", (12,), "tie must be true or false"),
    ("gpt(depth=0)", (12,), "depth must be an integer >= 1"),
    ("lstm(hidden=8,emb=4,tie=true)", (12,), r"emb \(4\) must equal hidden \(8\)"),
    ("lstm(layers=1.5)", (12,), "layers must be an integer >= 1"),
    ("lstm(dropout=0.1)", (12,), "no option 'dropout'"),
])
def test_bad_options_are_one_line_errors(spec: str, shape: tuple, message: str) -> None:
    with pytest.raises(BatchboundError, match=message):
        build_model(spec, shape, VOCAB)


@pytest.mark.parametrize("spec", ["gpt(width=16,heads=2)", "lstm(hidden=8)"])
def test_float_features_and_long_sequences_are_refused(spec: str) -> None:
    model = build_model(spec, (8,), VOCAB, seed=0)
    with pytest.raises(BatchboundError, match=r"integer token ids.*text data set"):
        model(torch.randn(2, 8))
    if spec.startswith("gpt"):
        with pytest.raises(BatchboundError, match="9 tokens exceed the context 8"):
            model(torch.zeros(2, 9, dtype=torch.long))


def test_sequence_cross_entropy_sums_token_losses() -> None:
    torch.manual_seed(0)
    logits, y = torch.randn(4, 6, VOCAB, dtype=torch.float64), tokens(4, 6)[1]
    per_token = -logits.log_softmax(-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(sequence_cross_entropy(logits, y), per_token.sum(1))
    one = vmap(lambda o, t: sequence_cross_entropy(o[None], t[None])[0])(logits, y)
    torch.testing.assert_close(one, per_token.sum(1))
    assert resolve_loss(None, "text") is sequence_cross_entropy
    assert resolve_loss("sequence_cross_entropy") is sequence_cross_entropy
    with pytest.raises(BatchboundError, match=r"shape \(n, context, vocabulary\)"):
        sequence_cross_entropy(logits[:, 0], y[:, 0])
    with pytest.raises(BatchboundError, match=r"integer next tokens of shape \(4, 6\)"):
        sequence_cross_entropy(logits, y[:, :5])
    with pytest.raises(BatchboundError, match=r"tokens must be in \[0, 98\)"):
        sequence_cross_entropy(logits, y + VOCAB)
    with pytest.raises(BatchboundError, match="need loss='sequence_cross_entropy'"):
        resolve_loss("cross_entropy")(logits, y)  # the classification loss names it


@pytest.mark.parametrize("spec", [
    "gpt(depth=2,width=16,heads=2)",
    "gpt(depth=1,width=12,heads=3,tie=false)",
    "lstm(hidden=12)",
    "lstm(layers=2,hidden=8,tie=true)",
    "lstm(layers=2,hidden=8,emb=5)",
])
def test_per_example_norms_are_exact(spec: str) -> None:
    """Every parameter's per-sequence squared norms and the gradient sum, hooks (layer rules,
    no fallback, no warning) against one float64 backward per sequence."""
    model = build_model(spec, (10,), VOCAB, seed=1)
    x, y = tokens(5, 10, seed=2)
    assert_exact(model, x, y, sequence_cross_entropy)
    # the hook engine alone (it raises where a layer has no rule) agrees too
    assert_exact(model, x, y, sequence_cross_entropy, engine="hooks")


@pytest.mark.parametrize("spec", ["gpt(width=16,heads=2)", "lstm(hidden=12,layers=2)"])
def test_measure_on_a_text_set_equals_the_loop(spec: str, corpus: Path) -> None:
    ds = load_dataset(f"text(path={corpus},context=16)")
    model = build_model(spec, ds.input_shape, ds.num_outputs, seed=0).double()
    exact = measure(model, ds, engine="loop")
    got = measure(model, ds, chunk_size=16)  # several chunks
    assert got.extra["fallback_parameters"] == [] and got.extra["loss_name"] == \
        "sequence_cross_entropy"
    assert got.n == ds.n_train > 16
    for key in ("S", "T", "diversity"):
        assert getattr(got, key) == pytest.approx(getattr(exact, key), rel=1e-9), key
    # the loss is the per-sequence sum: about context·ln(V) at a near-uniform initialisation
    assert got.loss == pytest.approx(16 * torch.log(torch.tensor(98.0)).item(), rel=0.05)
    stats = per_example_stats(model, ds.x_train[:4], ds.y_train[:4], sequence_cross_entropy)
    assert stats.losses.shape == (4,) and not stats.fallback


def test_evaluate_reports_next_token_accuracy(corpus: Path) -> None:
    ds = load_dataset(f"text(path={corpus},context=16)")
    model = build_model("lstm(hidden=8)", ds.input_shape, ds.num_outputs, seed=0)
    got = evaluate(model, ds.x_train, ds.y_train, sequence_cross_entropy, DistContext(),
                   chunk_size=7, classification=False)
    with torch.no_grad():
        out = model(ds.x_train)
    expected_acc = (out.argmax(-1) == ds.y_train).double().mean().item()
    expected_loss = sequence_cross_entropy(out, ds.y_train).double().mean().item()
    assert got["acc"] == pytest.approx(expected_acc, abs=1e-12)
    assert got["loss"] == pytest.approx(expected_loss, rel=1e-6)
    # a model that predicts the next token perfectly: accuracy 1
    class Oracle(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.one_hot(self.targets, VOCAB).float() * 50

    oracle = Oracle()
    oracle.targets = ds.y_train
    perfect = evaluate(oracle, ds.x_train, ds.y_train, sequence_cross_entropy, DistContext(),
                       chunk_size=ds.n_train, classification=False)
    assert perfect["acc"] == 1.0


def test_train_config_accepts_accuracy_targets_on_text(corpus: Path) -> None:
    ds = load_dataset(f"text(path={corpus},context=16)")
    TrainConfig(batch_size=8, model="lstm", targets=({"metric": "train_acc", "threshold": 0.5},)
                ).validate_against(ds)
    with pytest.raises(BatchboundError, match="loss 'cross_entropy' does not fit a text task"):
        TrainConfig(batch_size=8, model="lstm", loss="cross_entropy").validate_against(ds)
    with pytest.raises(BatchboundError, match="fc reads float features, but text is a text"):
        TrainConfig(batch_size=8).validate_against(ds)  # the default model, fc
    with pytest.raises(BatchboundError, match="gpt reads token ids, but digits is a"):
        TrainConfig(model="gpt").validate_against(load_dataset("digits"))
    digits = load_dataset("digits")
    with pytest.raises(BatchboundError, match="sequence_cross_entropy is for text"):
        TrainConfig(loss="sequence_cross_entropy").validate_against(digits)
    regression = load_dataset("synthetic-linear(n=50,d=3)")
    with pytest.raises(BatchboundError, match="needs accuracy"):
        TrainConfig(batch_size=8, targets=({"metric": "train_acc", "threshold": 0.5},)
                    ).validate_against(regression)
