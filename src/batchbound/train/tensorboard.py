"""A finished run as TensorBoard event files: every curve as scalars, the config as text and
hparams.

``write_run(result, logdir)`` writes one run into one directory, after the run: the curves
are the record, TensorBoard is a view of it. Every row ``(iteration, epoch, seconds, metric,
value)`` becomes a scalar at ``global_step = iteration`` under the tag ``TAGS[metric]``;
a metric not in ``TAGS`` follows ``tag_for``'s fallback (``train_x`` → ``train/x``, ``test_x``
→ ``test/x``, diversity-like names → ``diversity/x``, anything else → ``other/x``), so a new
metric is written, never dropped. Besides the curves:

- ``progress/epoch``: the epoch at each iteration that has a row (TensorBoard's x axis is the
  step; this is the key from iterations to epochs);
- ``final/<name>``: the run's numeric ``final`` values (metrics, probes) at its last iteration;
- texts ``config`` (every TrainConfig field) and ``run`` (status, hash, message, targets);
- an hparams session (config fields that are set, plus ``status``), so the HParams dashboard
  compares the runs of a study side by side.

Wall times are ``finished_at − (last seconds − seconds)``: the run's training seconds
(evaluation and Δ excluded), so TensorBoard's relative time axis is training time.

Rewriting is idempotent: ``logdir`` holds one run, and a write replaces the event files
directly in it (subdirectories are left alone), so a run written twice (a resumed study)
never shows doubled points. A sidecar ``batchbound-run.json`` (config hash, status, rows) is
written last; ``written_key(logdir)`` reads it, so a caller can tell a complete write from an
interrupted one. TensorBoard is imported only here and only when writing: importing
batchbound does not import it.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchbound.errors import BatchboundError
from batchbound.files import write_whole
from batchbound.train.result import RunResult

INSTALL = "pip install 'batchbound[tensorboard]'"
MARKER = "batchbound-run.json"
EVENTS = "tfevents"  # what TensorBoard looks for in a file name

# metric -> tag; names not here follow tag_for's fallback.
TAGS = {
    "batch_loss": "train/batch_loss",
    "train_loss": "train/loss",
    "train_acc": "train/acc",
    "test_loss": "test/loss",
    "test_acc": "test/acc",
    "lr": "optim/lr",
    "batch_size": "optim/batch_size",
    "diversity": "diversity/exact",
    "batch_bound": "diversity/batch_bound",
    "online_diversity": "diversity/online",
    "online_batch_bound": "diversity/online_batch_bound",
}
_UNSAFE = re.compile(r"[^A-Za-z0-9.=+-]+")


def tag_for(metric: str) -> str:
    """The TensorBoard tag of a curve metric: ``TAGS``, else a prefix rule, else ``other/``."""
    if metric in TAGS:
        return TAGS[metric]
    for prefix, group in (("train_", "train"), ("test_", "test")):
        if metric.startswith(prefix):
            return f"{group}/{metric[len(prefix):]}"
    if metric.startswith(("online_", "diversity", "batch_bound")):
        return f"diversity/{metric}"
    return f"other/{metric}"


def check_logdir(path: str | Path) -> Path:
    """Fail before any training when ``path`` cannot take event files, or TensorBoard is
    missing: creates the directory and writes a probe file. Returns the path."""
    _summary_writer()
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise BatchboundError(f"cannot write TensorBoard files to {path}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from None
    return path


def run_name(labels: Mapping[str, Any], key: str) -> str:
    """A readable, filesystem-safe directory name for one run: data, model, strategy, B, η,
    seed, mechanism (when not ``none``) and the first 8 characters of ``key``. ``labels`` is
    a study run's labels or a ``TrainConfig.to_dict()``."""
    model = labels.get("model_label") or labels.get("model")
    mechanism = labels.get("mechanism")
    parts = [
        labels.get("data") or labels.get("dataset"),
        model,
        labels.get("strategy"),
        _labelled("B", labels.get("batch_size")),
        _labelled("lr", labels.get("lr")),
        _labelled("seed", labels.get("seed")),
        None if mechanism in (None, "none") else mechanism,
    ]
    text = "_".join(_UNSAFE.sub("-", str(p)).strip("-") for p in parts if p not in (None, ""))
    return f"{text[:150]}_{key[:8]}" if text else key[:8]


def _labelled(name: str, value: Any) -> str | None:
    if value is None:
        return None
    return f"{name}{value:g}" if isinstance(value, float) else f"{name}{value}"


