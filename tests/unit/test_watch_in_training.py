"""``watch`` where people train (issue 35): mixed precision, layers without a rule (computed in
the same step by the exact fallback), several inputs, dataclass outputs, user hooks,
checkpointing and sparse gradients. Each class against the float64 per-example loop."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import (
    CheckpointedBlock,
    DataclassOut,
    DoRALinear,
    FiLM,
    TinyViT,
    loop_S_T,
)

from batchbound.diversity import (
    OnlineDiversity,
    inputs,
    measure,
    monitored_step,
    per_example_stats,
    watch,
)
from batchbound.errors import BatchboundError

transformers = pytest.importorskip("transformers")


def watch_exact(model: nn.Module, args: tuple, kwargs: dict, loss: Callable[[Any, Tensor], Tensor],
                y: Tensor, *, rel: float = 1e-9, warns: str | None = None,
                warned_before: bool = False) -> OnlineDiversity:
    """watch() around ``loss(model(*args, **kwargs), y).backward()`` (a sum over examples)
    gives the monitor the float64 per-example loop's S and T, to ``rel``."""
    n = y.shape[0]
    reference = copy.deepcopy(model)
    S, T = loop_S_T(reference, args, kwargs, lambda out, i: loss(out, y[i : i + 1]), n)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor, reduction="sum"):
            loss(model(*args, **kwargs), y).backward()
    messages = [str(w.message) for w in caught if "batchbound" in str(w.message)]
    if warned_before:  # once per model and set of reasons
        pass
    elif warns is None:
        assert not messages, messages
    else:
        assert any(warns in m for m in messages), messages
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, n)
    assert monitor.m2 == pytest.approx(expected.m2, rel=rel)
    assert monitor.cross == pytest.approx(expected.cross, rel=rel, abs=rel * expected.m2)
    return monitor


def ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="sum")


# ------------------------------------------------------------- mixed precision


def _gpt2(context: int) -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=context,
                                     vocab_size=64, attn_pdrop=0.0, resid_pdrop=0.0,
                                     embd_pdrop=0.0)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


def _token_loss(out: Any, y: Tensor) -> Tensor:
    logits = out.logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


