"""The fingerprints' rounding bound (``forms.project_bound``, ``steps._unseen_uses``) where only
the fingerprints see the loss (``torch.autograd.backward``): honest steps of the setups whose
terms could differ from autograd's (tied weights, an embedding's padding, sparse gradients
accumulated, EmbeddingBag's mean, stacked and broadcast calls, 4-D and transposed inputs,
many accumulated micro-batches, float64, bfloat16 parameters and autocast) are never refused
and give the float64 per-example loop's n·Δ; a regulariser on a layer of a realistic size is
refused or exact."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

N, T, V, D = 8, 6, 20, 16


def _double(args: tuple) -> tuple:
    return tuple(a.double() if a.is_floating_point() else a for a in args)


def tokens_loss(out: Tensor, y: Tensor) -> Tensor:
    """Per example: the cross-entropy summed over its positions."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).sum(1)


def class_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


class Seq(nn.Module):
    def __init__(self, tied: bool = False, padding_idx: int | None = None,
                 sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx, sparse=sparse)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(V, D, mode="mean"), nn.Linear(D, 4)

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(torch.tanh(self.bag(idx)))


class Stacked(nn.Module):
    """Three like layers: their calls are stacked (``stacking.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class Broadcast(nn.Module):
    """A Linear on a tensor without the examples' axis, its output added to each example."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pos", torch.randn(T, D))
        self.proj, self.head = nn.Linear(D, D), nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(x + self.proj(self.pos))).sum(1)


class Grid(nn.Module):
    """A Linear on 4-D inputs, and one on a transposed (non-contiguous) input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(D, D), nn.Linear(5, D), nn.Linear(D, 4)

    def forward(self, x: Tensor) -> Tensor:  # (n, 3, 5, D)
        h = torch.tanh(self.a(x))  # 4-D
        h = torch.tanh(self.b(h.mean(1).transpose(1, 2)))  # (n, D, 5) -> (n, D, D)
        return self.head(h).mean(1)


def _tokens(seed: int, high: int = V) -> tuple[tuple, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, high, (N, T), generator=g),), torch.randint(0, V, (N, T), generator=g)


def _features(seed: int, shape: tuple) -> tuple[tuple, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, *shape, generator=g),), torch.randint(0, 4, (N,), generator=g)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple], Callable]] = {
    "tied": (lambda: Seq(tied=True), _tokens, tokens_loss),
    "padding_idx": (lambda: Seq(padding_idx=0), lambda s: _tokens(s, high=3), tokens_loss),
    "sparse": (lambda: Seq(sparse=True), lambda s: _tokens(s, high=3), tokens_loss),
    "embedding_bag_mean": (Bag, lambda s: (_tokens(s)[0], _features(s, (D,))[1]), class_loss),
    "stacked": (Stacked, lambda s: _features(s, (D,)), class_loss),
    "broadcast": (Broadcast, lambda s: _features(s, (T, D)), class_loss),
    "grid": (Grid, lambda s: _features(s, (3, 5, D)), class_loss),
}


def honest_steps(model: nn.Module, data: Callable[[int], tuple], loss: Callable, steps: int,
                 micro: int, rel: float, autocast: torch.dtype | None = None) -> None:
    """``steps`` watched micro-batches through ``torch.autograd.backward``, ``.grad`` zeroed
    every ``micro``: each is measured (never refused), its n·Δ the float64 loop's."""
    monitor = OnlineDiversity(10, decay=0.0)
    dtype = next(model.parameters()).dtype
    for step in range(steps):
        args, y = data(step)
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        S, T_ = loop_S_T(copy.deepcopy(model).double(), _double(args), {},
                         lambda out, i, y=y: loss(out, y[i : i + 1]).sum(), N)
        if step % micro == 0:
            model.zero_grad(set_to_none=True)
        with watch(model, monitor, reduction="sum"):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                enabled=autocast is not None):
                out = model(*args)
            out = out.float() if out.dtype in (torch.bfloat16, torch.float16) else out
            torch.autograd.backward(loss(out, y).sum())
        expected = OnlineDiversity(10, decay=0.0)
        expected.update_from_norms(S, T_, N)
        assert monitor.last == pytest.approx(expected.last, rel=rel), step


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("micro", [1, 3])
def test_honest_steps_are_measured(name: str, micro: int) -> None:
    build, data, loss = CASES[name]
    torch.manual_seed(0)
    honest_steps(build(), data, loss, steps=3, micro=micro, rel=1e-3)


