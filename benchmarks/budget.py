"""Benchmark: ``measure(memory_budget=...)``'s whole run against its budget, on CPU.

Per case and precision (float32, bfloat16 autocast): the peak of a plain forward and backward
of the batch, the budget (1.5 × that peak, as benchmarks/gpu.py sets it), the chunk
``measure`` chose within it, and the peak of ``measure`` over the batch at that chunk ÷ the
budget (at most 1 is the promise). Peaks are the CPU's tensor allocations above the start,
read by ``torch.profiler`` as ``measure`` reads them (``diversity/budget.py``, ``peak_bytes``).

    python benchmarks/budget.py
    python benchmarks/budget.py --cases lenet,mlp --precisions bf16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

import torch

from batchbound.diversity import measure
from batchbound.diversity.budget import peak_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import CASES

SIZES = {"mlp": 4096, "lenet": 1024, "resnet": 256, "gpt": 64, "hf-gpt2": 64, "hf-llama": 64}
CPU = torch.device("cpu")


def row(key: str, precision: str) -> str:
    case, n = CASES[key], SIZES[key]
    torch.manual_seed(0)
    model = case.build().eval()
    x, y = case.inputs(n)

    def autocast() -> contextlib.AbstractContextManager:
        return (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = case.loss(model(x), y).mean()
        loss.backward()

    plain()
    budget = int(1.5 * peak_bytes(CPU, plain))
    model.zero_grad(set_to_none=True)
    with autocast():
        chunk = measure(model, (x, y), case.loss, chunk_size=n,
                        memory_budget=budget).extra["chunk_size"]

    def bounded() -> None:
        with autocast():
            measure(model, (x, y), case.loss, chunk_size=chunk)

    peak = peak_bytes(CPU, bounded)
    return (f"| {case.name} | {precision} | {n} | {budget / 1.5 / 2**20:.1f} | "
            f"{budget / 2**20:.1f} | {chunk} | {peak / budget:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(SIZES), help="comma-separated: "
                        + ", ".join(f"{k} ({n} examples)" for k, n in SIZES.items()))
    parser.add_argument("--precisions", default="fp32,bf16", help="fp32, bf16 (autocast)")
    args = parser.parse_args(argv)
    cases, precisions = args.cases.split(","), args.precisions.split(",")
    unknown = [c for c in cases if c not in SIZES] + [
        p for p in precisions if p not in ("fp32", "bf16")]
    if unknown:
        parser.error(f"unknown case or precision: {', '.join(unknown)}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="batchbound: bfloat16 gradients")
    print(f"torch {torch.__version__}, CPU, 1 thread; budget = 1.5 × the plain step's peak")
    print("| case | precision | examples | plain peak MiB | budget MiB | chunk chosen "
          "| measure() peak ÷ budget |\n|---|---|---|---|---|---|---|", flush=True)
    for key in cases:
        for precision in precisions:
            print(row(key, precision), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
