"""Benchmark: how far ``measure()`` is from the least a hooks pass can cost, on the MLP.

``measure()`` on ``benchmarks/diversity.py``'s MLP (784-512-512-512-10, 4096 examples in
chunks of 256, one thread) is timed against two references over the same chunks, interleaved
(median of ``--repeats`` rounds):

- plain: a forward+backward of the summed loss, as in ``benchmarks/diversity.py``;
- floor: a hand-written pass that computes what ``measure()`` computes (S = Σ_i ‖g_i‖² and
  the gradient sum), the same way, and nothing else: each Linear's input and output recorded
  in the forward, and in the backward a prehook on each layer's node that takes
  ‖a_i‖²·‖b_i‖² + ‖b_i‖², adds bᵀa into a running weight sum (``addmm_``) and Σ_i b_i into
  a running bias sum (``addmv_``); autograd is asked for the first layer's output gradient
  only. No check of the model, the data or the loss.

floor ÷ plain is the arithmetic of the per-example rules (two row norms per layer) and
their hooks at their cheapest; measure ÷ floor is what batchbound's engine adds to it
(recording the calls, reading the graph, the checks, the bookkeeping of the forms). S and T
of the floor are checked against ``measure()``'s before the timing.

    python benchmarks/measure_floor.py               # 9 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from batchbound.diversity import measure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import CASES
from timing import interleaved

EXAMPLES, CHUNK = 4096, 256


def floor_pass(model: nn.Sequential, x: Tensor, y: Tensor, loss) -> tuple[float, float]:
    """(S, T) of ``model`` over (x, y) in chunks, by the least work (see the docstring)."""
    layers = [m for m in model if isinstance(m, nn.Linear)]
    weights = [torch.zeros_like(m.weight) for m in layers]
    biases = [torch.zeros_like(m.bias) for m in layers]
    ones = torch.ones(CHUNK)
    S = torch.zeros((), dtype=torch.float64)

    def rule(k: int, a: Tensor, b: Tensor, sq: list[Tensor]) -> None:
        b_sq = torch.linalg.vector_norm(b, dim=1).square()
        sq.append(torch.linalg.vector_norm(a, dim=1).square() * b_sq + b_sq)
        weights[k].addmm_(b.t(), a)
        biases[k].addmv_(b.t(), ones[: b.shape[0]])

    for start in range(0, x.shape[0], CHUNK):
        seen: list[tuple[Tensor, Tensor]] = []
        handles = [m.register_forward_hook(lambda m, i, o, seen=seen: seen.append((i[0], o)))
                   for m in layers]
        losses = loss(model(x[start:start + CHUNK]), y[start:start + CHUNK])
        for handle in handles:
            handle.remove()
        sq: list[Tensor] = []
        hooks = [out.grad_fn.register_prehook(
            lambda grads, k=k, a=a, sq=sq: rule(k, a, grads[0], sq))
            for k, (a, out) in enumerate(seen) if k > 0]
        a0, out0 = seen[0]
        (b0,) = torch.autograd.grad(losses.sum(), [GradientEdge(out0.grad_fn, 0)])
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            rule(0, a0, b0, sq)
        S += torch.stack(sq).sum(dtype=torch.float64)
    T = sum(float(t.double().square().sum()) for t in [*weights, *biases])
    return float(S), T


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    case = CASES["mlp"]
    torch.manual_seed(0)
    model = case.build().eval()
    x, y = case.inputs(EXAMPLES)

    def plain() -> None:
        for start in range(0, EXAMPLES, CHUNK):
            model.zero_grad(set_to_none=True)
            case.loss(model(x[start:start + CHUNK]), y[start:start + CHUNK]).sum().backward()

    report = measure(model, (x, y), case.loss, chunk_size=CHUNK)
    S, T = floor_pass(model, x, y, case.loss)
    error = max(abs(S - report.S) / report.S, abs(T - report.T) / report.T)
    if error > 1e-5:
        raise SystemExit(f"the floor's S, T ({S}, {T}) differ from measure()'s "
                         f"({report.S}, {report.T})")
    runs = {"plain": plain,
            "measure()": lambda: measure(model, (x, y), case.loss, chunk_size=CHUNK),
            "floor": lambda: floor_pass(model, x, y, case.loss)}
    times = interleaved(runs, args.repeats)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"MLP 784-512-512-512-10, {EXAMPLES} examples in chunks of {CHUNK}, one thread, "
          f"median of {args.repeats} interleaved rounds (S, T of the floor within {error:.0e} "
          "of measure()'s)")
    print("| pass | s | × plain |")
    print("|---|---|---|")
    for name, seconds in median.items():
        print(f"| {name} | {seconds:.3f} | {seconds / median['plain']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