def test_many_micro_batches_accumulated_in_float64() -> None:
    torch.manual_seed(1)
    build, data, loss = CASES["tied"]
    honest_steps(build().double(), lambda s: data(s), loss, steps=12, micro=12, rel=1e-9)


@pytest.mark.parametrize("name", ["tied", "stacked", "grid"])
def test_bfloat16_parameters_are_measured(name: str) -> None:
    """A bfloat16 model: the rules compute in float32 (hooks.HooksPass._in_working_precision),
    its fingerprint vectors are the parameters' dtype."""
    build, data, loss = CASES[name]
    torch.manual_seed(0)
    honest_steps(build().to(torch.bfloat16), data, loss, steps=2, micro=1, rel=0.1)


@pytest.mark.parametrize("name", ["tied", "stacked", "grid", "broadcast"])
def test_bfloat16_autocast_is_measured(name: str) -> None:
    build, data, loss = CASES[name]
    torch.manual_seed(0)
    honest_steps(build(), data, loss, steps=2, micro=2, rel=0.05, autocast=torch.bfloat16)


class Wide(nn.Module):
    """A 256 × 256 layer on sequences: n·T = 512 terms per entry of its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 256), nn.Linear(256, 256), nn.Linear(256, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))).mean(1)


@pytest.mark.parametrize("size", [0.03, 0.1])  # ‖λ·W_b‖ / ‖the step's gradient‖
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_penalty_on_a_wide_layer_is_refused_or_exact(size: float, seed: int) -> None:
    """Σ|a|ᵀ|u_t||v_t|ᵀ|b| over random unit a, b is about √numel times the projection of
    the sum itself, so the bound on it let a penalty of 10 % of the step's gradient on a
    256 × 256 layer through: coordinate probes (a = e_i, b = e_j) bound entry (i, j) by
    Σ_t |u_ti||v_tj|, on its own scale."""
    torch.manual_seed(seed)
    model = Wide()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(N, 64, 16, generator=g), torch.randint(0, 4, (N,), generator=g)
    S, T_ = loop_S_T(copy.deepcopy(model).double(), (x.double(),), {},
                     lambda out, i: class_loss(out, y[i : i + 1]).sum(), N)
    grads = torch.autograd.grad(class_loss(model(x), y).sum(), list(model.parameters()))
    weight = model.b.weight
    lam = size * float(torch.sqrt(sum(g.double().square().sum() for g in grads))) / float(
        weight.detach().norm())
    expected = OnlineDiversity(10, decay=0.0)
    expected.update_from_norms(S, T_, N)
    try:
        for _ in range(2):  # the first step checks the model
            model.zero_grad()
            monitor = OnlineDiversity(10, decay=0.0)
            with watch(model, monitor, reduction="sum"):
                total = class_loss(model(x), y).sum() + 0.5 * lam * weight.square().sum()
                torch.autograd.backward(total)
    except BatchboundError as exc:
        assert "b.weight" in str(exc)
        return
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-3)


class Square(nn.Module):
    """A 1024 × 1024 layer on short sequences (n·T = 32)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x))))).mean(1)