@pytest.mark.parametrize("context", [64, 256])
def test_bf16_autocast_step_of_gpt2_within_2_percent_of_float64(context: int) -> None:
    """The stock HF GPT-2 under torch.autocast(bfloat16) around the step: a number, S within
    2 % of the float64 per-example loop, the precision stated on the monitor and warned."""
    torch.manual_seed(0)
    model = _gpt2(context)
    n = 4
    x, y = torch.randint(0, 64, (n, context)), torch.randint(0, 64, (n, context))
    exact = copy.deepcopy(model).double()
    S, T = loop_S_T(exact, (x,), {}, lambda out, i: _token_loss(out, y[i : i + 1]), n)
    monitor = OnlineDiversity(1000, decay=0.0)
    with pytest.warns(UserWarning, match="computes in bfloat16.*autocast"), \
            watch(model, monitor, reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        _token_loss(out, y).backward()
    assert monitor.m2 * n == pytest.approx(S, rel=0.02)
    assert monitor.precision.startswith("bfloat16 (autocast")
    assert T > 0


class AutocastInside(nn.Module):
    """A float32 model whose own forward runs its middle under bfloat16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.b(h))
        return self.c(h.to(x.dtype))


def test_autocast_inside_a_float32_forward_is_stated_not_silent() -> None:
    """measure and watch say bfloat16, not float32, and agree with the float64 loop as far
    as bfloat16 allows."""
    torch.manual_seed(1)
    model = AutocastInside()
    x, y = torch.randn(16, 12), torch.randint(0, 4, (16,))
    exact = measure(copy.deepcopy(model), (x, y), "cross_entropy", dtype=torch.float64,
                    engine="loop")
    with pytest.warns(UserWarning, match="computes in bfloat16 \\(autocast"):
        report = measure(model, (x, y), "cross_entropy")
    assert report.dtype == "bfloat16" and report.extra["precision"].startswith("bfloat16")
    assert pytest.approx(exact.S, rel=0.02) == report.S
    monitor = OnlineDiversity(1000, decay=0.0)
    with pytest.warns(UserWarning, match="computes in bfloat16"), \
            watch(model, monitor, reduction="sum"):
        ce(model(x), y).backward()
    assert monitor.m2 * 16 == pytest.approx(exact.S, rel=0.02)
    assert monitor.precision.startswith("bfloat16")


# ---------------------------------- layers without a rule: the fallback, in the same step


def _t5() -> nn.Module:
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                   relative_attention_num_buckets=8)
    return transformers.T5ForConditionalGeneration(config)


def test_t5_with_relative_position_bias() -> None:
    torch.manual_seed(2)
    model = _t5().double()
    n = 4
    ids, dec = torch.randint(0, 40, (n, 7)), torch.randint(0, 40, (n, 5))
    y = torch.randint(0, 40, (n, 5))

    def loss(out: Any) -> Tensor:
        return F.cross_entropy(out.logits.reshape(-1, 40), y.reshape(-1), reduction="sum")

    def example_loss(out: Any, i: int) -> Tensor:
        return F.cross_entropy(out.logits.reshape(-1, 40), y[i].reshape(-1), reduction="sum")

    S, T = loop_S_T(copy.deepcopy(model), (ids,), {"decoder_input_ids": dec}, example_loss, n)
    monitor = OnlineDiversity(1000, decay=0.0)
    with pytest.warns(UserWarning, match="relative_attention_bias"), \
            watch(model, monitor, reduction="sum"):
        loss(model(ids, decoder_input_ids=dec)).backward()
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, n)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8, abs=1e-9 * expected.m2)


def test_vit_with_patch_conv_cls_token_and_learned_positions() -> None:
    torch.manual_seed(3)
    x, y = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    watch_exact(TinyViT().double(), (x,), {}, ce, y,
                warns="cls_token")


def test_dora_adapter() -> None:
    torch.manual_seed(4)
    model = nn.Sequential(DoRALinear(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    watch_exact(model, (x,), {}, ce, y, warns="lora_A")


@pytest.mark.parametrize("how", ["weight_norm", "orthogonal"])
def test_parametrized_linear(how: str) -> None:
    torch.manual_seed(5)
    parametrize = getattr(nn.utils.parametrizations, how)
    model = nn.Sequential(parametrize(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    watch_exact(model, (x,), {}, ce, y, warns="parametrizations")


def test_conv_transpose_2d() -> None:
    torch.manual_seed(6)
    model = nn.Sequential(nn.ConvTranspose2d(2, 3, 3, stride=2), nn.Tanh(), nn.Flatten(),
                          nn.Linear(3 * 9 * 9, 3)).double()
    x, y = torch.randn(5, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    watch_exact(model, (x,), {}, ce, y)  # its rule: the adjoint Conv2d's, roles exchanged


class BagClassifier(nn.Module):
    def __init__(self, mode: str = "mean") -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(30, 8, mode=mode), nn.Linear(8, 3)

    def forward(self, ids: Tensor, weights: Tensor | None = None) -> Tensor:
        return self.head(self.bag(ids, per_sample_weights=weights))


@pytest.mark.parametrize("mode", ["mean", "sum", "weighted", "max"])
def test_embedding_bag(mode: str) -> None:
    """Its rule for bags of equal length (sum, mean, per-sample weights); mode='max' by the
    fallback."""
    torch.manual_seed(7)
    x, y = torch.randint(0, 30, (6, 5)), torch.randint(0, 3, (6,))
    kwargs = {"weights": torch.rand(6, 5, dtype=torch.float64)} if mode == "weighted" else {}
    model = BagClassifier("sum" if mode == "weighted" else mode).double()
    watch_exact(model, (x,), kwargs, ce, y, warns="mode='max'" if mode == "max" else None)


# ------------------------------------------- inputs, outputs, hooks, checkpointing, sparse


def test_film_model_with_two_inputs() -> None:
    torch.manual_seed(8)
    img, cond = torch.randn(5, 3, 6, 6, dtype=torch.float64), torch.randn(5, 4,
                                                                          dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    watch_exact(FiLM().double(), (img,), {"cond": cond}, ce, y)
    torch.manual_seed(8)
    watch_exact(FiLM().double(), (img, cond), {}, ce, y)


def test_hf_model_with_labels_computes_its_loss_inside() -> None:
    """model(input_ids, labels=...): the loss is a mean over all tokens of the batch, a sum of
    per-example terms; the loss the model returns is the one backpropagated."""
    torch.manual_seed(9)
    model = _gpt2(8).double()
    n = 3
    x = torch.randint(0, 64, (n, 8))
    tokens = n * 7  # the shifted tokens the batch's mean runs over

    def example_loss(out: Any, i: int) -> Tensor:
        logits = out.logits[:, :-1].reshape(-1, 64)
        return F.cross_entropy(logits, x[i, 1:], reduction="sum") / tokens

    S, T = loop_S_T(copy.deepcopy(model), (x,), {}, example_loss, n)
    monitor = OnlineDiversity(1000, decay=0.0)
    with watch(model, monitor, reduction="sum"):
        model(input_ids=x, labels=x).loss.backward()
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, n)
    # HF computes its loss in float32 (logits.float()), even for a float64 model
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-6)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-6)


def test_dataclass_output() -> None:
    torch.manual_seed(10)
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    watch_exact(DataclassOut().double(), (x,), {}, lambda out, t: ce(out.logits, t), y)


def test_user_forward_hook_that_changes_a_layer_output() -> None:
    """A clamp in a forward hook: the rule needs the gradient of the layer's own output."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model[0].register_forward_hook(lambda m, args, out: out.clamp(-0.3, 0.3))
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    watch_exact(model, (x,), {}, ce, y)
    # ... also a hook that starts acting after the first (checked) step
    torch.manual_seed(11)
    late = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    on = {"clamp": False}
    late[0].register_forward_hook(
        lambda m, args, out: out.clamp(-0.3, 0.3) if on["clamp"] else None)
    watch_exact(late, (x,), {}, ce, y)
    on["clamp"] = True
    late.zero_grad()
    # the first step the hook acts on ran another program than the step its rows were
    # checked on: the exact fallback takes it (rows.RowChecks); the next are tracked again
    watch_exact(late, (x,), {}, ce, y, warns="ran operations other than")
    late.zero_grad()
    watch_exact(late, (x,), {}, ce, y)


def test_user_forward_hook_that_hooks_the_output_gradient() -> None:
    """A gradient logger (a forward hook that registers a hook on the layer's output): the
    checks' own forward passes run with gradients on, as training does, so it does not fail
    there (it raised torch's 'cannot register a hook on a tensor that doesn't require
    gradient' from the determinism check's no_grad forward)."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    logged: list[float] = []

    def log_gradient(module: nn.Module, args: tuple, out: Tensor) -> None:
        out.register_hook(lambda g: logged.append(float(g.norm())))

    model[1].register_forward_hook(log_gradient)
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    for _ in range(2):
        model.zero_grad()
        watch_exact(model, (x,), {}, ce, y)
    assert logged
    reference = measure(copy.deepcopy(model), (x, y), "cross_entropy", engine="loop")
    assert pytest.approx(reference.S, rel=1e-9) == measure(model, (x, y), "cross_entropy").S


def test_non_reentrant_checkpoint_around_layer_norm() -> None:
    torch.manual_seed(12)
    x, y = torch.randn(6, 5, 8, dtype=torch.float64), torch.randint(0, 3, (6, 5))
    watch_exact(CheckpointedBlock().double(), (x,), {},
                lambda out, t: ce(out.reshape(-1, 3), t.reshape(-1)), y)


def test_sparse_embedding() -> None:
    torch.manual_seed(13)
    model = nn.Sequential(nn.Embedding(20, 6, sparse=True), nn.Flatten(),
                          nn.Linear(24, 3)).double()
    x, y = torch.randint(0, 20, (6, 4)), torch.randint(0, 3, (6,))
    watch_exact(model, (x,), {}, ce, y)


def test_float64_copy_of_a_model_with_parameter_hooks_is_refused() -> None:
    """A dtype copy drops tensor hooks on parameters: measure(dtype=...) says so."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(6, 3))
    model[0].weight.register_hook(lambda g: g * 10)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with pytest.raises(BatchboundError, match=r"hook.*0\.weight"):
        measure(model, (x, y), "cross_entropy", dtype=torch.float64)


def test_film_model_through_monitored_step_and_per_example_stats() -> None:
    """Several inputs through the other paths: ``inputs(img, cond=...)``."""
    torch.manual_seed(15)
    img, cond = torch.randn(5, 3, 6, 6, dtype=torch.float64), torch.randn(5, 4,
                                                                          dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    model = FiLM().double()
    S, T = loop_S_T(copy.deepcopy(model), (img,), {"cond": cond},
                    lambda out, i: ce(out, y[i : i + 1]), 5)
    stats = per_example_stats(model, inputs(img, cond=cond), y, "cross_entropy")
    assert pytest.approx(S, rel=1e-9) == stats.S and pytest.approx(T, rel=1e-9) == stats.T
    monitor = OnlineDiversity(1000, decay=0.0)
    monitored_step(model, inputs(img, cond=cond), y, "cross_entropy", monitor, reduction="sum")
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, 5)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)


