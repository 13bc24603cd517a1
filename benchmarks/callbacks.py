"""The cost of measuring gradient diversity inside a user's training (not a test; prints a
table or JSON), on a GPT-style model (batchbound's ``gpt`` family: nanoGPT's shape) with
random tokens, measured side by side in one run:

1. Lightning: ``Trainer(accumulate_grad_batches=2)`` with and without
   ``batchbound.integrations.lightning.DiversityCallback`` (two-batch estimate from the
   micro-batches: one norm and one dot product per parameter per micro-batch). Goal ≤ 10 %.
2. A hand-written loop (forward, token-mean cross-entropy, backward, SGD step) with and
   without ``batchbound.diversity.watch`` around its forward and backward (exact per-example
   norms from the layer rules, read off the same backward pass).

Each contender's seconds per optimizer step come by difference of an N- and a 2N-step run,
so set-up cancels; repeats alternate the contenders and the median ratio is reported, in
wall-clock and in CPU time of the process (less disturbed by other jobs).

    python benchmarks/callbacks.py --json
    python benchmarks/callbacks.py --model "gpt(depth=4,width=128,heads=4)" --context 64
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from batchbound.diversity import watch
from batchbound.diversity.online import OnlineDiversity
from batchbound.models import build_model

Clock = tuple[float, float]


def clocks() -> Clock:
    return time.perf_counter(), time.process_time()


def per_step(run: Callable[[int], None], steps: int) -> Clock:
    """(wall, CPU) seconds per step by difference of ``steps`` and ``2·steps``."""
    spans = []
    for n in (steps, 2 * steps):
        start = clocks()
        run(n)
        end = clocks()
        spans.append((end[0] - start[0], end[1] - start[1]))
    return tuple((b - a) / steps for a, b in zip(*spans, strict=True))  # type: ignore[return-value]


def tokens(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(args.vocabulary, (args.n, args.context + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def model_for(args: argparse.Namespace) -> torch.nn.Module:
    return build_model(args.model, (args.context,), args.vocabulary, seed=0)


def lightning_step(args: argparse.Namespace, with_callback: bool) -> Clock:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from batchbound.integrations.lightning import DiversityCallback

    x, y = tokens(args)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model_for(args)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            xb, yb = batch
            return F.cross_entropy(self.net(xb).flatten(0, 1), yb.flatten())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def run(steps: int) -> None:
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
        callbacks = [DiversityCallback(every=10)] if with_callback else []
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, accumulate_grad_batches=2,
                            callbacks=callbacks)
        trainer.fit(Module(), loader)

    return per_step(run, args.steps)


def hand_step(args: argparse.Namespace, watched: bool) -> Clock:
    x, y = tokens(args)
    model = model_for(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = OnlineDiversity(n=args.n)
    g = torch.Generator().manual_seed(1)

    def step() -> None:
        idx = torch.randint(args.n, (args.batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten())
        loss.backward()
        opt.step()

    def watched_step() -> None:
        idx = torch.randint(args.n, (args.batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        with watch(model, monitor):
            # the token mean is the per-sequence sum over batch·context: a uniform scale
            loss = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten())
            loss.backward()
        opt.step()

    one = watched_step if watched else step
    one()  # the first watch() checks the model once; not part of the steady state

    def run(steps: int) -> None:
        for _ in range(steps):
            one()

    return per_step(run, args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt(depth=2,width=64,heads=4)")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--vocabulary", type=int, default=64)
    parser.add_argument("--n", type=int, default=4096, help="sequences of random tokens")
    parser.add_argument("--batch-size", "-B", type=int, default=32, help="per micro-batch")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps, N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows: dict[str, list[Clock]] = {k: [] for k in ("plain", "callback", "hand", "watch")}
    for _ in range(args.repeats):
        rows["plain"].append(lightning_step(args, False))
        rows["callback"].append(lightning_step(args, True))
        rows["hand"].append(hand_step(args, False))
        rows["watch"].append(hand_step(args, True))
    result: dict[str, Any] = {"model": args.model, "context": args.context,
                              "batch_size": args.batch_size, "steps": args.steps,
                              "repeats": args.repeats, "threads": torch.get_num_threads()}
    for k, clock in enumerate(("wall", "cpu")):
        for name, values in rows.items():
            result[f"{name}_ms_per_step_{clock}"] = 1e3 * statistics.median(v[k] for v in values)
        for name, base, over in (("callback", "plain", "callback"), ("watch", "hand", "watch")):
            result[f"{name}_overhead_{clock}"] = statistics.median(
                o[k] / b[k] - 1 for b, o in zip(rows[base], rows[over], strict=True))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