@pytest.mark.parametrize("size", [0.0, 0.1])  # ‖λ·W_b‖ / ‖the step's gradient‖
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_penalty_after_many_micro_batches_is_refused_or_exact(size: float, seed: int) -> None:
    """``.grad`` holding 256 earlier micro-batches' sum: ``.grad += g`` and Δ = after − before
    round each entry by a unit of |before|, which the check allowed at ε‖before‖, √numel
    times the fingerprints' scale, so a regulariser of 10 % of the step's gradient on a
    1024 × 1024 layer passed it; projected on |a|, |b| that rounding is on their scale."""
    torch.manual_seed(seed)
    model = Square()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(N, 4, 16, generator=g), torch.randint(0, 4, (N,), generator=g)
    x0, y0 = torch.randn(N, 4, 16, generator=g), torch.randint(0, 4, (N,), generator=g)
    S, T_ = loop_S_T(copy.deepcopy(model).double(), (x.double(),), {},
                     lambda out, i: class_loss(out, y[i : i + 1]).sum(), N)
    params = list(model.parameters())
    grads = torch.autograd.grad(class_loss(model(x), y).sum(), params)
    earlier = [256 * e for e in torch.autograd.grad(class_loss(model(x0), y0).sum(), params)]
    weight = model.b.weight
    lam = size * float(torch.sqrt(sum(g.double().square().sum() for g in grads))) / float(
        weight.detach().norm())
    expected = OnlineDiversity(10, decay=0.0)
    expected.update_from_norms(S, T_, N)
    try:
        for _ in range(2):  # the first step checks the model
            for p, e in zip(params, earlier, strict=True):
                p.grad = e.clone()
            monitor = OnlineDiversity(10, decay=0.0)
            with watch(model, monitor, reduction="sum"):
                total = class_loss(model(x), y).sum() + 0.5 * lam * weight.square().sum()
                torch.autograd.backward(total)
    except BatchboundError as exc:
        assert size and "b.weight" in str(exc)  # an honest step is never refused
        return
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-3)



NEW_API = """
import copy, torch
import torch.nn.functional as F
from torch import nn
from training_models import loop_S_T
from batchbound.diversity import OnlineDiversity, watch
torch.backends.cuda.matmul.fp32_precision = "tf32"  # no effect on a CPU's products
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
x, y = torch.randn(32, 64), torch.randint(0, 4, (32,))
S, T = loop_S_T(copy.deepcopy(model).double(), (x.double(),), {},
                lambda out, i: F.cross_entropy(out, y[i : i + 1], reduction="sum"), 32)
expected = OnlineDiversity(10, decay=0.0)
expected.update_from_norms(S, T, 32)
for _ in range(2):
    model.zero_grad()
    monitor = OnlineDiversity(10, decay=0.0)
    with watch(model, monitor, reduction="sum"):
        torch.autograd.backward(F.cross_entropy(model(x), y, reduction="sum"))
    print(all(abs(g - w) <= 1e-3 * abs(w) for g, w in zip(monitor.last, expected.last)))
"""


def test_the_per_backend_precision_api_is_read() -> None:
    """After ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (torch >= 2.9's
    per-backend API, the one its docs recommend), ``torch.get_float32_matmul_precision()``
    raises ("a mix of the legacy and new APIs"): watch() raised that RuntimeError from the
    fingerprints' bound on every step whose backward ``torch.autograd.backward`` started.
    In a child process: the setting stays for the process."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("no per-backend fp32_precision in this torch")
    done = subprocess.run([sys.executable, "-c", NEW_API], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]  # n·Δ the float64 loop's, both steps


ONEDNN_BF16 = NEW_API.replace('torch.backends.cuda.matmul.fp32_precision = "tf32"',
                              'torch.backends.mkldnn.enabled = True\n'
                              'torch.backends.mkldnn.matmul.fp32_precision = "bf16"').replace(
                                  "<= 1e-3 *", "<= 5e-2 *")


# not strict: whether oneDNN rounds to bfloat16 depends on the processor (AMX, AVX512-BF16)
@pytest.mark.xfail(strict=False, reason="known, not fixed: oneDNN's bfloat16 passes for float32 "
                   "products are no dtype, so the precision watch() reads stays float32 and the "
                   "self-check, a batch of 1 beside a batch at float32's 1e-3, refuses the model "
                   "as 'the examples interact'")
def test_onednn_bfloat16_float32_products_are_measured() -> None:
    """``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` rounds a float32 Linear's
    operands to bfloat16 on CPUs that have it (3e-3 of the product on this machine's AMX)."""
    if not (hasattr(torch.backends.mkldnn, "matmul") and torch.backends.mkldnn.is_available()):
        pytest.skip("no oneDNN per-backend fp32_precision in this torch")
    done = subprocess.run([sys.executable, "-c", ONEDNN_BF16], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]
