"""measure() and watch() on Hugging Face models from configs not tried before,
as outside users call them (``model(**batch)``, a per-sequence loss written by the user),
each against the float64 per-example loop at the same weights: GPT-NeoX, Llama with grouped
query attention, T5 (encoder-decoder, decoder_input_ids, -100 labels), BertForMaskedLM with
-100 labels, DistilBERT with tied word embeddings, BART with layerdrop; watch in train mode
with gradient checkpointing on; and a LoRA adapter written by hand, whose frozen base
weights are not measured."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from batchbound.diversity import OnlineDiversity, measure, watch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB, LENGTH, B = 40, 8, 5
LAYERS = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
              num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=32,
              use_cache=False)


def tokens(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, LENGTH), generator=g)
    mask = (torch.arange(LENGTH) < LENGTH - torch.arange(B)[:, None] % 3).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def masked_tokens() -> dict[str, torch.Tensor]:
    batch = tokens()
    batch["labels"][:, ::2] = -100  # only some positions are predicted
    return batch


def seq2seq() -> dict[str, torch.Tensor]:
    batch = tokens()
    labels = torch.randint(2, VOCAB, (B, 5), generator=torch.Generator().manual_seed(9))
    labels[0, 3:] = -100
    batch["labels"] = labels
    batch["decoder_input_ids"] = torch.cat([torch.zeros(B, 1, dtype=torch.long),
                                            labels[:, :-1].clamp(min=0)], 1)
    return batch


def causal(out, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                           ignore_index=-100, reduction="none").sum(1)


def per_token(out, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out.logits.transpose(1, 2), batch["labels"], ignore_index=-100,
                           reduction="none").sum(1)


CASES = {
    "gpt-neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **LAYERS, hidden_dropout=0.1, attention_dropout=0.1)), tokens, causal, 1e-10),
    # Llama's and T5's norms compute in float32 inside a float64 model: float32's rounding
    "llama-gqa": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **LAYERS, num_key_value_heads=2)), tokens, causal, 1e-6),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
        use_cache=False)), seq2seq, per_token, 1e-6),
    "bert-mlm": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(**{
        k: v for k, v in LAYERS.items() if k != "use_cache"})), masked_tokens, per_token,
        1e-10),
    "distilbert-tied": (lambda: transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        n_layers=2, dim=32, hidden_dim=48, n_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, tie_word_embeddings=True)), masked_tokens, per_token, 1e-10),
    # separate key biases, whose exact gradient is 0 (softmax ignores a shift): the step's
    # .grad holds rounding noise there, once refused as "a regulariser in the loss"; layerdrop
    # draws whole layers at random (the replayed masks must be the step's own)
    "bart-layerdrop": (lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=32, encoder_layerdrop=0.5,
        decoder_layerdrop=0.5, dropout=0.1, use_cache=False)), seq2seq, per_token, 1e-6),
}


def loop(model: nn.Module, batch: dict[str, torch.Tensor], loss, seed: int = 0
         ) -> tuple[float, float]:
    """S and T from one forward of the batch (its dropout masks, drawn from ``seed``), one
    backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    losses = loss(model(**batch), batch)
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(losses.shape[0]):
        for t, g in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True,
                                                   materialize_grads=True), strict=True):
            t += g
            S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[name][0]().double()


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("name", list(CASES))
def test_measure_equals_the_loop(name: str) -> None:
    _, data, loss, rel = CASES[name]
    model, batch = build(name).eval(), data()
    S, T = loop(model, batch, loss)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(B)]
    report = measure(model, DataLoader(rows, batch_size=3), loss, chunk_size=2)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(S, rel=rel)
    assert got_t == pytest.approx(T, rel=rel)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_watch_in_train_mode_equals_the_steps_own_per_example_gradients(
        name: str, checkpointing: bool) -> None:
    """Train mode: dropout on (its masks the step's own), gradient checkpointing on or off."""
    _, data, loss, rel = CASES[name]
    model, batch = build(name).train(), data()
    if checkpointing:
        model.gradient_checkpointing_enable()
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost, transformers' deprecations
        with watch(model, monitor):
            torch.manual_seed(3)
            loss(model(**batch), batch).mean().backward()
    model.zero_grad()
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(*loop(model, batch, loss, seed=3), B)
    assert monitor.m2 == pytest.approx(want.m2, rel=rel)
    assert monitor.cross == pytest.approx(want.cross, rel=100 * rel, abs=rel * want.m2)


class LoRALinear(nn.Module):
    """A frozen base weight and a trainable low-rank update, as users write LoRA by hand."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t() * 2.0


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
def test_a_hand_written_lora_measures_the_trainable_parameters_only() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0], model[2] = LoRALinear(model[0]), LoRALinear(model[2])
    model = model.double()
    x = torch.randn(B, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (B,))
    report = measure(model, (x, y), "cross_entropy", chunk_size=2)
    assert sorted(report.per_parameter_S) == ["0.a", "0.b", "2.a", "2.b"]
    rows = [{"x": x[i], "y": y[i]} for i in range(B)]
    S, T = 0.0, None
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for row in rows:
        grads = torch.autograd.grad(F.cross_entropy(model(row["x"][None]), row["y"][None]),
                                    params)
        for t, g in zip(total, grads, strict=True):
            t += g
            S += float(g.square().sum())
    T = float(sum(t.square().sum() for t in total))
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(S, rel=1e-12)
    assert got_t == pytest.approx(T, rel=1e-12)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(model, monitor):
            F.cross_entropy(model(x), y).backward()
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, T, B)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-12)
    assert monitor.cross == pytest.approx(want.cross, rel=1e-10)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
