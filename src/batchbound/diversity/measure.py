"""``measure``: exact S, T, Δ and B of a model over a whole data set, streamed in chunks.

Memory is bounded by the chunk size (plus one float64 copy of the gradient sum), not by n.
The model is measured in eval mode (see ``rules/norm.py`` for why BatchNorm requires it) and
every module's mode is restored afterwards; ``.grad`` fields are never touched.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from batchbound import kernels
from batchbound.data.dataset import Dataset
from batchbound.diversity.budget import check_budget, chunk_for_budget, kept_bytes, size
from batchbound.diversity.calls import Inputs, call_model, dict_batch, flatten
from batchbound.diversity.collector import heap_frozen
from batchbound.diversity.distributed import all_reduce_sum, world_size
from batchbound.diversity.graph import is_accumulator, walk
from batchbound.diversity.losses import DeferredFinite, PerExampleLoss, loss_name, resolve_loss
from batchbound.diversity.precision import LOW_PRECISION, autocast_dtypes, lowest, statement
from batchbound.diversity.prepared import PreparedStats
from batchbound.diversity.report import DiversityReport
from batchbound.diversity.stats import (
    ENGINES,
    eval_mode,
    norm_dtype,
    trainable_parameters,
)
from batchbound.errors import BatchboundError, raised_by_user_code, warn

Data = Dataset | TorchDataset | DataLoader | tuple[Tensor, Tensor] | Mapping[str, Any]


def _split(x: Tensor, y: Tensor, chunk_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    for start in range(0, x.shape[0], chunk_size):
        yield x[start : start + chunk_size], y[start : start + chunk_size]


def _from_loader(batches: Iterable[Any], chunk_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    for batch in batches:
        if isinstance(batch, Mapping):  # Hugging Face's (a dict, a BatchEncoding):
            # model(**batch), loss(outputs, batch)
            both = dict_batch(batch)
            yield from _split(both, both, chunk_size)  # type: ignore[arg-type]
            continue
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise BatchboundError(
                "each batch of the data must be an (inputs, targets) pair or a dict for "
                f"model(**batch), got {type(batch).__name__}"
            )
        x = batch[0]
        if isinstance(x, (tuple, list, dict)):  # a model of several inputs: model(*x) or (**x)
            found = Inputs.of((), x) if isinstance(x, dict) else Inputs.of(tuple(x), {})
            if found is None:
                raise BatchboundError("the batch's inputs hold no tensor of examples")
            x = found
        yield from _split(x, batch[1], chunk_size)


def data_chunks(
    data: Data, chunk_size: int
) -> tuple[Iterator[tuple[Tensor, Tensor]], int | None, str | None]:
    """(iterator of (x, y) chunks of at most ``chunk_size`` examples, n if known in advance,
    task if known). Empty data raise BatchboundError before any work."""
    if isinstance(data, Dataset):
        if data.n_train == 0:
            raise BatchboundError(f"data set {data.name!r} has no training examples")
        return _split(data.x_train, data.y_train, chunk_size), data.n_train, data.task
    if (
        isinstance(data, (tuple, list))
        and len(data) == 2
        and all(isinstance(t, Tensor) for t in data)
    ):
        x, y = data
        if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
            raise BatchboundError(
                f"inputs {tuple(x.shape)} and targets {tuple(y.shape)} must share their first "
                "(example) dimension"
            )
        if x.shape[0] == 0:
            raise BatchboundError("the data are empty: 0 examples")
        return _split(x, y, chunk_size), int(x.shape[0]), None
    if isinstance(data, Mapping):  # one dict batch, all the data (as an (x, y) pair is)
        both = dict_batch(data)
        if both.n == 0:
            raise BatchboundError("the data are empty: 0 examples")
        return _split(both, both, chunk_size), both.n, None  # type: ignore[arg-type]
    if isinstance(data, DataLoader):
        if hasattr(data.dataset, "__len__") and len(data.dataset) == 0:  # type: ignore[arg-type]
            raise BatchboundError("the DataLoader's data set is empty: 0 examples")
        sampler = getattr(data.batch_sampler, "sampler", None) or data.sampler
        n = len(sampler) if hasattr(sampler, "__len__") else None  # e.g. this rank's shard
        return _from_loader(data, chunk_size), n, None
    if isinstance(data, TorchDataset) and hasattr(data, "__len__"):
        if len(data) == 0:  # type: ignore[arg-type]
            raise BatchboundError("the data set is empty: 0 examples")
        loader = DataLoader(data, batch_size=chunk_size, shuffle=False)
        return _from_loader(loader, chunk_size), len(data), None  # type: ignore[arg-type]
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], Mapping):
        raise BatchboundError(
            f"data as a {type(data).__name__} of dicts: give DataLoader(data, batch_size=...) "
            "(a list of examples) or one dict of batched tensors")
    raise BatchboundError(
        "data must be a batchbound Dataset, a torch Dataset, a DataLoader, an (x, y) pair of "
        f"tensors or a dict batch {{'input_ids': ..., 'labels': ...}}; got {type(data).__name__}"
    )


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(iter(trainable_parameters(model).values())).dtype


@contextmanager
def measuring(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[nn.Module]:
    """The model to measure: a ``dtype`` copy when that differs from the model's (the user's
    model is never converted), switched to eval mode; every module's mode is restored after."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise BatchboundError(f"dtype must be a floating torch dtype, got {dtype!r}")
    work = model
    if dtype is not None and dtype != _model_dtype(model):
        _no_parameter_hooks(model, dtype)
        try:
            work = copy.deepcopy(model).to(dtype)
        except Exception as exc:  # any: the user's model, named in one line
            raise BatchboundError(
                f"dtype={dtype} measures a copy of the model, and copy.deepcopy cannot copy "
                f"this one ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                "); measure it in its own dtype, or convert it yourself") from exc
    with eval_mode(work):
        yield work


