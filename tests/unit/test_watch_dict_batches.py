"""``watch`` on Hugging Face dict batches as an outside user calls it, ``model(**batch)``
inside the block and the loss a mean over the batch's sequences: a float32 GPT-2 padded with
mask 0 and -100 labels, over several SGD steps; a BERT classifier with token_type_ids; and
bf16 autocast on CPU. Each against the float64 per-example loop at the same weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from batchbound.diversity import OnlineDiversity, watch

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
VOCAB, LENGTH, B = 23, 10, 6


def padded(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, LENGTH), generator=g)
    mask = (torch.arange(LENGTH) < LENGTH - (torch.arange(B)[:, None] * 7 + seed) % 6).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def lm_loss(outputs, batch: dict[str, Tensor]) -> Tensor:
    """Each sequence's summed next-token cross entropy over its labelled tokens."""
    return F.cross_entropy(outputs.logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                           ignore_index=-100, reduction="none").sum(dim=1)


def cls_loss(outputs, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(outputs.logits, batch["labels"], reduction="none")


def loop(model: torch.nn.Module, batch: dict[str, Tensor], loss) -> tuple[float, float]:
    """S = Σ‖g_i‖², T = ‖Σ g_i‖², one example at a time, in float64."""
    model = copy.deepcopy(model).double()
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    S = 0.0
    for i in range(len(batch["labels"])):
        one = {k: v[i:i + 1] for k, v in batch.items()}
        for t, g in zip(total, torch.autograd.grad(loss(model(**one), one).sum(), params,
                                                   materialize_grads=True), strict=True):
            t += g
            S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


def expected(S: float, T: float, b: int) -> OnlineDiversity:
    monitor = OnlineDiversity(1000, decay=0.0)
    monitor.update_from_norms(S, T, b)
    return monitor


def test_gpt2_sgd_steps_on_padded_dicts_equal_the_loop() -> None:
    model = gpt2().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        batch = padded(step)
        want = expected(*loop(model, batch, lm_loss), B)  # at this step's weights
        monitor = OnlineDiversity(1000, decay=0.0)
        optimizer.zero_grad()
        with watch(model, monitor):  # reduction="mean": the mean over the sequences
            lm_loss(model(**batch), batch).mean().backward()
        optimizer.step()
        assert monitor.m2 == pytest.approx(want.m2, rel=1e-5)
        assert monitor.cross == pytest.approx(want.cross, rel=1e-4, abs=1e-5 * want.m2)


def test_bert_classifier_with_token_type_ids_equals_the_loop() -> None:
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3)).double()
    batch = padded(1)
    batch = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
             "token_type_ids": (torch.arange(LENGTH) >= 5).long().expand(B, LENGTH),
             "labels": torch.arange(B) % 3}
    want = expected(*loop(model, batch, cls_loss), B)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "batchbound. computing exact per-example")
        with watch(model, monitor, reduction="sum"):
            cls_loss(model(**batch), batch).sum().backward()
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(want.cross, rel=1e-9, abs=1e-9 * want.m2)


def test_bf16_autocast_on_padded_dicts_is_within_its_stated_precision() -> None:
    """watch under CPU bf16 autocast states the precision it ran in, and its numbers are
    the float64 loop's to within bf16's rounding."""
    model, batch = gpt2().train(), padded(0)
    want = expected(*loop(model, batch, lm_loss), B)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(model, monitor):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(model(**batch), batch).mean()
            loss.backward()
    assert monitor.precision is not None and "bfloat16" in str(monitor.precision)
    assert monitor.m2 == pytest.approx(want.m2, rel=2e-2)
    assert monitor.cross == pytest.approx(want.cross, abs=2e-2 * want.m2)


class SharedPositions(torch.nn.Module):
    """Adds a position embedding for ``positions`` of shape (L,), shared by the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.places = torch.nn.Embedding(50, 8), torch.nn.Embedding(B, 8)
        self.out = torch.nn.Linear(8, 50)

    def forward(self, input_ids: Tensor, positions: Tensor, labels: Tensor) -> Tensor:
        return self.out(self.tokens(input_ids) + self.places(positions))


def test_a_tensor_the_batch_shares_with_n_rows_is_refused_in_one_line() -> None:
    """positions of shape (L,) with L equal to the batch's size: watch splits it by example
    (as every tensor whose first dimension is n) and the model failed on the split with a
    bare RuntimeError traceback; now one line naming the split tensors. Where the model
    fails on the call as given too (Hugging Face's GPT-2 takes position_ids (L,) no more),
    that is said instead. Given (1, L), the same call equals the loop."""
    from batchbound.errors import BatchboundError

    model, batch = gpt2().double(), padded(0)
    batch = {"input_ids": batch["input_ids"][:, :B], "labels": batch["labels"][:, :B]}
    shared = SharedPositions().double()
    with pytest.raises(BatchboundError) as info, watch(shared, OnlineDiversity(1000, decay=0.0)):
        lm_loss(shared(**batch, positions=torch.arange(B)), batch).mean().backward()
    said = str(info.value)
    assert "positions" in said and "leading dimension of 1" in said and "\n" not in said
    with pytest.raises(BatchboundError) as info, watch(model, OnlineDiversity(1000, decay=0.0)):
        lm_loss(model(**batch, position_ids=torch.arange(B)), batch).mean().backward()
    assert str(info.value).startswith("the model raised on the batch as given, before any split")
    model.zero_grad()
    monitor = OnlineDiversity(1000, decay=0.0)
    with watch(model, monitor):
        lm_loss(model(**batch, position_ids=torch.arange(B)[None]), batch).mean().backward()
    want = expected(*loop(model, batch, lm_loss), B)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-9)
