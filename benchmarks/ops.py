"""Deterministic CPU proxy for the cost of the in-loop tools: operations per step, counted by
the torch profiler (not a test; prints a table or JSON). Where a GPU step takes milliseconds
its cost is kernel launches, one per operation, so the count tracks that cost on a machine
without a GPU, and it is the same on every run (no timing noise).

Three counts per step, from one profiled step after four warm-up steps (and one more step
for the third; ``watch`` checks the model on its first step, and the loss's coupling again on
its 2nd, 4th, 8th, …: ``loss_coupling.py``):

- **ops**: the outermost aten operations (an aten op not called by another aten op): what
  Python and autograd dispatch, each ``torch._foreach_*`` counted once, whatever it loops
  over inside (on a GPU it is one or a few fused kernels);
- **compute**: those of them that are not views or metadata (``view``, ``reshape``,
  ``transpose``, ``detach``, ``empty``, a no-op ``to``, ...): closer to what launches device
  work (each at least one kernel on a GPU);
- **py**: Python frames entered (``sys.setprofile``'s calls, generator resumptions included):
  the host's work. On an H100 GPT-2 small's step under ``watch`` was bound by it, not by the
  GPU (docs/benchmarks.md), where the operation counts rose by a fifth; this count tracks it.

Rows (each the tool's step against the same plain step, on the same batch):

- ``watch``: ``with watch(model, monitor): loss.backward()`` against the bare forward and
  backward (HF GPT-2 4×128 context 64, batch 8; the MLP and LeNet-5 of
  benchmarks/diversity.py, batch 64); ``watch:norms`` is its cheap mode
  (``subset="norms"``: LayerNorm parameters only), ``watch bf16`` the same step under
  bfloat16 autocast;
- ``lightning`` / ``hf``: one optimizer step of 2 accumulated micro-batches through
  ``Trainer.fit`` / ``Trainer.train`` with and without the ``DiversityCallback``, per optimizer
  step by difference of runs of 4 and 8 steps (set-up cancels); the plain column is the
  framework's own optimizer step (its forward, backward and optimizer);
- ``measure``: ``measure()`` over 4 chunks against a plain forward and backward of the
  same chunks (its first call, which checks the model, excluded).

    python benchmarks/ops.py                 # the table
    python benchmarks/ops.py --json
    python benchmarks/ops.py --only watch    # or: lightning, hf, measure (comma-separated)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass

import torch
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from batchbound.diversity import OnlineDiversity, measure, watch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import CASES, Case

# Operations that only make views or read metadata: no device work.
VIEWS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::transpose", "aten::t",
    "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided",
    "aten::detach", "aten::alias", "aten::select", "aten::slice", "aten::movedim",
    "aten::_unsafe_view", "aten::empty", "aten::empty_strided", "aten::empty_like",
    "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::to",
    "aten::_to_copy_noop", "aten::contiguous", "aten::result_type", "aten::split",
    "aten::chunk", "aten::unbind", "aten::narrow", "aten::expand_as", "aten::view_as",
    "aten::flatten", "aten::unflatten", "aten::numpy_T", "aten::is_nonzero",
}


@dataclass
class Count:
    ops: int
    compute: int
    python: int = 0  # Python frames entered (generator resumptions included): host time


class _PythonCalls:
    """Counts Python frames entered while active (``sys.setprofile``'s "call" events): the
    host's share of a step that a GPU cannot hide. On an H100 `watch` made GPT-2 small's step
    host-bound (docs/benchmarks.md), which the operation counts do not show."""

    def __init__(self) -> None:
        self.calls = 0

    def _event(self, frame: object, event: str, arg: object) -> None:
        if event == "call":
            self.calls += 1

    def __enter__(self) -> _PythonCalls:
        sys.setprofile(self._event)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


def _aten(event: object) -> bool:
    return getattr(event, "name", "").startswith("aten::")


def count_events(events: list) -> Count:
    ops = compute = 0
    for event in events:
        if not _aten(event):
            continue
        parent = event.cpu_parent
        while parent is not None and not _aten(parent):
            parent = parent.cpu_parent
        if parent is not None:
            continue  # called by another aten op: part of that one
        ops += 1
        compute += event.name not in VIEWS
    return Count(ops, compute)


def profiled(step: Callable[[], object], warm: int = 4) -> Count:
    for _ in range(warm):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    with _PythonCalls() as calls:
        step()
    return Count(*astuple(count_events(prof.events()))[:2], python=calls.calls)


@dataclass
class Row:
    tool: str
    model: str
    plain: Count
    tool_count: Count

    @property
    def extra_ops(self) -> float:
        return 100.0 * (self.tool_count.ops - self.plain.ops) / self.plain.ops

    @property
    def extra_compute(self) -> float:
        return 100.0 * (self.tool_count.compute - self.plain.compute) / self.plain.compute

    @property
    def extra_python(self) -> float:
        return 100.0 * (self.tool_count.python - self.plain.python) / self.plain.python


# ------------------------------------------------------------------------------- watch

def _case(name: str, batch: int) -> tuple[Case, nn.Module, Tensor, Tensor]:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build().eval()  # dropout off: the same graph every step
    x, y = case.inputs(batch)
    return case, model, x, y


def watch_row(name: str, batch: int, subset: str = "all", bf16: bool = False) -> Row:
    case, model, x, y = _case(name, batch)
    monitor = OnlineDiversity()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = case.loss(model(x), y).mean()
        loss.backward()

    def watched() -> None:
        model.zero_grad(set_to_none=True)
        with watch(model, monitor, subset=subset):
            with autocast:
                loss = case.loss(model(x), y).mean()
            loss.backward()

    tool = ("watch" if subset == "all" else f"watch:{subset}") + (" bf16" if bf16 else "")
    return Row(tool, case.name, profiled(plain), profiled(watched))


def measure_row(name: str, chunk: int, chunks: int = 4) -> Row:
    case, model, x, y = _case(name, chunk * chunks)

    def plain() -> None:
        for start in range(0, x.shape[0], chunk):
            model.zero_grad(set_to_none=True)
            case.loss(model(x[start : start + chunk]), y[start : start + chunk]).sum().backward()

    def measured() -> None:
        measure(model, (x, y), case.loss, chunk_size=chunk)

    return Row("measure", case.name, profiled(plain), profiled(measured))


# --------------------------------------------------------------------------- callbacks
STEPS = (4, 8)


def _per_step(run: Callable[[int], None]) -> Count:
    """Per optimizer step, by difference of runs of STEPS[0] and STEPS[1] steps."""
    counts = []
    for steps in STEPS:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(steps)
        with _PythonCalls() as calls:
            run(steps)
        counts.append(Count(*astuple(count_events(prof.events()))[:2], python=calls.calls))
    span = STEPS[1] - STEPS[0]
    return Count(*(round((b - a) / span) for a, b in zip(astuple(counts[0]), astuple(counts[1]),
                                                            strict=True)))


def _tokens(batches: int, batch: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(256, (batches * batch, 65), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def lightning_row(batch: int) -> Row:
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from batchbound.integrations.lightning import DiversityCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    case = CASES["hf-gpt2"]
    x, y = _tokens(2 * STEPS[1], batch)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = case.build().eval()

        def training_step(self, b: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return case.loss(self.net(b[0]), b[1]).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def runner(with_callback: bool) -> Callable[[int], None]:
        def run(steps: int) -> None:
            with tempfile.TemporaryDirectory() as tmp:
                trainer = L.Trainer(
                    max_steps=steps, accumulate_grad_batches=2, accelerator="cpu", devices=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=tmp,
                    callbacks=[DiversityCallback(every=1000)] if with_callback else [])
                loader = DataLoader(TensorDataset(x, y), batch_size=batch)
                trainer.fit(Module(), loader)

        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Row("lightning", case.name, _per_step(runner(False)), _per_step(runner(True)))


def hf_row(batch: int) -> Row:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from batchbound.integrations.transformers import DiversityCallback

    hf_logging.set_verbosity_error()
    x, _ = _tokens(2 * STEPS[1], batch)
    data = [{"input_ids": row, "labels": row} for row in x]

    def runner(with_callback: bool) -> Callable[[int], None]:
        def run(steps: int) -> None:
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(
                n_layer=4, n_embd=128, n_head=4, n_positions=64, vocab_size=256,
                use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0))
            with tempfile.TemporaryDirectory() as tmp:
                args = TrainingArguments(
                    output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch,
                    gradient_accumulation_steps=2, learning_rate=1e-3, report_to="none",
                    save_strategy="no", logging_strategy="no", use_cpu=True,
                    dataloader_num_workers=0, disable_tqdm=True, seed=0)
                callbacks = [DiversityCallback(every=1000)] if with_callback else []
                trainer = Trainer(model=model, args=args, train_dataset=data,
                                  callbacks=callbacks)
                with contextlib.redirect_stdout(io.StringIO()):  # its summary line
                    trainer.train()

        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Row("hf", "HF GPT2LMHeadModel (4×128)", _per_step(runner(False)),
                   _per_step(runner(True)))


# -------------------------------------------------------------------------------- main

def rows_for(only: set[str]) -> list[Row]:
    rows = []
    if "watch" in only:
        rows += [watch_row("hf-gpt2", 8), watch_row("hf-gpt2", 8, "norms"),
                 watch_row("hf-gpt2", 8, bf16=True), watch_row("mlp", 64),
                 watch_row("lenet", 64)]
    if "lightning" in only:
        rows.append(lightning_row(8))
    if "hf" in only:
        rows.append(hf_row(8))
    if "measure" in only:
        rows += [measure_row("mlp", 64), measure_row("lenet", 64), measure_row("hf-gpt2", 8)]
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'tool':<17} {'model':<28} {'plain ops':>9} {'tool ops':>9} {'extra':>8} "
          f"{'plain cmp':>10} {'tool cmp':>9} {'extra':>8} {'plain py':>9} {'tool py':>8} "
          f"{'extra':>8}")
    for r in rows:
        print(f"{r.tool:<17} {r.model:<28} {r.plain.ops:>9} {r.tool_count.ops:>9} "
              f"{r.extra_ops:>+7.0f}% {r.plain.compute:>10} {r.tool_count.compute:>9} "
              f"{r.extra_compute:>+7.0f}% {r.plain.python:>9} {r.tool_count.python:>8} "
              f"{r.extra_python:>+7.0f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="watch,lightning,hf,measure",
                        help="comma-separated: watch, lightning, hf, measure")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = rows_for({part.strip() for part in args.only.split(",")})
    if args.json:
        print(json.dumps([{**asdict(r), "extra_ops_percent": r.extra_ops,
                           "extra_compute_percent": r.extra_compute,
                           "extra_python_percent": r.extra_python} for r in rows], indent=1))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
