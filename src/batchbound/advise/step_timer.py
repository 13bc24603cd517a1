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

The ranks agree on a failure by construction (``Lockstep``): every collective a timing rank
makes has the trainer's all-reduce's shape, whose extras carry the stop flag, and a rank
whose step raised (a user's model failing at one size, out of memory on one rank) joins its
peers' next all-reduce in its place with the flag set. No rank is left waiting in a
collective the others never enter, none enters a mismatched one, and all learn of the
failure at the same all-reduce; the failing rank names the size in one line.

    python -m batchbound.advise.step_timer CONFIG.json OUT.json THREADS REPEATS M1 [M2 ...]
    python -m batchbound.advise.step_timer allreduce OUT.json THREADS REPEATS BYTES
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WARMUP = 3
PEER_FAILED = 3  # the exit status of a rank stopped by another rank's failure (it says nothing)


class PeerFailed(Exception):
    """Another rank's step failed: its stop flag came through this rank's all-reduce."""


class SizeFailed(Exception):
    """This rank's step raised (``where``: at which micro-batch; the peers know of it through
    ``Lockstep.agree``)."""

    def __init__(self, where: str, rank: int, exc: BaseException) -> None:
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        super().__init__(f"the step {where} failed on rank {rank}: "
                         f"{type(exc).__name__}{': ' + first if first else ''}")


class Lockstep:
    """The trainer's all-reduce, noted, and the one a rank makes in its place.

    The trainer's step makes one collective, the all-reduce of its gradients with the extras
    ``[loss sum, stop, time exceeded]`` (``Trainer.train_step``; the online monitor, which
    adds more, is off when timing: ``timing.time_workers``). ``agree`` makes an all-reduce of
    the same shape, with no gradient and the stop flag set on failure: a rank whose step
    raised joins the all-reduce its peers are in, or their next one, which then reports a
    stop to them. So every rank makes the same collectives in the same order whatever fails.
    """

    def __init__(self, trainer: Any) -> None:
        from batchbound.errors import BatchboundError

        if trainer.monitor.active:
            raise BatchboundError("the step timer needs the online monitor off (its extras "
                                  "change the all-reduce's shape)")
        self.trainer = trainer
        self.entered = False  # the step under way has entered its all-reduce
        real = trainer.all_reduce

        def noted(grads: list[torch.Tensor], extras: list[float]) -> tuple[list[float], int]:
            self.entered = True
            return real(grads, extras)

        trainer.all_reduce = noted
        self._real = real

    def agree(self, failed: bool) -> bool:
        """An all-reduce in the trainer's shape carrying ``failed``; whether any rank failed."""
        grads = [torch.zeros_like(p) for p in self.trainer.params]
        summed, _ = self._real(grads, [0.0, 1.0 if failed else 0.0, 0.0])
        return summed[1] > 0

    def run(self, step: Callable[[int], None], m: int, rank: int) -> None:
        """``step(m)``; when it raises, join the peers' all-reduce with the flag set (that of
        this step when it had not entered its own, else their next: one either way) and raise
        SizeFailed."""
        try:
            step(m)
        except PeerFailed:
            raise
        except Exception as exc:  # the user's model at this size: any error, named
            self.agree(True)
            raise SizeFailed(f"at micro-batch {m}", rank, exc) from exc


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
        lock = Lockstep(trainer)
        timer = trainer.timer
        micro = [int(m) for m in sizes]
        compute: dict[int, list[float]] = {m: [] for m in micro}
        communication: dict[int, list[float]] = {m: [] for m in micro}
        forwards: dict[int, list[float]] = {m: [] for m in micro}

        def step(m: int) -> None:
            trainer.batch_size = m * ctx.world_size
            before = dict(timer.totals)
            if trainer.train_step(False, False)["stop"]:  # no rank asks to stop: a failure
                raise PeerFailed(m)
            spent = {k: timer.totals[k] - before[k] for k in timer.totals}
            compute[m].append(spent["data"] + spent["compute"] + spent["step"])
            communication[m].append(spent["communication"])
            x, y = trainer.data.x_train[:m], trainer.data.y_train[:m]
            start = time.perf_counter()
            trainer.loss_fn(trainer.model(x), y).sum()
            forwards[m].append(time.perf_counter() - start)

        try:
            micro = sizes_that_run(lock, step, micro, ctx.rank)
            # interleaved rounds, every rank in the same order (the steps are collective): a
            # slow second slows one round of every size, not every repeat of one size
            for _ in range(WARMUP):
                for m in micro:
                    lock.run(step, m, ctx.rank)
            for series in (compute, communication, forwards):
                for m in micro:
                    series[m].clear()
            for r in range(int(repeats)):
                for m in (micro if r % 2 == 0 else reversed(micro)):
                    lock.run(step, m, ctx.rank)
            if lock.agree(False):  # a rank failed after its last all-reduce
                raise PeerFailed(micro[-1])
        except SizeFailed as exc:  # the peers know (Lockstep): one line, and all leave
            finished = True
            print(exc, file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except PeerFailed:  # the failing rank says what failed
            finished = True
            raise SystemExit(PEER_FAILED) from None
        rows = summarise(micro, compute, communication, forwards)
        if ctx.rank == 0:
            Path(out).write_text(json.dumps(rows))
        finished = True
    finally:
        teardown(synchronise=finished)


def sizes_that_run(lock: Lockstep, step: Callable[[int], None], micro: list[int],
                   rank: int) -> list[int]:
    """``micro`` from the first size whose step runs on every rank (a user's model may not
    train on too few examples: BatchNorm1d in train mode needs two). Each try ends with one
    ``Lockstep.agree`` on every rank, after a failing rank's stand-in for the all-reduce it
    had not reached. None runs: SizeFailed on the ranks that failed, PeerFailed on others."""
    for i, m in enumerate(micro):
        error: Exception | None = None
        lock.entered = False
        try:
            step(m)
        except PeerFailed:
            pass  # this rank ran; the failing one flags it below as well
        except Exception as exc:  # the user's model: raised again below if no size runs
            error = exc
            if not lock.entered:
                lock.agree(True)  # in place of the all-reduce its peers are in
        if not lock.agree(error is not None):
            return micro[i:]
        if i == len(micro) - 1:
            if error is not None:
                raise SizeFailed(f"at every micro-batch timed ({micro[0]} to {m})", rank,
                                 error) from error
            raise PeerFailed(m)
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
