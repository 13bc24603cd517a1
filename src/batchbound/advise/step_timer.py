"""One rank of the timed distributed step: ``python -m batchbound.advise.step_timer``.

``timing.time_workers`` starts P of these as fresh interpreters (not ``multiprocessing``
children, so a caller's script is never re-imported). Each joins a gloo group from the
torchrun-style environment, builds batchbound's ``Trainer`` and runs its real
``train_step`` at global batches P·m for each micro-batch m, in lockstep with its peers. The
trainer's own phase timer splits each iteration into compute (data, forward and backward,
optimiser step) and communication: the all-reduce and any waiting for a slower peer, which
an all-reduce timed alone does not see. The sizes are timed in interleaved rounds
(alternating order); rank 0 writes, per size, the median compute and the mean communication
over rounds as JSON.

    python -m batchbound.advise.step_timer CONFIG.json OUT.json THREADS REPEATS M1 [M2 ...]
    python -m batchbound.advise.step_timer allreduce OUT.json THREADS REPEATS BYTES
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

WARMUP = 3


def main(argv: list[str]) -> None:
    from batchbound import kernels
    from batchbound.train.config import TrainConfig
    from batchbound.train.distributed import setup, teardown
    from batchbound.train.loop import Trainer

    kernels.use()  # the kernels the timed training will run on ($BATCHBOUND_KERNELS)
    config_path, out, threads, repeats, *sizes = argv
    torch.set_num_threads(int(threads))
    config = TrainConfig.from_dict(json.loads(Path(config_path).read_text()))
    ctx = setup(config.device)
    finished = False
    try:
        trainer = Trainer(config, ctx)
        trainer.initial_loss = 1.0
        timer = trainer.timer
        micro = [int(m) for m in sizes]
        compute: dict[int, list[float]] = {m: [] for m in micro}
        communication: dict[int, list[float]] = {m: [] for m in micro}
        forwards: dict[int, list[float]] = {m: [] for m in micro}

        def step(m: int) -> None:
            trainer.batch_size = m * ctx.world_size
            before = dict(timer.totals)
            trainer.train_step(False, False)
            spent = {k: timer.totals[k] - before[k] for k in timer.totals}
            compute[m].append(spent["data"] + spent["compute"] + spent["step"])
            communication[m].append(spent["communication"])
            x, y = trainer.data.x_train[:m], trainer.data.y_train[:m]
            start = time.perf_counter()
            trainer.loss_fn(trainer.model(x), y).sum()
            forwards[m].append(time.perf_counter() - start)

        micro = sizes_that_run(step, micro)
        # interleaved rounds, every rank in the same order (the steps are collective): a
        # slow second slows one round of every size, not every repeat of one size
        for _ in range(WARMUP):
            for m in micro:
                step(m)
        for series in (compute, communication, forwards):
            for m in micro:
                series[m].clear()
        for r in range(int(repeats)):
            for m in (micro if r % 2 == 0 else reversed(micro)):
                step(m)
        rows = summarise(micro, compute, communication, forwards)
        if ctx.rank == 0:
            Path(out).write_text(json.dumps(rows))
        finished = True
    finally:
        teardown(synchronise=finished)


def sizes_that_run(step, micro: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    """``micro`` from the first size whose step runs on every rank (a user's model may not
    train on too few examples: BatchNorm1d in train mode needs two); the ranks agree by a
    MAX all-reduce of their failures. None runs: the model's own error is raised."""
    import torch.distributed as dist

    for i, m in enumerate(micro):
        error: Exception | None = None
        try:
            step(m)
        except Exception as exc:  # the user's model: raised again below if no size runs
            error = exc
        failed = torch.tensor([0.0 if error is None else 1.0])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed.item():
            return micro[i:]
        if i == len(micro) - 1:
            raise error if error is not None else RuntimeError(
                "the step failed on another rank at every micro-batch timed")
    return micro


def summarise(micro: list[int], compute: dict[int, list[float]],
              communication: dict[int, list[float]], forwards: dict[int, list[float]]
              ) -> list[dict[str, float]]:
    """Per micro-batch: the median compute and forward, and the *mean* communication. The
    run pays every wait, and waiting for a peer is heavy-tailed: two gloo ranks on two
    cores (mnist5k fc, m = 32) waited 1.1–1.9 ms at the median and 2.0–2.2 ms on average,
    and ``batchbound train`` paid 1.65 ms per iteration."""
    return [{"micro_batch": m, "compute": statistics.median(compute[m]),
             "communication": statistics.fmean(communication[m]),
             "forward": statistics.median(forwards[m])} for m in micro]


def allreduce(argv: list[str]) -> None:
    """``allreduce OUT.json THREADS REPEATS BYTES``: the median seconds of an all-reduce of
    BYTES of float32 among the ranks, for models that cannot be rebuilt in a fresh process
    (a user's Python object): their compute is timed in the caller's process."""
    import torch.distributed as dist

    from batchbound import kernels
    from batchbound.train.distributed import setup, teardown

    kernels.use()
    out, threads, repeats, size = argv
    torch.set_num_threads(int(threads))
    ctx = setup("cpu")
    finished = False
    try:
        buffer = torch.zeros(max(1, int(size) // 4))
        seconds = []
        for i in range(WARMUP + int(repeats)):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if i >= WARMUP:
                seconds.append(time.perf_counter() - start)
        if ctx.rank == 0:
            Path(out).write_text(json.dumps({"communication": statistics.median(seconds)}))
        finished = True
    finally:
        teardown(synchronise=finished)


if __name__ == "__main__":
    from batchbound.lifetime import die_with_parent

    # an advice killed mid-timing (SIGKILL, or SIGTERM, which it does not catch) takes its
    # ranks and their folder with it, instead of leaving them to time on for no one. The
    # folder is the one the advice made and named (timing._run_ranks), never one derived
    # from the arguments (read from the wrong position, it was the working directory); a
    # rank started by hand removes nothing
    folder = os.environ.get("BATCHBOUND_TIMER_FOLDER")
    die_with_parent(parent=int(os.environ.get("BATCHBOUND_TIMER_PARENT", os.getppid())),
                    remove=Path(folder) if folder else None)
    if sys.argv[1:2] == ["allreduce"]:
        allreduce(sys.argv[2:])
    else:
        main(sys.argv[1:])
