"""The cost of measuring gradient diversity inside a user's training (not a test; prints a
table or JSON), on a GPT-style model (batchbound's ``gpt`` family: nanoGPT's shape) with
random tokens, measured side by side in one run:

1. Lightning: ``Trainer(accumulate_grad_batches=2)`` with and without
   ``batchbound.integrations.lightning.DiversityCallback`` (two-batch estimate from the
   micro-batches: one norm and one dot product per parameter per micro-batch). Goal ≤ 10 %.
2. A hand-written loop (forward, token-mean cross-entropy, backward, SGD step) with and
   without ``batchbound.diversity.watch`` around its forward and backward (exact per-example
   norms from the layer rules, read off the same backward pass). Goal ≤ 15 %.
3. Plain DDP on two gloo processes (``--ddp-model``: an 8-layer, 512-wide MLP, 2.1M
   parameters, batch 32 per rank): no communication hook, torch's own Python
   ``allreduce_hook``, and ``batchbound.integrations.ddp.gns_hook``, their steps alternating
   inside the same two processes. Goal: the GNS hook within 5 points of ``allreduce_hook``.

Lightning's seconds per optimizer step come by difference of an N- and a 2N-step run, so
set-up cancels, repeats alternating the contenders. The hand loop's and DDP's contenders
alternate step by step (N × repeats steps each) and their median step is kept. Both in
wall-clock and in CPU time of the process (less disturbed by other jobs; for DDP, rank 0's,
gloo's threads included).

    python benchmarks/callbacks.py --json
    python benchmarks/callbacks.py --model "gpt(depth=4,width=128,heads=4)" --context 64
    python benchmarks/callbacks.py --only ddp       # or: lightning, watch (comma-separated)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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


def alternate(steps: dict[str, Callable[[], None]], rounds: int,
              before: Callable[[], None] = lambda: None) -> dict[str, list[Clock]]:
    """Each contender's (wall, CPU) seconds per step, the contenders' steps alternating one
    by one for ``rounds`` rounds, so that load from other processes hits them alike;
    ``before`` runs, untimed, before each step."""
    times: dict[str, list[Clock]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            before()
            start = clocks()
            step()
            end = clocks()
            times[name].append((end[0] - start[0], end[1] - start[1]))
    return times


def watch_steps(args: argparse.Namespace) -> dict[str, list[Clock]]:
    """The hand loop's step, plain and under watch, on one model, alternating."""
    x, y = tokens(args)
    model = model_for(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = OnlineDiversity(n=args.n)
    g = torch.Generator().manual_seed(1)

    def hand() -> None:
        idx = torch.randint(args.n, (args.batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten()).backward()
        opt.step()

    def watched() -> None:
        idx = torch.randint(args.n, (args.batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        with watch(model, monitor):
            # the token mean is the per-sequence sum over batch·context: a uniform scale
            F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten()).backward()
        opt.step()

    watched()  # the first watch() checks the model once; not part of the steady state
    hand()
    return alternate({"hand": hand, "watch": watched}, args.steps * args.repeats)


DDP_HOOKS = ("ddp", "allreduce_hook", "gns_hook")


def _ddp_worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One of two gloo ranks: a DDP model per contender, their steps alternating; rank 0
    writes {contender: [(wall, cpu) per step]} to ``out`` as JSON."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from batchbound.integrations.ddp import gns_hook, gns_hook_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(args.threads)
    torch.manual_seed(rank)
    x, y = torch.randn(args.n, 512), torch.randint(0, 10, (args.n,))
    g = torch.Generator().manual_seed(rank)
    steps = {}
    for name in DDP_HOOKS:
        ddp = DDP(build_model(args.ddp_model, (512,), 10, seed=0))
        if name == "allreduce_hook":
            ddp.register_comm_hook(None, allreduce_hook)
        elif name == "gns_hook":
            ddp.register_comm_hook(gns_hook_state(args.n * 2, args.batch_size), gns_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step(ddp: Any = ddp, opt: Any = opt) -> None:
            idx = torch.randint(args.n, (args.batch_size,), generator=g)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()

        step()
        step()  # DDP's first step rebuilds its buckets
        steps[name] = step
    times = alternate(steps, args.steps * args.repeats, before=dist.barrier)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    steps.clear()  # the DDP models hold the group: gone before it is (docs/torchrun-abort.md)
    dist.destroy_process_group()


def ddp_steps(args: argparse.Namespace) -> dict[str, list[Clock]]:
    import tempfile

    import torch.multiprocessing as mp

    from batchbound.train.distributed import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.spawn(_ddp_worker, args=(free_port(), args, out), nprocs=2)
        with open(out) as f:
            return {k: [tuple(v) for v in values] for k, values in json.load(f).items()}


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
    parser.add_argument("--ddp-model", default="fc(depth=8,width=512)",
                        help="the DDP contenders' model, on 512 features and 10 classes")
    parser.add_argument("--only", default="lightning,watch,ddp",
                        help="comma-separated subset of: lightning, watch, ddp")
    args = parser.parse_args()
    parts = {p.strip() for p in args.only.split(",")}
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows: dict[str, list[Clock]] = {}
    pairs = []
    if "lightning" in parts:  # whole runs (N and 2N steps), repeats alternating
        rows.update(plain=[], callback=[])
        pairs.append(("callback", "plain", "callback"))
        for _ in range(args.repeats):
            rows["plain"].append(lightning_step(args, False))
            rows["callback"].append(lightning_step(args, True))
    if "watch" in parts:  # steps alternating: medians of steps × repeats each
        rows.update(watch_steps(args))
        pairs.append(("watch", "hand", "watch"))
    if "ddp" in parts:
        rows.update(ddp_steps(args))
        pairs += [("allreduce_hook", "ddp", "allreduce_hook"), ("gns_hook", "ddp", "gns_hook")]
    result: dict[str, Any] = {"model": args.model, "context": args.context,
                              "batch_size": args.batch_size, "steps": args.steps,
                              "repeats": args.repeats, "threads": torch.get_num_threads(),
                              "ddp_model": args.ddp_model}
    for k, clock in enumerate(("wall", "cpu")):
        medians = {name: statistics.median(v[k] for v in values) for name, values in rows.items()}
        for name, value in medians.items():
            result[f"{name}_ms_per_step_{clock}"] = 1e3 * value
        for name, base, over in pairs:
            result[f"{name}_overhead_{clock}"] = medians[over] / medians[base] - 1
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>28}: {value:.3f}" if isinstance(value, float) else f"{key:>28}: {value}")


if __name__ == "__main__":
    main()