def written_key(logdir: str | Path) -> str | None:
    """The config hash of the run whose write into ``logdir`` completed, or None."""
    try:
        return json.loads((Path(logdir) / MARKER).read_text())["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_replaceable(logdir: str | Path, config_hash: str) -> None:
    """Before a run that will write into ``logdir``: event files of another run there (its
    sidecar names another config, or there is none) are refused, as ``write_run`` would
    replace them; the same run's (a rerun, a resume) are replaced."""
    logdir = Path(logdir)
    if not logdir.is_dir() or written_key(logdir) == config_hash:
        return
    events = sorted(p.name for p in logdir.iterdir() if EVENTS in p.name and p.is_file())
    if events:
        raise BatchboundError(
            f"--tensorboard {logdir} holds another run's events ({events[0]}), which this run "
            "would replace; give each run its own directory (a run's own events are replaced "
            "when it runs again)")


def write_run(result: RunResult, logdir: str | Path, *,
              finished_at: float | None = None) -> Path:
    """Write ``result`` as TensorBoard events into ``logdir`` (replacing an earlier write of
    a run there) and return the event file. ``finished_at`` (Unix seconds, default now) is
    when training ended; the curves' wall times count back from it."""
    writer_class = _summary_writer()
    logdir = check_logdir(logdir)
    (logdir / MARKER).unlink(missing_ok=True)
    before = {p for p in logdir.iterdir() if EVENTS in p.name and p.is_file()}
    end = time.time() if finished_at is None else float(finished_at)
    start = end - _train_seconds(result)
    writer = writer_class(str(logdir), max_queue=4096, flush_secs=3600)
    try:
        _write_curves(writer, result.curves, start)
        _write_final(writer, result, end)
        _write_config(writer, result, start)
    finally:
        writer.close()
    new = [p for p in logdir.iterdir() if EVENTS in p.name and p.is_file() and p not in before]
    for old in before:
        old.unlink(missing_ok=True)
    marker = {"config_hash": result.config_hash, "status": result.status,
              "rows": len(result.curves), "event_file": new[0].name if new else None}
    write_whole(logdir / MARKER, json.dumps(marker, indent=1) + "\n")
    return new[0] if new else logdir


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise BatchboundError(f"TensorBoard output needs the tensorboard package: "
                              f"{INSTALL}") from None
    return SummaryWriter


def _train_seconds(result: RunResult) -> float:
    """The last finite ``seconds`` of the curves (None is a NaN the store kept as NULL)."""
    seconds = [float(row[2]) for row in result.curves
               if row[2] is not None and math.isfinite(float(row[2]))]
    return max(seconds, default=0.0)


def _write_curves(writer: Any, curves: list[tuple[Any, ...]], start: float) -> None:
    wall = start
    epochs: dict[int, tuple[float, float]] = {}
    for iteration, epoch, seconds, metric, value in curves:
        if seconds is not None and math.isfinite(float(seconds)):
            wall = start + float(seconds)
        writer.add_scalar(tag_for(str(metric)), math.nan if value is None else float(value),
                          int(iteration), walltime=wall)
        if epoch is not None:
            epochs[int(iteration)] = (float(epoch), wall)
    for iteration, (epoch, at) in sorted(epochs.items()):
        writer.add_scalar("progress/epoch", epoch, iteration, walltime=at)


def _write_final(writer: Any, result: RunResult, end: float) -> None:
    """``final/<name>`` at the last iteration: one value per run for the HParams table."""
    step = max((int(row[0]) for row in result.curves), default=0)
    step = int(result.final.get("iterations") or step)
    for name, value in result.final.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(f"final/{name}", float(value), step, walltime=end)


def _write_config(writer: Any, result: RunResult, start: float) -> None:
    config = result.config.to_dict()
    table = ["| field | value |", "|---|---|"]
    table += [f"| {name} | `{json.dumps(value)}` |" for name, value in config.items()]
    writer.add_text("config", "\n".join(table), 0, walltime=start)
    run = [f"**status** {result.status} · **config hash** `{result.config_hash}`"]
    if result.message:
        run.append(f"**message** {result.message}")
    for t in result.targets:
        run.append(f"- target {t.name}: " + (
            f"reached at iteration {t.iteration}, epoch {t.epoch:.4g}, {t.seconds:.4g} s"
            if t.reached else "not reached"))
    writer.add_text("run", "\n\n".join(run), 0, walltime=start)
    _write_hparams(writer, config, result.status, start)


def _write_hparams(writer: Any, config: Mapping[str, Any], status: str, start: float) -> None:
    """The session's hparams, without an experiment summary: TensorBoard then builds the
    experiment from every run it finds, so a study's runs line up in one table."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    values: dict[str, Any] = {"status": status}
    for name, value in config.items():
        if value is None:
            continue  # unset: left out, so a field set in other runs keeps one type
        values[name] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    _, session_start, _ = hparams_summaries(values, {})
    writer.file_writer.add_summary(session_start, walltime=start)