class Gain(nn.Module):
    """A layer of the user's own, with no rule: the fallback takes it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


def test_float16_autocast_with_a_grad_scaler() -> None:
    """fp16 with a GradScaler: M2 carries the scale squared (Δ does not); a step whose
    gradients overflow is skipped by the monitor, as by the scaler, with a warning."""
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Gain(16), nn.Linear(16, 3))
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    S, T = loop_S_T(copy.deepcopy(model).double(), (x.double(),), {},
                    lambda out, i: ce(out, y[i : i + 1]), 6)
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, 6)
    for scale, steps in ((2.0**12, 1), (2.0**100, 0)):
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        monitor = OnlineDiversity(1000, decay=0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with watch(model, monitor, reduction="sum"):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                scaler.scale(ce(out.float(), y)).backward()
        model.zero_grad()
        assert monitor.steps == steps
        assert monitor.precision.startswith("float16 (autocast")
        if steps:
            assert monitor.m2 / scale**2 == pytest.approx(expected.m2, rel=0.02)
        else:
            assert any("overflowed" in str(w.message) for w in caught)


@pytest.mark.parametrize("strategy", ["gram", "conv", "patches", "shifts"])
@pytest.mark.parametrize("kernel,groups", [(3, 1), (1, 2)])
def test_conv_transpose_rule_every_strategy(strategy: str, kernel: int, groups: int) -> None:
    """The transposed layer's rule through each of the conv rule's ways of computing norms."""
    from reference import assert_exact, feature_loss, feature_targets

    from batchbound.diversity.rules.conv import force_strategy

    torch.manual_seed(17)
    model = nn.ConvTranspose2d(4, 6, kernel, stride=2, padding=kernel // 2, output_padding=1,
                               groups=groups).double()
    x = torch.randn(3, 4, 5, 4, dtype=torch.float64)
    with force_strategy(strategy):
        assert_exact(model, x, feature_targets(model, x), feature_loss, engine="hooks")


def test_film_model_measured_from_a_data_loader_of_input_pairs() -> None:
    """measure over a DataLoader whose batches are ((img, cond), y): model(img, cond)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(18)
    img, cond = torch.randn(10, 3, 6, 6, dtype=torch.float64), torch.randn(10, 4,
                                                                            dtype=torch.float64)
    y = torch.randint(0, 3, (10,))
    model = FiLM().double()
    S, T = loop_S_T(copy.deepcopy(model), (img, cond), {}, lambda out, i: ce(out, y[i : i + 1]),
                    10)
    pairs = [((a, c), t) for a, c, t in zip(img, cond, y, strict=True)]
    loader = DataLoader(pairs, batch_size=4)
    report = measure(model, loader, "cross_entropy")
    assert report.n == 10 and report.extra["fallback_parameters"] == []
    assert pytest.approx(S, rel=1e-9) == report.S
    assert pytest.approx(T, rel=1e-9) == report.T