def _no_parameter_hooks(model: nn.Module, dtype: torch.dtype) -> None:
    """A dtype copy does not carry hooks registered on the parameter tensors (``p.register_hook``
    changes what the gradient is), so it would measure another model: refused."""
    hooked = [name for name, p in model.named_parameters()
              if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks",
                                                                  None)]
    if hooked:
        raise BatchboundError(
            f"dtype={dtype} measures a copy of the model, and a copy drops the tensor hooks on "
            f"its parameters ({', '.join(hooked)}); measure the model in its own dtype, or "
            "convert it yourself with the hooks registered again")


def check_copy_alone(model: nn.Module, work: nn.Module, x: Any, y: Any,
                     loss_fn: PerExampleLoss) -> None:
    """A ``dtype`` copy (``measuring``) whose forward or loss, run on a chunk, reaches the
    model's own parameters (a closure over the model in the loss, or in a hook the copy
    carries over) would leave their part of the gradient out of the copy's: refused. Read off
    the autograd graph of one forward of ``x`` (a few examples of the first chunk); nothing
    when ``work`` is the model itself."""
    if work is model:
        return
    own = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    device, dtype = _device_dtype(work)
    x, y = _on_device(x[:2], y[:2], device, dtype)
    try:
        with torch.enable_grad():
            losses = loss_fn(call_model(work, x), y)
    except Exception:  # any: a model or loss that fails is named by the run itself, in its words
        return
    if not isinstance(losses, Tensor) or losses.grad_fn is None:
        return  # so is a loss of the wrong kind
    nodes, _ = walk([losses.grad_fn])
    reached = sorted({own[id(node.variable)] for node in nodes
                      if is_accumulator(node) and id(node.variable) in own})
    if reached:
        raise BatchboundError(
            f"dtype={dtype} measures a copy of the model, and the loss or the forward reaches "
            f"the model's own parameters outside the copy ({', '.join(reached)}: a closure "
            "over the model in the loss or in a hook?), whose part of the gradient the copy's "
            "would leave out; measure the model in its own dtype, or convert it yourself")


