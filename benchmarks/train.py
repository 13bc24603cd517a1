"""Trainer throughput against hand-written PyTorch loops (not a test; prints a table or JSON).

Three ratios, each measured side by side in one run, on the same model, data and batch:

1. ``train`` on one process vs a minimal loop (randperm batches, forward, mean
   cross-entropy, backward, SGD step). Goal ≥ 0.95×.
2. ``train`` with 2 gloo workers vs a hand-written DistributedDataParallel loop on the same
   2 processes (each with half the batch). Goal ≥ 0.9×.
3. Online diversity monitoring (``online_diversity=norms``) vs off. Goal: overhead ≤ 10%.

Throughput of the trainer is measured by difference: two runs of N and 2N iterations, with
evaluation only at the start and end, give samples/s = N·B / (t_2N − t_N); set-up, data
loading and evaluation cancel. Hand loops are timed directly over N iterations after a
warm-up. Repeats alternate the contenders and the median ratio is reported. Single-process
ratios are given in wall-clock and in CPU time of the process (``*_cpu``), which other jobs
on a shared machine disturb far less; the 2-worker ratio is wall-clock only (waiting in the
all-reduce is part of what is measured).

    python benchmarks/train.py --json
    python benchmarks/train.py --dataset mnist5k --model "fc(depth=3,params=200000)" -B 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from batchbound.data import load_dataset
from batchbound.models import build_model
from batchbound.train import TrainConfig
from batchbound.train.distributed import free_port, setup, teardown
from batchbound.train.loop import Trainer


def config_for(args: argparse.Namespace, iterations: int, **changes: Any) -> TrainConfig:
    return TrainConfig(
        dataset=args.dataset,
        model=args.model,
        batch_size=args.batch_size,
        lr=0.01,
        max_iterations=iterations,
        max_epochs=None,
        eval_every_iterations=10**9,
        eval_subset=256,
        device="cpu",
        **changes,
    )


def clocks() -> tuple[float, float]:
    """(wall, CPU) seconds: CPU time of this process is far less disturbed by other jobs."""
    return time.perf_counter(), time.process_time()


def rates(
    samples: int, start: tuple[float, float], end: tuple[float, float]
) -> tuple[float, float]:
    return tuple(samples / max(b - a, 1e-9) for a, b in zip(start, end, strict=True))  # type: ignore[return-value]


def trainer_rate(args: argparse.Namespace, data: Any, **changes: Any) -> tuple[float, float]:
    """(wall, CPU) samples/s of Trainer.run by difference of an N- and a 2N-iteration run."""
    ctx = setup("cpu")
    spans = []
    for iterations in (args.iterations, 2 * args.iterations):
        trainer = Trainer(config_for(args, iterations, **changes), ctx, dataset=data)
        if ctx.distributed:
            dist.barrier()
        start = clocks()
        trainer.run()
        end = clocks()
        spans.append([b - a for a, b in zip(start, end, strict=True)])
    extra = [(0.0, 0.0), (spans[1][0] - spans[0][0], spans[1][1] - spans[0][1])]
    return rates(args.iterations * args.batch_size, extra[0], extra[1])


def hand_rate(args: argparse.Namespace, data: Any) -> tuple[float, float]:
    """(wall, CPU) samples/s of the minimal loop (DDP-wrapped when a process group exists)."""
    torch.manual_seed(0)
    model = build_model(args.model, data.input_shape, data.num_outputs, seed=0)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    world, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x_all, y_all = data.x_train, data.y_train
    gen = torch.Generator().manual_seed(0)
    local = args.batch_size // world

    def run(iterations: int) -> None:
        perm, pos = torch.randperm(len(x_all), generator=gen), 0
        for _ in range(iterations):
            if pos + args.batch_size > len(perm):
                perm, pos = torch.randperm(len(x_all), generator=gen), 0
            idx = perm[pos + rank * local : pos + (rank + 1) * local]
            pos += args.batch_size
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x_all[idx]), y_all[idx])
            loss.backward()
            opt.step()

    run(10)  # warm-up
    if distributed:
        dist.barrier()
    start = clocks()
    run(args.iterations)
    return rates(args.iterations * local * world, start, clocks())


def single_process(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    """Wall-clock and CPU-time ratios, median over alternating repeats."""
    rows = []
    for _ in range(args.repeats):
        rows.append(
            (
                hand_rate(args, data),
                trainer_rate(args, data),
                trainer_rate(args, data, online_diversity="norms"),
            )
        )
    out: dict[str, Any] = {}
    for k, clock in enumerate(("wall", "cpu")):
        hand = [r[0][k] for r in rows]
        ours = [r[1][k] for r in rows]
        monitored = [r[2][k] for r in rows]
        out[f"hand_samples_per_s_{clock}"] = statistics.median(hand)
        out[f"train_samples_per_s_{clock}"] = statistics.median(ours)
        out[f"train_vs_hand_{clock}"] = statistics.median(
            t / h for t, h in zip(ours, hand, strict=True)
        )
        out[f"monitor_overhead_{clock}"] = statistics.median(
            t / m - 1 for t, m in zip(ours, monitored, strict=True)
        )
    return out


def _ddp_worker(rank: int, args: argparse.Namespace, data: Any, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hand, ours, ratios = [], [], []
    for _ in range(args.repeats):
        h = hand_rate(args, data)[0]  # wall clock: waiting in the all-reduce is the point
        t = trainer_rate(args, data, workers=2)[0]
        hand.append(h), ours.append(t), ratios.append(t / h)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(
                {
                    "ddp_samples_per_s": statistics.median(hand),
                    "train2_samples_per_s": statistics.median(ours),
                    "train2_vs_ddp": statistics.median(ratios),
                },
                fh,
            )
    teardown()


def two_workers(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ddp.json")
        mp.spawn(_ddp_worker, args=(args, data, free_port(), out), nprocs=2)
        with open(out) as fh:
            return json.load(fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="fc(depth=2,params=4000)")
    parser.add_argument("--batch-size", "-B", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads of the single-process contenders",
    )
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_dataset(args.dataset)
    result: dict[str, Any] = {
        "dataset": args.dataset,
        "model": args.model,
        "batch_size": args.batch_size,
        "iterations": args.iterations,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    result.update(single_process(args, data))
    if not args.skip_ddp:
        result.update(two_workers(args, data))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(
            f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}",
            file=sys.stdout,
        )


if __name__ == "__main__":
    main()
