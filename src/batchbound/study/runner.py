"""Execute a study: tune, then train the finals, recording every run in the store.

The runner is a state machine over runs, and its rules live in ``RunStates`` alone:

    pending ──submit──▶ running ──▶ complete | diverged      finished: never run again
                          │   └──▶ stopped                  resumable: its checkpoint is kept
                          └──────▶ failed                   retried by the next invocation

A run left ``running`` by a runner that died, and a ``stopped`` run (its worker was sent
SIGTERM or SIGINT: the trainer checkpointed and returned), are resumed from their checkpoint by
the next ``study run``; ``failed`` runs are retried (from a checkpoint when they left one).
Only finished runs lose their checkpoint. One runner at a time per store, under any of its
names: a second one is refused (``Store(path, exclusive=True)``), so no run executes twice.
The executor's workers die with the runner whatever kills it (executor.py).

A cell's final runs are submitted as soon as that cell's tuning runs are in, so the workers
stay busy across the two phases. With ``tensorboard=DIR`` every finished run is also written to
``DIR/<run name>/`` from its stored record (batchbound.train.tensorboard), and runs finished by
an earlier invocation are written when their directory lacks a complete write.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from batchbound.environment import check_torchrun_environment
from batchbound.errors import BatchboundError
from batchbound.study.adapter import DEFAULT_TRAINER, check_trainer
from batchbound.study.executor import Executor, Job, Outcome, make_executor
from batchbound.study.plan import FINAL, TUNE, Cell, Plan, PlannedRun, make_plan
from batchbound.study.spec import StudySpec
from batchbound.study.store import FINISHED, Store
from batchbound.study.tuning import choose_step_sizes, final_loss


@dataclass
class StudyOutcome:
    study: str
    store: Path
    total: int = 0
    executed: int = 0
    skipped: int = 0
    failed: int = 0
    stopped: int = 0
    chosen: dict[Any, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # plan, store, train wall


def checkpoint_root(store_path: Path) -> Path:
    return store_path.with_name(store_path.stem + "-checkpoints")


# A run's store status -> the statuses it may move to.
TRANSITIONS: dict[str, tuple[str, ...]] = {
    "pending": ("running",),
    "running": ("complete", "diverged", "stopped", "failed"),
    "stopped": ("running",),  # resumable: its checkpoint is kept
    "failed": ("running",),  # retried, from a checkpoint when it left one
    "complete": (),
    "diverged": (),
}


class RunStates:
    """Where each run is, and the transitions allowed: the runner's rules in one place."""

    def __init__(self, store: Store, checkpoints: Path) -> None:
        self.store, self.checkpoints = store, checkpoints
        self.in_flight: dict[str, list[PlannedRun]] = {}  # key -> the planned runs it serves

    def checkpoint_dir(self, key: str) -> Path:
        return self.checkpoints / key

    def partition(self, runs: Iterable[PlannedRun]) -> tuple[list[PlannedRun], list[PlannedRun]]:
        """(to submit, already finished). A run already in flight (the same config as a
        tuning run reused as a final) joins it and is in neither list. Any status but a
        finished one is resumable: ``running`` ones were left by a runner that died, since
        this runner holds the store's lock."""
        runs = list(runs)
        statuses = self.store.statuses(r.key for r in runs)
        submit, done = [], []
        for run in runs:
            if statuses.get(run.key) in FINISHED:
                done.append(run)
            elif run.key in self.in_flight:
                self.in_flight[run.key].append(run)
            else:
                self.in_flight[run.key] = [run]
                submit.append(run)
        return submit, done

    def start(self, run: PlannedRun, trainer: str) -> Job:
        """running: the job to submit, resuming when the run left a checkpoint."""
        self.store.mark_running(run.key)
        directory = self.checkpoint_dir(run.key)
        resume = directory.exists() and any(directory.iterdir())
        return Job(run.key, dict(run.fields), directory.absolute(), resume, trainer)

    def finish(self, outcome: Outcome) -> tuple[str, list[PlannedRun]]:
        """running -> the outcome's status, recorded; returns it and the runs it served.
        The checkpoint goes only with a finished run: a stopped or failed one resumes."""
        if outcome.result is None:
            self.store.mark_failed(outcome.key, outcome.error or "unknown error")
            status = "failed"
        else:
            status = str(outcome.result.get("status", "complete"))
            if status not in TRANSITIONS["running"]:
                raise BatchboundError(f"run {outcome.key}: the trainer returned status "
                                      f"{status!r}")
            self.store.record_result(outcome.key, outcome.result, outcome.wall_seconds)
        if status in FINISHED:
            shutil.rmtree(self.checkpoint_dir(outcome.key), ignore_errors=True)
        return status, self.in_flight.pop(outcome.key)


