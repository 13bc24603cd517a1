"""The precision watch() and measure() state is the one the backward actually ran in.

Hugging Face's LlamaRMSNorm and T5's layer norm compute in float32 inside a float64 model
(``hidden_states.to(torch.float32)``): the per-example gradients carry float32 rounding, and
a mean over b examples (b not a power of two) scales the gradient that float32 rounds, so
watch agreed with the float64 per-example loop to 7e-9 only, while it stated float64 (whose
self-check tolerance is 1e-8). Such a model is now stated float32; a float32 result off the
gradient's path (a model's own loss computed beside the logits, a table from buffers) does not
lower what is stated."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.diversity.precision import GradientPrecision

F32 = 100 * torch.finfo(torch.float32).eps  # agreement at float32's precision: 1.2e-5


def _watched(model: nn.Module, step, reduction: str = "mean") -> OnlineDiversity:
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost, transformers' deprecations
        with watch(model, monitor, reduction=reduction):
            step()
    model.zero_grad()
    return monitor


def _want(S: float, T: float, b: int) -> OnlineDiversity:
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, T, b)
    return want


def _loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss) -> tuple[float, float]:
    """S and T of the float64 per-example loop: one backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]), params)
        for t, g in zip(total, grads, strict=True):
            t += g
            S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


# ------------------------------------------------------------------ the mechanism itself


def test_a_lowered_result_counts_only_when_the_backward_reaches_it() -> None:
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    seen = GradientPrecision()
    used = (w * 2).float()
    unused = (w * 3).float()
    constant = torch.arange(3, dtype=torch.float64).float()  # nothing requires grad
    for out, inputs in ((used, [w]), (unused, [w]), (constant, [])):
        seen.see(out, inputs)
    seen.arm()
    assert seen.dtype is None  # nothing ran backward yet
    (used.double().sum() + constant.sum()).backward()
    assert seen.dtype == torch.float32
    lone = GradientPrecision()
    lone.see(unused, [w])
    lone.arm()
    w.grad = None
    (w * 5).sum().backward()  # never through ``unused``
    assert lone.dtype is None


# ------------------------------------------------------------------ hand-written models