def measure(
    model: nn.Module,
    data: Data,
    loss: str | PerExampleLoss | None = None,
    *,
    chunk_size: int = 256,
    engine: str = "auto",
    dtype: torch.dtype | None = None,
    progress: bool = False,
    memory_budget: int | None = None,
) -> DiversityReport:
    """Exact gradient diversity of ``model`` over all of ``data``.

    ``data``: a batchbound Dataset (its train split), a torch Dataset of (x, y) pairs, a
    DataLoader yielding (x, y) batches, or an (x, y) pair of tensors; or, Hugging Face's
    way, a DataLoader (or torch Dataset) of dicts ``{"input_ids": ..., "labels": ...}``, or
    one such dict of batched tensors as all the data: the model is called as
    ``model(**batch)`` and ``loss(outputs, batch)`` must be a callable (the batch split by
    example along the first dimension of each of its tensors, ``calls.dict_batch``).
    ``loss``: a name (``"cross_entropy"``, ``"mse"``), a callable returning one loss per
    example, or None for the data set's task default.
    ``engine``: ``"auto"``, ``"hooks"``, ``"vmap"`` or ``"loop"``
    (see ``per_example_stats``). ``dtype=torch.float64`` measures a float64 copy of the model;
    the user's model is never converted. Computation runs where the model's parameters are,
    on ``batchbound.kernels.threads()`` torch threads (the caller's count is put back).

    ``chunk_size``: the most examples per chunk (one forward and backward each).
    ``memory_budget``: bytes the work may take; the chunk is then made smaller where needed,
    from measure's own pass measured on the data's first examples at a few sizes (the
    device's allocations at their peak: diversity/budget.py); the report's
    ``extra["chunk_size"]`` says which chunk was used.

    Under torch.distributed each rank passes its own shard; every rank gets the global report.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise BatchboundError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if engine not in ENGINES:
        raise BatchboundError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if memory_budget is not None:
        memory_budget = check_budget(memory_budget)
    params = trainable_parameters(model)  # raises for a model with nothing to measure
    chunks, n_known, task = data_chunks(data, chunk_size)
    loss_fn = resolve_loss(loss, task)
    named = not callable(loss)

    start = time.perf_counter()
    # one thread (or $BATCHBOUND_THREADS): S and T's last bits do not follow the cores
    with kernels.computing_threads(), heap_frozen(), measuring(model, dtype) as work:
        if work is not model:  # a float64 copy
            params = trainable_parameters(work)
            chunk = _first_chunk(data, chunk_size, named)
            if chunk is not None:
                check_copy_alone(model, work, *chunk, loss_fn)
        if memory_budget is not None:
            chunk_size, width = _budget_chunk(work, data, loss_fn, engine, memory_budget,
                                              chunk_size, copied=work is not model)
            chunks, n_known, _ = data_chunks(data, chunk_size)
            chunks = _within_fit(chunks, width, memory_budget)
        with raised_by_user_code(lambda: f"measure() read the data in chunks of {chunk_size} "
                                 "and ran the model on them in eval mode, whatever the mode it "
                                 "was in (per_example_stats and watch run it in its own)"):
            totals = _accumulate(work, _tensor_targets(chunks) if named else chunks, n_known,
                                 loss_fn, engine, progress)
    dtype = next(iter(params.values())).dtype
    extra: dict[str, object] = {"loss_name": loss_name(loss_fn), "fallback_parameters": [],
                                "chunk_size": chunk_size}
    count, loss_sum, per_param, grad_sum, fallback, seen = totals
    used = lowest(dtype, seen)  # autocast or casts in the forward: below the parameters'
    if fallback or engine in ("loop", "vmap"):  # run under autocast without the observing
        used = lowest(used, *autocast_dtypes())  # dispatch mode: may round unseen inside
    if used in LOW_PRECISION:
        extra["precision"] = statement(used, dtype)
        warn(f"batchbound: {statement(used, dtype)}; dtype=torch.float64 measures a "
             "float64 copy (outside autocast)")
    names = list(params)
    reduced = all_reduce_sum([count, loss_sum, *per_param, *grad_sum])
    n = round(float(reduced[0]))
    if n == 0:
        raise BatchboundError("the data are empty: 0 examples")
    per_param_S = dict(zip(names, map(float, reduced[2 : 2 + len(names)]), strict=True))
    sums = reduced[2 + len(names) :]  # float64, or one float32 block (see _accumulate)
    T = float(torch.stack(torch._foreach_norm(sums, 2, dtype=torch.float64)).square().sum())
    if not math.isfinite(T):  # each example's gradient is finite (_end_block)
        raise BatchboundError(f"the gradient summed over the examples is not finite ({T}): "
                              "their sum overflowed; dtype=torch.float64 measures a float64 "
                              "copy")
    return DiversityReport(
        n=n,
        S=float(sum(per_param_S.values())),
        T=T,
        per_parameter_S=per_param_S,
        loss=float(reduced[1]) / n,
        seconds=time.perf_counter() - start,
        engine=engine,
        dtype=str(used).removeprefix("torch."),
        world_size=world_size(),
        extra={**extra, "fallback_parameters": fallback},
    )


def _first_chunk(data: Data, chunk_size: int, named: bool) -> tuple[Any, Any] | None:
    """The data's first chunk, or None where reading it fails (the run says why)."""
    first, _, _ = data_chunks(data, chunk_size)
    try:
        return next(_tensor_targets(first) if named else first)
    except Exception:  # any: the user's data, named by the run in its own words
        return None


