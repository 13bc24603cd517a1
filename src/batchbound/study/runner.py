"""Execute a study: tune, then train the finals, recording every run in the store.

Idempotent and resumable. Runs are keyed by config hash; a run whose stored status is
finished (complete, diverged, stopped) is never submitted again, and a run left ``running``
or ``failed`` by an earlier, killed study is resubmitted, resuming from its checkpoint when
one exists. A cell's final runs are submitted as soon as that cell's tuning runs are in, so
the pool stays busy across the two phases.

With ``tensorboard=DIR`` every finished run is also written to ``DIR/<run name>/`` from its
stored record (batchbound.train.tensorboard): as it finishes, and, for runs an earlier
invocation finished, when this one finds them done and their directory lacks a complete
write, so DIR is whole after a resumed study.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from batchbound.study.adapter import DEFAULT_TRAINER
from batchbound.study.executor import Executor, Job, Outcome, make_executor
from batchbound.study.plan import FINAL, TUNE, Plan, PlannedRun, make_plan
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
    chosen: dict[Any, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # plan, store, train wall


def checkpoint_root(store_path: Path) -> Path:
    return store_path.with_name(store_path.stem + "-checkpoints")


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
    """runs done / total, and the best final run so far (fewest epochs to the first target)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
        self.best: tuple[float, str] | None = None

    def advance(self, run: PlannedRun, result: dict[str, Any] | None, skipped: bool) -> None:
        if result and run.role == FINAL:
            targets = result.get("targets") or []
            if targets and targets[0].get("reached"):
                epochs = float(targets[0]["epoch"])
                if self.best is None or epochs < self.best[0]:
                    self.best = (epochs, f"{run.model.label} B={run.batch_size}")
        if self.bar is not None:
            if self.best:
                self.bar.set_postfix_str(f"best: {self.best[1]} in {self.best[0]:.2f} ep",
                                         refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_study(spec: StudySpec, store_path: str | Path, jobs: int | None = None, *,
              trainer: str = DEFAULT_TRAINER, progress: bool = True,
              executor: Executor | None = None,
              on_plan: Callable[[Plan], None] | None = None,
              tensorboard: str | Path | None = None) -> StudyOutcome:
    """Run (or finish) ``spec`` into the store at ``store_path``. ``jobs=0`` runs inline;
    ``tensorboard``: a directory that gets one TensorBoard run per finished run."""
    clock = time.perf_counter()
    store_path = Path(store_path)
    board = None if tensorboard is None else _TensorBoardRuns(tensorboard)
    plan = make_plan(spec)
    if on_plan is not None:
        on_plan(plan)
    tuning = plan.tuning_runs()
    outcome = StudyOutcome(spec.name, store_path, total=len(tuning) + plan.final_count())
    outcome.seconds["plan"] = time.perf_counter() - clock
    store_seconds = 0.0
    executor = executor or make_executor(jobs)
    bar = _Progress(outcome.total, progress)
    ckpt_root = checkpoint_root(store_path)
    # Tuning cells: which tuning runs decide which η (by final-run cell lookup key).
    cell_runs: dict[Any, list[PlannedRun]] = defaultdict(list)
    for run in tuning:
        cell_runs[run.group()].append(run)
    waiting = {cell: {r.key for r in runs} for cell, runs in cell_runs.items()}
    submitted: dict[str, list[PlannedRun]] = {}

    with Store(store_path) as store:
        tick = time.perf_counter()
        store.register_study(spec.name, spec.to_dict())
        points = {(data.label, shape.spec, batch, seed, mechanism, strategy)
                  for data, shape, batch, mechanism, strategy in plan.cells()
                  for seed in spec.train.seeds}
        store.prune(spec.name, {r.key for r in tuning}, points)
        store.register_runs(spec.name, [(r.key, TUNE, dict(r.fields), r.labels())
                                        for r in tuning])
        store_seconds += time.perf_counter() - tick

        def launch(runs: list[PlannedRun]) -> list[PlannedRun]:
            """Submit runs not finished yet; return the ones already finished."""
            nonlocal store_seconds
            tick = time.perf_counter()
            statuses = store.statuses(r.key for r in runs)
            done = []
            for run in runs:
                if statuses.get(run.key) in FINISHED:
                    done.append(run)
                    continue
                if run.key in submitted:  # the same config twice (a tune run reused as final)
                    submitted[run.key].append(run)
                    continue
                submitted[run.key] = [run]
                directory = ckpt_root / run.key
                store.mark_running(run.key)
                executor.submit(Job(run.key, dict(run.fields), directory,
                                    directory.exists() and any(directory.iterdir()), trainer))
            store_seconds += time.perf_counter() - tick
            return done

        def finals_for(cell: Any) -> list[PlannedRun]:
            nonlocal store_seconds
            tick = time.perf_counter()
            summary = pd.DataFrame([_summary_row(store, r, cell) for r in cell_runs[cell]])
            chosen = choose_step_sizes(summary, spec.lr.tuning)
            outcome.chosen.update(chosen)
            finals = plan.final_runs(chosen, only_cell=cell)
            store.replace_finals(spec.name, [(r.key, dict(r.fields), r.labels())
                                             for r in finals])
            store_seconds += time.perf_counter() - tick
            return finals

        def settle(runs: list[PlannedRun]) -> None:
            """Account for runs found finished, and release cells whose tuning is done."""
            for run in runs:
                outcome.skipped += 1
                if board is not None:
                    board.write(store, run, fresh=False)
                bar.advance(run, None, skipped=True)
                complete_tuning(run)

        def complete_tuning(run: PlannedRun) -> None:
            if run.role != TUNE:
                return
            cell = run.group()
            waiting[cell].discard(run.key)
            if not waiting[cell]:
                del waiting[cell]
                settle(launch(finals_for(cell)))

        try:
            if spec.lr.tuning == "none":
                finals = plan.final_runs({})
                store.register_runs(spec.name, [(r.key, FINAL, dict(r.fields), r.labels())
                                                for r in finals])
                settle(launch(finals))
            else:
                settle(launch(tuning))
            for result in executor.completed():
                tick = time.perf_counter()
                _record(store, result, outcome)
                store_seconds += time.perf_counter() - tick
                runs = submitted.pop(result.key)
                if board is not None and result.result is not None:
                    board.write(store, runs[0], fresh=True)
                for run in runs:
                    bar.advance(run, result.result, skipped=False)
                    complete_tuning(run)
                if result.result is not None and result.result.get("status") in FINISHED:
                    shutil.rmtree(ckpt_root / result.key, ignore_errors=True)
        finally:
            bar.close()
            executor.close()
    outcome.seconds["store"] = store_seconds
    if board is not None:
        outcome.seconds["tensorboard"] = board.seconds
    outcome.seconds["total"] = time.perf_counter() - clock
    return outcome


def _record(store: Store, result: Outcome, outcome: StudyOutcome) -> None:
    if result.result is None:
        store.mark_failed(result.key, result.error or "unknown error")
        outcome.failed += 1
    else:
        store.record_result(result.key, result.result, result.wall_seconds)
        outcome.executed += 1
        if result.result.get("status") == "failed":
            outcome.failed += 1


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