class Float32Inside(nn.Module):
    """A float64 model whose middle computes in float32, as LlamaRMSNorm does; ``dead``: a
    float32 branch computed beside the output but returned to nobody's loss."""

    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)
        self.dead = dead
        self.register_buffer("table", torch.linspace(0.5, 1.5, 8, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        scale = (self.table * 2).to(h.dtype)  # a float32 constant from a buffer: exact here
        if self.dead:
            self.spare = torch.tanh(h.float())  # float32, but no loss reaches it
            return self.b(torch.tanh(h) * scale)
        inner = h.float()
        inner = inner * torch.rsqrt(inner.square().mean(-1, keepdim=True) + 1e-6)
        return self.b(torch.tanh(inner.to(h.dtype)) * scale)


def _data(b: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(b, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,),
                                                                              generator=g)


def _float64_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def test_a_plain_float64_model_is_stated_float64_and_agrees_to_1e12() -> None:
    torch.manual_seed(0)
    model, (x, y) = _float64_mlp(), _data()
    monitor = _watched(model, lambda: F.cross_entropy(model(x), y).backward())
    assert monitor.precision == "float64"
    want = _want(*_loop(model, x, y, F.cross_entropy), 5)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-12)
    assert monitor.cross == pytest.approx(want.cross, rel=1e-10)
    report = measure(model, (x, y), "cross_entropy", chunk_size=2)
    assert report.dtype == "float64"


def test_a_float64_model_computing_in_float32_inside_is_stated_float32() -> None:
    torch.manual_seed(0)
    model, (x, y) = Float32Inside().double(), _data()
    model.table = model.table.float()  # the buffer stays float32, as rotary tables do
    monitor = _watched(model, lambda: F.cross_entropy(model(x), y).backward())
    assert monitor.precision.startswith("float32")
    want = _want(*_loop(model, x, y, F.cross_entropy), 5)
    assert monitor.m2 == pytest.approx(want.m2, rel=F32)
    assert monitor.cross == pytest.approx(want.cross, rel=F32, abs=F32 * want.m2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure(model, (x, y), "cross_entropy", chunk_size=2)
    assert report.dtype == "float32"


def test_float32_off_the_gradients_path_leaves_float64_stated() -> None:
    """A float32 table from a buffer and a float32 branch no loss uses: float64, exactly."""
    torch.manual_seed(0)
    model, (x, y) = Float32Inside(dead=True).double(), _data()
    model.table = model.table.float()
    monitor = _watched(model, lambda: F.cross_entropy(model(x), y).backward())
    assert monitor.precision == "float64"
    want = _want(*_loop(model, x, y, F.cross_entropy), 5)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-12)


def test_a_loss_computed_in_float32_is_stated_float32() -> None:
    """The loss is written after the model, outside its forward: ``logits.float()``."""
    torch.manual_seed(0)
    model, (x, y) = _float64_mlp(), _data()
    monitor = _watched(model, lambda: F.cross_entropy(model(x).float(), y).backward())
    assert monitor.precision.startswith("float32")
    want = _want(*_loop(model, x, y, lambda o, t: F.cross_entropy(o.float(), t)), 5)
    assert monitor.m2 == pytest.approx(want.m2, rel=F32)
    # measure() and monitored_step compute the loss after the forward too
    def loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(o.float(), t, reduction="none")

    assert measure(model, (x, y), loss, chunk_size=2).dtype == "float32"
    assert measure(model, (x, y), "cross_entropy", chunk_size=2).dtype == "float64"
    from batchbound.diversity import monitored_step

    stepped = OnlineDiversity(1000, decay=0.0)
    monitored_step(model, x, y, loss, stepped)
    assert stepped.precision.startswith("float32")


def test_a_float32_model_is_stated_float32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = _data()
    x = x.float()
    monitor = _watched(model, lambda: F.cross_entropy(model(x), y).backward())
    assert monitor.precision == "float32"
    want = _want(*_loop(model, x, y, F.cross_entropy), 5)
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-5)


def _cast_loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.float(), t, reduction="none")


def _inside() -> nn.Module:
    model = Float32Inside().double()
    model.table = model.table.float()
    return model


def _dead() -> nn.Module:
    model = Float32Inside(dead=True).double()
    model.table = model.table.float()
    return model


@pytest.mark.parametrize("engine", ["hooks", "loop", "vmap", "auto"])
@pytest.mark.parametrize(("build", "loss", "want"), [
    (_inside, "cross_entropy", "float32"),  # a cast in the forward
    (_float64_mlp, _cast_loss, "float32"),  # a cast in the loss
    (_float64_mlp, "cross_entropy", "float64"),  # clean
    (_dead, "cross_entropy", "float64"),  # float32 off the gradient's path
], ids=["forward-cast", "loss-cast", "clean", "dead-branch"])
def test_every_engine_states_the_precision_it_observed(build, loss, want: str,
                                                       engine: str) -> None:
    """The loop and vmap engines stated the parameters' float64 for a float64 model whose
    forward or loss casts to float32, while hooks observed the cast: the same observation
    (``precision.Casts`` into ``GradientPrecision``) now runs on every engine."""
    torch.manual_seed(0)
    model, (x, y) = build(), _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure(model, (x, y), loss, chunk_size=2, engine=engine)
    assert report.dtype == want
    reference = measure(model, (x, y), loss, chunk_size=2, engine="loop")
    assert report.diversity == pytest.approx(reference.diversity, rel=F32)
    from batchbound.diversity import monitored_step

    stepped = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitored_step(model, x, y, loss, stepped, engine=engine)
    model.zero_grad()
    assert stepped.precision.split(" ")[0] == want


# ------------------------------------------------------------------ Hugging Face models

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
import test_outside_hf_configs as hf  # noqa: E402  (the models and loop of the outside-models tests)


