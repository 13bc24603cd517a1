"""How large a use outside the model's graph ``watch()`` lets through: an L2 penalty on one
layer's weight added to the loss, the backward started by ``torch.autograd.backward`` (where
the loss's graph is not read and only the gradient sums' fingerprints can see it), by the
penalty's size ‖λW‖ / ‖the step's gradient‖. Per size, over seeds 0–9 (weights and data):
how many steps were refused, and the largest relative error of n·Δ among those that passed,
against the float64 per-example loop (float32 states 1e-3). Deterministic; about a minute.

    python benchmarks/hidden_uses.py
    python benchmarks/hidden_uses.py --json
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.errors import BatchboundError

N = 16
SIZES = (0.0001, 0.0003, 0.001, 0.01, 0.1)


class Branch(nn.Module):
    """An MLP: a main layer and a small branch (tests/unit/test_watch_rounding_floor.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.head(h + 0.01 * torch.tanh(self.b(h)))


class Tokens(nn.Module):
    """A token model on sequences of 12: embedding, a residual MLP per position, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.a = nn.Embedding(32, 64), nn.Linear(64, 256)
        self.b, self.head = nn.Linear(256, 64), nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x)
        return self.head(h + self.b(F.gelu(self.a(h))))


def _case(kind: str) -> tuple[nn.Module, Tensor, Tensor, Callable[[Tensor, Tensor], Tensor]]:
    if kind == "mlp":
        model, x, y = Branch(), torch.randn(N, 16), torch.randint(0, 4, (N,))
        return model, x, y, lambda out, y: F.cross_entropy(out, y, reduction="none")
    model, x, y = Tokens(), torch.randint(0, 32, (N, 12)), torch.randint(0, 32, (N, 12))
    return model, x, y, lambda out, y: F.cross_entropy(out.transpose(1, 2), y,
                                                       reduction="none").sum(1)


def n_delta(m2: float, cross: float) -> float:
    """n·Δ = n·S/T from one step's M2 = S/n and C (T = S + n(n − 1)·C)."""
    return N * m2 / (m2 + (N - 1) * cross)


def one(kind: str, layer: str, size: float, seed: int) -> float | None:
    """n·Δ's relative error on the penalised step, or None where watch refused it."""
    torch.manual_seed(seed)
    model, x, y, losses = _case(kind)
    # the reference: one example at a time, in float64
    exact = measure(copy.deepcopy(model).double(), (x.double() if x.is_floating_point() else x,
                                                    y), losses, engine="loop")
    grads = torch.autograd.grad(losses(model(x), y).sum(), list(model.parameters()))
    weight = getattr(model, layer).weight
    lam = size * float(torch.sqrt(sum(g.double().square().sum() for g in grads))) / float(
        weight.detach().norm())
    want = OnlineDiversity(10, decay=0.0)
    want.update_from_norms(exact.S, exact.T, N)
    try:
        for _ in range(2):  # the first step checks the model
            model.zero_grad()
            monitor = OnlineDiversity(10, decay=0.0)
            with watch(model, monitor, reduction="sum"):
                torch.autograd.backward(losses(model(x), y).sum()
                                        + 0.5 * lam * weight.square().sum())
    except BatchboundError:
        return None
    assert monitor.last is not None and want.last is not None
    return abs(n_delta(*monitor.last) / n_delta(*want.last) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rows = []
    for kind, layer, label in (("mlp", "a", "MLP, main Linear 16→64"),
                               ("tokens", "a", "token model, Linear 64→256 on 12 positions"),
                               ("tokens", "emb", "token model, Embedding 32×64")):
        for size in SIZES:
            errors = [one(kind, layer, size, seed) for seed in range(10)]
            passed = [e for e in errors if e is not None]
            rows.append(dict(layer=label, size=size, refused=len(errors) - len(passed),
                             worst_passed=max(passed) if passed else None))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| layer | penalty / step's gradient | refused (of 10) "
          "| n·Δ's worst error where passed |")
    print("|---|---|---|---|")
    for r in rows:
        worst = "—" if r["worst_passed"] is None else f"{r['worst_passed']:.1e}"
        print(f"| {r['layer']} | {r['size']:g} | {r['refused']} | {worst} |")


if __name__ == "__main__":
    main()