def _summary_row(store: Store, run: PlannedRun, cell: Any) -> dict[str, Any]:
    """One tuning run's final loss and iterations to its first target, from the store."""
    status = store.status(run.key) or "failed"
    curves = pd.read_sql_query("SELECT iteration, metric, value FROM curves WHERE key=? AND "
                               "metric='train_loss'", store.db, params=(run.key,))
    target = store.db.execute("SELECT reached, iteration FROM targets WHERE key=? ORDER BY "
                              "rowid LIMIT 1", (run.key,)).fetchone()
    iterations = float(target[1]) if target and target[0] else float("nan")
    return {"cell": cell, "lr": run.lr, "seed": run.seed, "status": status,
            "final_loss": final_loss(curves, status), "iterations": iterations}


class _Progress:
    """runs done / total, and the best final run so far (fewest epochs to the first target):
    a bar on a terminal; in a log (stderr not a terminal) a plain line every LOG_SECONDS and
    at the end, since a bar's carriage returns make one endless line there."""

    LOG_SECONDS = 30.0

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.total, self.done, self.logged = total, 0, time.monotonic()
        self.log = enabled and not sys.stderr.isatty()
        if enabled and not self.log:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
        self.best: tuple[float, str] | None = None

    def advance(self, run: PlannedRun, result: dict[str, Any] | None) -> None:
        if result and run.role == FINAL:
            targets = result.get("targets") or []
            if targets and targets[0].get("reached"):
                epochs = float(targets[0]["epoch"])
                if self.best is None or epochs < self.best[0]:
                    self.best = (epochs, f"{run.model.label} B={run.batch_size}")
        self.done += 1
        if self.bar is not None:
            if self.best:
                self.bar.set_postfix_str(f"best: {self.best[1]} in {self.best[0]:.2f} ep",
                                         refresh=False)
            self.bar.update(1)
        elif self.log and time.monotonic() - self.logged >= self.LOG_SECONDS:
            self._line()

    def _line(self) -> None:
        self.logged = time.monotonic()
        best = f", best: {self.best[1]} in {self.best[0]:.2f} ep" if self.best else ""
        print(f"study: {self.done}/{self.total} runs{best}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log and self.done:
            self._line()


class StudyRunner:
    """One invocation of a study over a store it holds exclusively."""

    def __init__(self, spec: StudySpec, plan: Plan, store: Store, executor: Executor,
                 outcome: StudyOutcome, *, trainer: str, checkpoints: Path,
                 board: _TensorBoardRuns | None, progress: bool) -> None:
        self.spec, self.plan, self.store, self.executor = spec, plan, store, executor
        self.outcome, self.trainer, self.board = outcome, trainer, board
        self.states = RunStates(store, checkpoints)
        self.bar = _Progress(outcome.total, progress)
        self.store_seconds = 0.0
        self.tuning = plan.tuning_runs()
        self.cell_runs: dict[Cell, list[PlannedRun]] = defaultdict(list)
        for run in self.tuning:
            self.cell_runs[run.group()].append(run)
        # a cell's finals are released once none of its tuning runs is outstanding
        self.waiting = {cell: {r.key for r in runs} for cell, runs in self.cell_runs.items()}

    @contextmanager
    def _store_time(self) -> Iterator[None]:
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.store_seconds += time.perf_counter() - tick

    def register(self) -> None:
        spec, plan = self.spec, self.plan
        with self._store_time():
            self.store.register_study(spec.name, spec.to_dict())
            points = {(data.label, shape.spec, batch, seed, mechanism, strategy)
                      for data, shape, batch, mechanism, strategy in plan.cells()
                      for seed in spec.train.seeds}
            self.store.prune(spec.name, {r.key for r in self.tuning}, points)
            self.store.register_runs(spec.name, [(r.key, TUNE, dict(r.fields), r.labels())
                                                 for r in self.tuning])

    def run(self) -> None:
        self.register()
        try:
            if self.spec.lr.tuning == "none":
                finals = self.plan.final_runs({})
                with self._store_time():  # one final per grid point: a run of the same
                    # point under another key (its data files changed) is unlinked
                    self.store.replace_finals(self.spec.name, [
                        (r.key, dict(r.fields), r.labels()) for r in finals])
                self.launch(finals)
            else:
                self.launch(self.tuning)
            for result in self.executor.completed():
                self.on_outcome(result)
        finally:
            self.bar.close()
            self.executor.close()

    def launch(self, runs: list[PlannedRun]) -> None:
        """Submit the runs not finished yet; account for the finished ones."""
        with self._store_time():
            submit, done = self.states.partition(runs)
            jobs = [self.states.start(run, self.trainer) for run in submit]
        for job in jobs:
            self.executor.submit(job)
        for run in done:
            self.outcome.skipped += 1
            if self.board is not None:
                self.board.write(self.store, run, fresh=False)
            self.bar.advance(run, None)
            self.tuning_settled(run)

    def on_outcome(self, result: Outcome) -> None:
        with self._store_time():
            status, runs = self.states.finish(result)
        if status == "failed":
            self.outcome.failed += 1
        elif status == "stopped":
            self.outcome.stopped += 1
        if result.result is not None:
            self.outcome.executed += 1
            if self.board is not None and status != "stopped":
                self.board.write(self.store, runs[0], fresh=True)
        for run in runs:
            self.bar.advance(run, result.result)
            self.tuning_settled(run)

    def tuning_settled(self, run: PlannedRun) -> None:
        """A tuning run is in (finished, failed or stopped): release its cell's finals when
        it was the last. A cell with a stopped or failed run chooses from the ones it has;
        the next invocation reruns those and chooses again (``Store.replace_finals``)."""
        if run.role != TUNE:
            return
        cell = run.group()
        self.waiting[cell].discard(run.key)
        if not self.waiting[cell]:
            del self.waiting[cell]
            self.launch(self.finals_for(cell))

    def finals_for(self, cell: Cell) -> list[PlannedRun]:
        with self._store_time():
            summary = pd.DataFrame([_summary_row(self.store, r, cell)
                                    for r in self.cell_runs[cell]])
            chosen = choose_step_sizes(summary, self.spec.lr.tuning)
            self.outcome.chosen.update(chosen)
            finals = self.plan.final_runs(chosen, only_cell=cell)
            self.store.replace_finals(self.spec.name, [(r.key, dict(r.fields), r.labels())
                                                       for r in finals])
        return finals


def run_study(spec: StudySpec, store_path: str | Path, jobs: int | None = None, *,
              trainer: str = DEFAULT_TRAINER, progress: bool = True,
              executor: Executor | None = None,
              on_plan: Callable[[Plan], None] | None = None,
              tensorboard: str | Path | None = None,
              checkpoints: str | Path | None = None) -> StudyOutcome:
    """Run (or finish) ``spec`` into the store at ``store_path``. ``jobs=0`` runs inline.

    ``executor``: where runs execute (default: a local pool of ``jobs`` processes; executors
    start their workers on the first submit, after the store's lock is held). ``tensorboard``:
    a directory that gets one TensorBoard run per finished run. ``checkpoints``: where runs
    keep their checkpoints (default ``<store>-checkpoints`` beside the store; every worker
    must reach it)."""
    clock = time.perf_counter()
    world, _ = check_torchrun_environment()  # every run inherits it: check it once, first
    if world > 1:
        raise BatchboundError(f"study run in a torchrun environment (WORLD_SIZE={world}): each "
                              "run would try to join that group; run the study outside "
                              "torchrun (a run's own workers: [train] workers)")
    store_path = Path(store_path)
    board = None if tensorboard is None else _TensorBoardRuns(tensorboard)
    check_trainer(trainer)  # a typo fails here, not in every run's error column
    with Store(store_path, exclusive=True) as store:  # refused before any planning
        plan = make_plan(spec)
        if on_plan is not None:
            on_plan(plan)
        outcome = StudyOutcome(spec.name, store_path,
                               total=len(plan.tuning_runs()) + plan.final_count())
        outcome.seconds["plan"] = time.perf_counter() - clock
        root = Path(checkpoints) if checkpoints else checkpoint_root(store_path)
        runner = StudyRunner(spec, plan, store, executor or make_executor(jobs), outcome,
                             trainer=trainer, checkpoints=root, board=board, progress=progress)
        runner.run()
        store.check_identity("found at the end of the study")  # before it is reported saved
    outcome.seconds["store"] = runner.store_seconds
    if board is not None:
        outcome.seconds["tensorboard"] = board.seconds
    outcome.seconds["total"] = time.perf_counter() - clock
    return outcome


class _TensorBoardRuns:
    """Writes finished runs as TensorBoard event files, one directory per run key."""

    def __init__(self, root: str | Path) -> None:
        from batchbound.train import tensorboard  # only studies that ask need the trainer

        self.tb = tensorboard
        self.root = tensorboard.check_logdir(root)
        self.seconds = 0.0

    def write(self, store: Store, run: PlannedRun, fresh: bool) -> None:
        """``fresh``: the run just finished, so rewrite; otherwise only fill a gap."""
        directory = self.root / self.tb.run_name(run.labels(), run.key)
        if not fresh and self.tb.written_key(directory) == run.key:
            return
        tick = time.perf_counter()
        result, finished = store.run_result(run.key)
        try:
            self.tb.write_run(result, directory, finished_at=finished)
        except OSError as exc:  # a view of the store: the study goes on, a rerun fills it in
            print(f"TensorBoard: could not write {directory}: {exc}; `study run` again "
                  "writes it", file=sys.stderr)
        self.seconds += time.perf_counter() - tick