@pytest.mark.parametrize("name", ["llama-gqa", "t5"])
def test_hf_models_with_float32_norms_in_float64_are_stated_float32(name: str) -> None:
    """Stated float32 by watch and measure, agreeing with the float64 loop at float32's
    precision (7e-9 and 4e-8 measured); with a sum over the examples the rounding is the
    loop's own, to 1e-12: what differs is where a mean's 1/b puts float32's rounding."""
    _, data, loss, _ = hf.CASES[name]
    model, batch = hf.build(name).eval(), data()
    want = _want(*hf.loop(model, batch, loss), hf.B)
    for reduction, rel in (("mean", F32), ("sum", 1e-12)):
        def step(reduction: str = reduction) -> None:
            losses = loss(model(**batch), batch)
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
        monitor = _watched(model, step, reduction)
        assert monitor.precision.startswith("float32 ")
        assert monitor.m2 == pytest.approx(want.m2, rel=rel)
        assert monitor.cross == pytest.approx(want.cross, rel=100 * rel, abs=rel * want.m2)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(hf.B)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure(model, DataLoader(rows, batch_size=3), loss, chunk_size=2)
    assert report.dtype == "float32"


def test_hf_model_whose_own_float32_loss_is_not_backpropagated_stays_float64() -> None:
    """GPT-NeoX given labels computes its own loss in float32 (``logits.float()``) beside
    the logits; the user's loss does not use it, so nothing the gradients carry is float32."""
    _, data, loss, _ = hf.CASES["gpt-neox"]
    model, batch = hf.build("gpt-neox").eval(), data()
    want = _want(*hf.loop(model, batch, loss), hf.B)
    monitor = _watched(model, lambda: loss(model(**batch), batch).mean().backward())
    assert monitor.precision == "float64"
    assert monitor.m2 == pytest.approx(want.m2, rel=1e-10)


@pytest.mark.parametrize(("name", "want"), [("llama-gqa", torch.float32),
                                            ("t5", torch.float32),
                                            ("bert-mlm", torch.float64)])
def test_the_self_checks_tolerance_follows_the_stated_precision(
        name: str, want: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """watch's first step checks the rules against the per-example loop at the tolerance of
    the precision it found: float32's for Llama and T5 in float64, float64's for BERT."""
    from batchbound.diversity import rule_check

    asked: list[torch.dtype] = []
    original = rule_check.disagreements

    def recording(*args, **kwargs):
        asked.append(args[4])
        return original(*args, **kwargs)

    monkeypatch.setattr(rule_check, "disagreements", recording)
    _, data, loss, _ = hf.CASES[name]
    model, batch = hf.build(name).eval(), data()
    _watched(model, lambda: loss(model(**batch), batch).mean().backward())
    assert asked == [want]


def test_a_lowered_result_written_in_place_later_counts_at_once() -> None:
    """``a = w.float(); b = a * 2; a.mul_(3)``: the backward of ``b`` passes the cast's node,
    not ``a``'s later one; the written result counts without waiting for a node."""
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    seen = GradientPrecision()
    a = w * 1.0
    low = a.float()
    seen.see(low, [a])
    b = low * 2
    low.mul_(3)
    seen.arm()
    b.double().sum().backward()
    assert seen.dtype == torch.float32


def test_monitored_step_states_float32_inside_float64_too() -> None:
    from batchbound.diversity import monitored_step

    torch.manual_seed(0)
    model, (x, y) = Float32Inside().double(), _data()
    model.table = model.table.float()
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitored_step(model, x, y, "cross_entropy", monitor)
    assert monitor.precision.startswith("float32")
    plain = OnlineDiversity(1000, decay=0.0)
    monitored_step(_float64_mlp(), x, y, "cross_entropy", plain)
    assert plain.precision == "float64"


def test_bfloat16_autocast_over_several_watched_steps_stays_bfloat16() -> None:
    """autocast reuses its bfloat16 cast of each weight within one context: the second
    step's forward casts no weight, and is still stated bfloat16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = _data(8)
    x = x.float()
    stated = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            monitor = _watched(model, lambda: F.cross_entropy(model(x).float(), y).backward())
            stated.append(monitor.precision)
    assert all(s.startswith("bfloat16") for s in stated), stated