def test_hf_gradient_checkpointing() -> None:
    """HF's gradient_checkpointing_enable() around GPT-2's LayerNorms, in train mode."""
    torch.manual_seed(19)
    model = _gpt2(8).double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    x, y = torch.randint(0, 64, (3, 8)), torch.randint(0, 64, (3, 8))
    watch_exact(model, (x,), {}, _token_loss, y)


def test_bf16_autocast_with_the_fallback() -> None:
    """A layer without a rule under bf16 autocast: the fallback runs under the same autocast,
    and the step's precision is stated."""
    torch.manual_seed(20)
    model = TinyViT()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 3, (6,))
    S, _ = loop_S_T(copy.deepcopy(model).double(), (x.double(),), {},
                    lambda out, i: ce(out, y[i : i + 1]), 6)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor, reduction="sum"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            ce(out.float(), y).backward()
    messages = " ".join(str(w.message) for w in caught)
    assert "cls_token" in messages and "computes in bfloat16" in messages
    assert monitor.m2 * 6 == pytest.approx(S, rel=0.02)


class GainDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.gain, self.head = nn.Linear(6, 8), Gain(8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.dropout(self.gain(torch.tanh(self.body(x))), 0.3, self.training))


def test_fallback_with_dropout_in_train_mode_then_eval() -> None:
    """In train mode the fallback replays the batch's forward with the step's own dropout
    masks (exact: tests/unit/test_watch_dropout_replay.py), and the warning says so; in eval
    mode, exact."""
    torch.manual_seed(21)
    model = GainDropout().double()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    monitor = OnlineDiversity(1000, decay=0.0)
    with pytest.warns(UserWarning, match="replayed with its own random numbers"), \
            watch(model, monitor):
        ce(model(x), y).backward()
    assert monitor.steps == 1
    model.eval()
    model.zero_grad()
    watch_exact(model, (x,), {}, ce, y, warned_before=True)


