"""Host-time proxy for the in-loop tools on a GPU, in milliseconds, on a machine without one.

On an H100 GPT-2 small's step under ``watch`` was bound by the host (docs/benchmarks.md): the
time Python and torch's dispatcher take to issue the step, not the GPU's work. This script
times that host work on CPU: GPT-2 small's structure (12 layers, its modules and calls) at
width 32, context 8 and batch 4, where the arithmetic is a small part of a step and its wall
time is nearly all dispatch and Python. Interleaved rounds, medians and means (a rare full
garbage collection of the process's heap moves the mean, not the median), one thread:

- ``plain``: the bare forward and backward (``loss.backward()``);
- ``watch`` / ``watch:norms``: the same step inside ``watch(model, monitor)`` (all layers, and
  the cheap mode, ``subset="norms"``);
- ``empty mode``: the plain step with a ``TorchDispatchMode`` around the forward that does
  nothing but call each operation: what torch's Python dispatch alone costs a tracker that
  sees every operation of the forward, as ``watch``'s row tracker (diversity/rows.py) does.
- ``measure``: ``measure()`` of the same batch as one chunk, called again on the same model
  (its checks are kept from the first call), as ``benchmarks/gpu.py`` times it;
- ``..., bf16``: the forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as GPU
  users train (its extra against the plain bf16 step);
- ``watch every 10th``: ten steps, the first inside ``watch`` and nine plain, per step: the
  pattern docs/diversity.md gives for a host-bound GPU step (the monitor then holds a tenth
  of the steps, and its interval says so).

The ratios are the host's, not a GPU step's: where the GPU's own work is longer than the
host's, a step's wall time is the GPU's.

    python benchmarks/host.py
    python benchmarks/host.py --layers 24 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from batchbound.diversity import OnlineDiversity, measure, watch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import EVERY, interleaved, one_in


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def gpt2(layers: int, width: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    return GPT2LMHeadModel(GPT2Config(
        n_layer=layers, n_embd=width, n_head=4, n_positions=8, vocab_size=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()


def steps(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Callable[[], None]]:
    monitor = OnlineDiversity()
    none = contextlib.nullcontext

    def bf16() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def step(block: Callable[[], Any], forward: Callable[[], Any] = none) -> Callable[[], None]:
        def run() -> None:
            model.zero_grad(set_to_none=True)
            with block():
                with forward():
                    logits = model(input_ids=x).logits
                logits = logits.float().reshape(-1, logits.shape[-1])
                F.cross_entropy(logits, y.reshape(-1)).backward()

        return run

    return {
        "plain": step(none),
        "watch": step(lambda: watch(model, monitor)),
        "watch:norms": step(lambda: watch(model, monitor, subset="norms")),
        "empty mode": step(none, EmptyMode),
        "measure": lambda: measure(model, (x, y), token_loss, chunk_size=x.shape[0]),
        "plain, bf16": step(none, bf16),
        "watch, bf16": step(lambda: watch(model, monitor), bf16),
        "watch:norms, bf16": step(lambda: watch(model, monitor, subset="norms"), bf16),
        "watch every 10th": one_in(EVERY, step(lambda: watch(model, monitor)), step(none)),
    }


def token_loss(outputs: Any, y: Tensor) -> Tensor:
    """Each sequence's mean next-token cross-entropy."""
    logits = outputs.logits
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers (default 12)")
    parser.add_argument("--width", type=int, default=32, help="model width (default 32)")
    parser.add_argument("--repeats", type=int, default=40, help="interleaved rounds")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt2(args.layers, args.width)
    tokens = torch.randint(64, (4, 9), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    runs = steps(model, x, y)
    # the first watched step plans and checks the model, its 2nd and 4th the loss again (and
    # its 8th, 16th, …, a few of the rounds: the medians leave them out)
    for run in runs.values():
        for _ in range(4):
            run()
    times = interleaved(runs, args.repeats)
    per = {name: EVERY if name.startswith("watch every") else 1 for name in times}
    ms = {name: 1e3 * statistics.median(t) / per[name] for name, t in times.items()}
    mean = {name: 1e3 * statistics.fmean(t) / per[name] for name, t in times.items()}

    def plain(name: str) -> str:
        return "plain, bf16" if "bf16" in name else "plain"

    rows = [{"step": name, "ms": round(ms[name], 2),
             "extra": round(100 * (ms[name] / ms[plain(name)] - 1)),
             "mean ms": round(mean[name], 2),
             "mean extra": round(100 * (mean[name] / mean[plain(name)] - 1))}
            for name in ms]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"GPT-2 structure, {args.layers} layers at width {args.width}, batch 4 × 8 tokens; "
          f"torch {torch.__version__}, 1 thread, median of {args.repeats} interleaved rounds")
    print("| step | ms | extra | mean ms | mean extra |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['step']} | {row['ms']:.2f} | {row['extra']:+d} % | "
              f"{row['mean ms']:.2f} | {row['mean extra']:+d} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