def _tensor_targets(chunks: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
    """The chunks, refusing a dict batch: a named loss reads a tensor of targets."""
    for x, y in chunks:
        if isinstance(y, Inputs):
            raise BatchboundError(
                "a batch given as a dict (model(**batch)) needs the loss as a callable "
                "(outputs, batch) -> one loss per example, e.g. from outputs.logits and "
                "batch['labels']; a named loss reads a tensor of targets")
        yield x, y


def _budget_chunk(work: nn.Module, data: Data, loss_fn: PerExampleLoss, engine: str,
                  budget: int, most: int, copied: bool) -> tuple[int, float]:
    """The chunk ``memory_budget`` allows, from measure's own pass measured on the data's
    first chunk (diversity/budget.py), beside what the run holds throughout: the running
    sums, a ``dtype`` copy of the model (``copied``) and a batch the data's loader made (all
    of it, while its chunks run); and the numbers an example held in that first chunk."""
    first, _, _ = data_chunks(data, most)
    x, y = next(first)  # moved to the device inside each pass, as _accumulate's chunks are
    device, dtype = _device_dtype(work)
    stats_of = PreparedStats(work, loss_fn, engine)
    block = _zeros_like_each(stats_of.params)  # as _accumulate's: the rules add into it
    kept = kept_bytes(stats_of.params)
    if copied:
        kept += _storage_bytes([*work.parameters(), *work.buffers()], device)
    if isinstance(data, (DataLoader, TorchDataset)):  # a batch made for this run
        kept += _storage_bytes([*_tensors_of(x), *_tensors_of(y)], device)

    def run(k: int) -> None:
        # as in the run: a block's earlier chunks' losses, held to its end
        held = [torch.empty(k, dtype=dtype, device=device) for _ in range(BLOCK - 1)]
        stats_of(*_on_device(x[:k], y[:k], device, dtype), into=block)
        del held

    return chunk_for_budget(run, x.shape[0], device, kept, budget, most), _example_size(x)


def _tensors_of(v: Tensor | Inputs) -> list[Tensor]:
    """The tensors of a chunk's inputs or targets."""
    values = flatten([v.args, v.kwargs]) if isinstance(v, Inputs) else [v]
    return [t for t in values if isinstance(t, Tensor)]


def _example_size(x: Tensor | Inputs) -> float:
    """Numbers per example in a chunk's inputs (a padded sequence's grow with its length)."""
    return sum(t.numel() for t in _tensors_of(x)) / max(x.shape[0], 1)


def _within_fit(chunks: Iterator[tuple[Any, Any]], width: float, budget: int
                ) -> Iterator[tuple[Any, Any]]:
    """The chunks, with a warning (once) at the first whose examples hold more numbers than
    those the budget's chunk was fitted on: longer padded sequences take more memory."""
    warned = False
    for x, y in chunks:
        if not warned and _example_size(x) > width:
            warn(
                f"batchbound: memory_budget {size(budget)}: a chunk holds longer examples "
                f"({_example_size(x):.0f} input numbers each) than the first chunk the chunk "
                f"size was fitted on ({width:.0f}); its peak can exceed the budget (sort or "
                "pad the data to its longest first to fit on that)")
            warned = True
        yield x, y


def _storage_bytes(tensors: list[Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages under ``tensors`` on ``device``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t.device == device}
    return sum(storages.values())


def _on_device(x: Any, y: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """A chunk on the model's device, its floating tensors in the model's dtype."""
    x = x.to(device, dtype) if isinstance(x, Inputs) else x.to(
        device=device, dtype=dtype if x.dtype.is_floating_point else None)
    y = y.to(device, dtype) if isinstance(y, Inputs) else y.to(
        device=device, dtype=dtype if y.dtype.is_floating_point else None)
    return x, y


def _device_dtype(work: nn.Module) -> tuple[torch.device, torch.dtype]:
    first = next(iter(trainable_parameters(work).values()))
    return first.device, first.dtype


def _accumulate(
    work: nn.Module,
    chunks: Iterator[tuple[Tensor, Tensor]],
    n_known: int | None,
    loss_fn: PerExampleLoss,
    engine: str,
    progress: bool,
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[str], torch.dtype | None]:
    """Sums over this rank's chunks, in float64 on the model's device: (n, Σ loss, per-parameter
    S, per-parameter Σg), and the parameters an exact fallback handled.

    The gradient sum is gathered in the model's own dtype (float32 for float16 and bfloat16)
    over blocks of ``BLOCK`` chunks
    (no less precise than one chunk of that many examples) and each block is added into
    float64: converting every chunk's gradient to float64 cost 5 % of a forward+backward.
    Each chunk's sum is added into the block by the chunk itself (``PreparedStats``'s
    ``into``): a layer rule that computes the batch weight gradient adds it in its matrix
    kernel (``addmm_``), autograd's are added in one multi-tensor addition. The float64
    totals are made at the second block: with one block (up to ``BLOCK`` chunks) the block
    itself is returned, and T is normed from it in float64 (``_foreach_norm``), which equals
    converting it first."""
    from tqdm.auto import tqdm

    stats_of = PreparedStats(work, loss_fn, engine)
    stats_of.finite = finite = DeferredFinite()  # read once a block, not once a chunk
    params = stats_of.params
    first = next(iter(params.values()))
    device, acc = first.device, torch.float64
    dtype = first.dtype
    per_param = torch.zeros(len(params), dtype=acc, device=device)
    grad_sum: list[Tensor] | None = None
    block = _zeros_like_each(params)
    loss_sum = torch.zeros((), dtype=acc, device=device)
    seen, fallback, chunks_in_block = 0, set(), 0
    # the block's chunks, added up at its end (an operation is a kernel launch on a GPU, where
    # a small chunk's pass is bound by launches): offset and S per parameter, losses
    held: list[tuple[int, Tensor]] = []
    losses: list[Tensor] = []
    names = list(params)
    shown = progress and sys.stderr.isatty()  # a bar that erases itself says nothing to a log
    with tqdm(total=n_known, unit="ex", file=sys.stderr, disable=not shown, leave=False) as bar:
        for x, y in chunks:
            x, y = _on_device(x, y, device, dtype)
            if chunks_in_block == BLOCK:  # full, and more to come: into float64
                _end_block(per_param, loss_sum, held, losses, finite, names)
                grad_sum, chunks_in_block = _flush(grad_sum, list(block.values())), 0
            stats = stats_of(x, y, offset=seen, into=block)
            # reduced now: held whole, the per-example norms fragment the heap (page faults)
            held.append((seen, torch.stack([stats.sq_norms[k] for k in names]).sum(
                dim=1, dtype=torch.float64)))
            losses.append(stats.losses)
            chunks_in_block += 1
            seen += stats.n
            fallback.update(stats.fallback)
            bar.update(stats.n)
    _end_block(per_param, loss_sum, held, losses, finite, names)
    grad_sum = _flush(grad_sum, list(block.values()), last=True)
    count = torch.tensor(float(seen), dtype=acc, device=device)
    return (count, loss_sum, list(per_param.unbind()), grad_sum, sorted(fallback),
            stats_of.precision)


BLOCK = 16


def check_finite_sums(S: float, T: float) -> None:
    """S and T of a pass that holds no chunk's own (differential, materialised gradients):
    not finite from finite losses (``_end_block`` for what measure names)."""
    if not (math.isfinite(S) and math.isfinite(T)):
        raise BatchboundError(
            f"S = {S} and T = {T} are not finite though the losses are: the backward pass "
            "made an inf or a nan in a per-example gradient (a square root or a logarithm at "
            "0, a division by zero, an overflow); measure() names the chunk and parameters")


def _end_block(per_param: Tensor, loss_sum: Tensor, held: list[tuple[int, Tensor]],
               losses: list[Tensor], finite: DeferredFinite, names: list[str]) -> None:
    """A block's chunks added to the float64 sums and cleared, read on the host once: their
    losses checked finite and summed; their S per parameter summed, and S checked finite:
    a backward that makes an inf or a nan from finite losses (a square root or a logarithm
    at 0, a division by zero, an overflow) is refused, naming the chunk and the parameters,
    not summed into S = nan."""
    finite.check()
    if not held:
        return
    loss_sum += torch.cat(losses).sum(dtype=loss_sum.dtype)
    sums = torch.stack([chunk for _, chunk in held])
    per_param += sums.sum(dim=0)
    offsets = [offset for offset, _ in held]
    held.clear()
    losses.clear()
    if bool(torch.isfinite(per_param).all()):
        return
    for offset, row in zip(offsets, sums, strict=True):
        bad = (~torch.isfinite(row)).nonzero()[:, 0].tolist()
        if bad:
            raise BatchboundError(
                f"on the chunk from example {offset}, the gradient of an example is not "
                f"finite, or its square exceeds its dtype's range, though the losses are "
                f"finite (in {', '.join(names[k] for k in bad)}): the backward pass made an "
                "inf or a nan (a square root or a logarithm at 0, a division by zero, an "
                "overflow), so per-example gradients, S, T and Δ are not defined there")
    raise BatchboundError("S, the per-example gradients' squared norms summed, is not finite "
                          "though each chunk's is (an overflow of their sum)")


def _zeros_like_each(params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """A zero running sum per parameter (its shape, ``norm_dtype``), each its own tensor: one
    buffer for them all is a single allocation the size of the model, which glibc maps
    afresh on every call (above its mmap threshold) and the first chunk then faults in page
    by page: 500–900 of the 1 300–2 300 page faults a call of benchmarks/diversity.py's MLP
    (which counts them; one fill per parameter instead of one is a few operations a call)."""
    return {name: torch.zeros(p.shape, dtype=norm_dtype(p.dtype), device=p.device)
            for name, p in params.items()}


def _flush(totals: list[Tensor] | None, block: list[Tensor], last: bool = False
           ) -> list[Tensor]:
    """The totals with ``block`` added, and the block zeroed for the next chunks: the block
    itself when it is the only one and the last, float64 from the second on (one
    multi-tensor op, not one per parameter)."""
    if totals is None and last:
        return block
    if totals is None:
        totals = [t.to(torch.float64, copy=True) for t in block]
    else:
        torch._foreach_add_(totals, block)
    if not last:
        torch._foreach_zero_(block)
    return totals