def test_fallback_norms_under_a_mean_loss_are_rescaled_like_the_rules() -> None:
    """A mean loss divides every per-example gradient by b, the fallback's too: S_B (rules'
    and fallback's norms together) and T_B are rescaled by b² alike, so watch under
    reduction="mean" gives the float64 loop's S and T on a model that needs the fallback."""
    torch.manual_seed(22)
    model = TinyViT().double()
    x, y = torch.randn(5, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (5,))
    S, T = loop_S_T(copy.deepcopy(model), (x,), {}, lambda out, i: ce(out, y[i : i + 1]), 5)
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, 5)
    monitor = OnlineDiversity(1000, decay=0.0)
    with pytest.warns(UserWarning, match="cls_token"), watch(model, monitor):
        F.cross_entropy(model(x), y).backward()
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8, abs=1e-9 * expected.m2)


def test_a_loaders_last_batch_of_one_leaves_the_monitor_and_the_step_alone() -> None:
    """17 examples in batches of 8: the last batch holds one. Its step trains as usual and
    the monitor is left as it was (a warning, once), where it used to raise at the block's
    end and stop the loop before the optimizer's step."""
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(17, 6, dtype=torch.float64), torch.randint(0, 3, (17,))
    monitor = OnlineDiversity(17, decay=0.0)
    for start in (0, 8):
        with watch(model, monitor):
            F.cross_entropy(model(x[start:start + 8]), y[start:start + 8]).backward()
    folded = monitor.steps
    model.zero_grad()
    with pytest.warns(UserWarning, match="a batch of one example"), watch(model, monitor):
        F.cross_entropy(model(x[16:]), y[16:]).backward()
    assert monitor.steps == folded
    reference = copy.deepcopy(model)
    reference.zero_grad()
    F.cross_entropy(reference(x[16:]), y[16:]).backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # the user's gradients, untouched
