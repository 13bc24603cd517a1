"""A simulated trainer with closed-form curves: a test double for the study machinery.

It returns what ``batchbound.train.train`` returns (``RunResult.to_dict()``) without training:
the loss decays as L0·exp(−r·t) with a per-iteration rate r(B) = r0·B/(B + B_c), so the
iterations to any fixed loss follow S(B) = S_min·(1 + B_c/B) exactly, McCandlish et al.'s
trade-off with critical batch B_c. B_c shrinks with depth (B_c = 512/depth), η away from its
best value slows progress, and each seed perturbs r by a few percent. Δ is measured every
``diversity_every_epochs`` epochs.

It checkpoints after every simulated epoch (sleeping ``$BATCHBOUND_SIM_SLEEP`` seconds per
epoch, default 0) and resumes from the checkpoint; sent SIGTERM or SIGINT it checkpoints and
returns status ``stopped``, as the real trainer does, and appends "key resumed? node" (the
Ray node, "-" outside Ray) to ``$BATCHBOUND_SIM_LOG`` when set, so tests can see which runs
executed, and where, and kill a study mid-run.
With ``$BATCHBOUND_SIM_CRASH_LR`` set, a run with that η kills its own process (os._exit).
With ``$BATCHBOUND_SIM_GATE`` set, every run waits (at most 10 minutes) until that file exists
before it trains: a test holds a runner mid-study for as long as it needs, however slowly a
busy machine starts the processes it races against.
Lives under tests/ so that no report can be made from it by accident; tests select it with
``run_study(..., trainer="simulated_trainer:execute")``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from batchbound.spec import parse_spec
from batchbound.train.checkpoint import StopFlag

L0, BEST_LR, R0 = 2.3, 0.1, 0.02


def critical_batch(depth: int) -> float:
    return 512.0 / max(depth, 1)


def rate(batch: int, lr: float, depth: int, seed: int) -> float:
    quality = math.exp(-(math.log(lr / BEST_LR) ** 2))
    jitter = 1.0 + 0.03 * math.sin(1.7 * seed + 0.3 * depth)
    return R0 * quality * jitter * batch / (batch + critical_batch(depth))


def step_seconds(batch: int, workers: int = 1) -> float:
    return 1e-4 + 1e-6 * math.ceil(batch / workers)


def _ray_node() -> str:
    """The Ray node this run executes on ("-" outside Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return "-"
    return str(ray.get_runtime_context().get_node_id())


def execute(fields: dict[str, Any], checkpoint_dir: Path, resume: bool,
            n_train: int = 1024) -> dict[str, Any]:
    from batchbound.study.adapter import config_key

    key = config_key(fields)
    log = os.environ.get("BATCHBOUND_SIM_LOG")
    if log:
        with open(log, "a") as fh:
            fh.write(f"{key} {int(resume)} {_ray_node()}\n")
    crash = os.environ.get("BATCHBOUND_SIM_CRASH_LR")  # tests: a worker dying mid-study
    if crash and float(crash) == fields["lr"]:
        os._exit(3)
    gate = os.environ.get("BATCHBOUND_SIM_GATE")
    deadline = time.monotonic() + 600
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    sleep = float(os.environ.get("BATCHBOUND_SIM_SLEEP", "0"))
    model = parse_spec(fields["model"]).kwargs
    depth, width = int(model.get("depth", 1)), int(model.get("width", 32))
    batch, lr, seed = fields["batch_size"], fields["lr"], fields["seed"]
    strategy = parse_spec(fields.get("strategy") or "blr")
    if strategy.name == "lsr":  # linear scaling from the base batch, as the trainer does
        lr = lr * batch / strategy.kwargs.get("base_batch", batch)
    r = rate(batch, lr, depth, seed)
    per_epoch = math.ceil(n_train / batch)
    targets = [dict(t) for t in fields.get("targets", [])]
    for t in targets:
        t.update(name=f"{t['metric']}{'>=' if t['metric'].endswith('acc') else '<='}"
                 f"{t['threshold']:g}", reached=False, iteration=None, epoch=None, seconds=None)
    eval_every = max(1, round(fields["eval_every_epochs"] * per_epoch))
    div_every = fields.get("diversity_every_epochs")
    div_every = None if div_every is None else max(1, round(div_every * per_epoch))
    last = int(fields["max_epochs"] * per_epoch)
    checkpoint = Path(checkpoint_dir) / "state.json"
    state = {"iteration": 0, "curves": [], "targets": targets}
    if resume and checkpoint.exists():
        state = json.loads(checkpoint.read_text())
    t, rows, targets = state["iteration"], state["curves"], state["targets"]
    status = "complete"
    stop = StopFlag().install()
    while t <= last:
        epoch, seconds = t / per_epoch, t * 1e-3
        loss = L0 * math.exp(-r * t)
        values = {"train_loss": loss, "train_acc": 1 - 0.9 * math.exp(-r * t)}
        if t % eval_every == 0 or t == last:
            for metric, value in values.items():
                rows.append([t, epoch, seconds, metric, value])
            for target in targets:
                if not target["reached"] and (
                    values[target["metric"]] >= target["threshold"]
                    if target["metric"].endswith("acc")
                    else values[target["metric"]] <= target["threshold"]
                ):
                    target.update(reached=True, iteration=t, epoch=epoch, seconds=seconds)
        if div_every and t % div_every == 0:
            delta = (width / 64) / (1 + 20 * loss / L0) / (depth * 10)
            rows.append([t, epoch, seconds, "diversity", delta])
            rows.append([t, epoch, seconds, "batch_bound", n_train * delta])
        if targets and all(x["reached"] for x in targets):
            break
        if lr > 1.0:  # far too large a step: diverges, as LSR does at large batch
            rows.append([t, epoch, seconds, "train_loss", math.inf])
            status = "diverged"
            break
        t += 1
        if t % per_epoch == 0:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            checkpoint.write_text(json.dumps({"iteration": t, "curves": rows,
                                              "targets": targets}))
            time.sleep(sleep)
            if stop.requested:
                status = "stopped"
                break
    stop.close()
    return {
        "config": dict(fields),
        "config_hash": key,
        "status": status,
        "targets": targets,
        "curves": {"columns": ["iteration", "epoch", "seconds", "metric", "value"],
                   "rows": rows},
        # a step of 1e-4 s plus 1e-6 s per example of the worker's micro-batch
        "timings": {"train": t * 1e-3, "data_per_iteration": 1e-5,
                    "compute_per_iteration": step_seconds(batch, fields.get("workers", 1)) - 2e-5,
                    "step_per_iteration": 1e-5, "communication_per_iteration": 0.0},
        "final": {"train_loss": L0 * math.exp(-r * t), "iterations": t},
        "message": "",
    }
