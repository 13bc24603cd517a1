"""Per-example losses: a loss here maps (outputs, targets) to one value per example, shape (n,).

The engines sum these values themselves (the reduction is always an explicit sum), so a loss
never averages over the batch. Gradient diversity Δ = S/T is invariant to a constant factor on
the loss (both S and T scale by its square), so conventions such as ½ or a mean over outputs
do not change Δ or B; they only change S, T and M2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from batchbound.diversity.calls import batch_of
from batchbound.diversity.pairing import Joined, OpShapes, joining
from batchbound.errors import BatchboundError, NonFiniteLossError
from batchbound.spec import did_you_mean

PerExampleLoss = Callable[[Tensor, Tensor], Tensor]

LOSS_NAMES = ("cross_entropy", "mse", "sequence_cross_entropy")
_DEFAULT_FOR_TASK = {
    "classification": "cross_entropy",
    "regression": "mse",
    "text": "sequence_cross_entropy",
}


def _one_tensor(outputs: object, name: str) -> None:
    """A named loss reads the model's output as one tensor of logits or values."""
    if not isinstance(outputs, Tensor):  # nanoGPT's (logits, loss), an output object
        raise BatchboundError(
            f"loss {name!r} needs the model's output as one tensor, got "
            f"{type(outputs).__name__}; make the model's forward return the logits, or (from "
            "Python) pass a loss callable that takes them out of its output")


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """f_i = −log softmax(outputs_i)[y_i]: ``nn.CrossEntropyLoss()`` on a batch of one.

    ``outputs`` is (n, C) logits. ``targets`` is (n,) integer class indices, or (n, C) class
    probabilities of the outputs' floating dtype.
    """
    _one_tensor(outputs, "cross_entropy")
    if outputs.dim() != 2:
        raise BatchboundError(
            f"cross_entropy needs outputs of shape (n, classes), got {tuple(outputs.shape)}"
            + ("; per-token outputs (n, context, vocabulary) need loss='sequence_cross_entropy'"
               if outputs.dim() == 3 else "")
        )
    n, classes = outputs.shape
    if targets.dtype.is_floating_point:
        if tuple(targets.shape) != (n, classes):
            raise BatchboundError(
                f"cross_entropy with probability targets needs labels of shape ({n}, {classes}), "
                f"got {tuple(targets.shape)}"
            )
        return F.cross_entropy(outputs, targets.to(outputs.dtype), reduction="none")
    if tuple(targets.shape) != (n,):
        raise BatchboundError(
            f"cross_entropy needs integer class labels of shape ({n},), got "
            f"{tuple(targets.shape)}; regression targets need loss='mse'"
        )
    try:
        return F.cross_entropy(outputs, targets.long(), reduction="none")
    except (IndexError, RuntimeError) as exc:  # out-of-range labels; no data-dependent check
        raise BatchboundError(  # here, so that the loss also runs under torch.func.vmap
            f"cross_entropy: labels must be class indices in [0, {classes}): {exc}"
        ) from None


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """f_i = mean_j (outputs_ij − targets_ij)²: ``nn.MSELoss()`` on a batch of one.

    ``targets`` has the outputs' shape; (n,) targets are accepted for (n, 1) outputs.
    """
    _one_tensor(outputs, "mse")
    if outputs.dim() == 0:  # an (n,) output squeezed (``.squeeze()``) on one example
        if targets.numel() != 1:
            raise BatchboundError(f"mse needs outputs with the examples along dimension 0, got "
                                  f"a single number for targets {tuple(targets.shape)}")
        outputs = outputs.reshape(1)
    n = outputs.shape[0]
    if targets.shape != outputs.shape:
        if targets.dim() == 1 and tuple(outputs.shape) == (n, 1) and targets.shape[0] == n:
            targets = targets.unsqueeze(1)
        else:
            raise BatchboundError(
                f"mse needs targets shaped like the outputs {tuple(outputs.shape)}, got "
                f"{tuple(targets.shape)}; class labels need loss='cross_entropy'"
            )
    if not targets.dtype.is_floating_point:
        targets = targets.to(outputs.dtype)
    diff = (outputs - targets.to(outputs.dtype)).reshape(n, -1)
    return diff.square().mean(dim=1)


def sequence_cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """f_i = Σ_t −log softmax(outputs_it)[y_it]: the SUM of a sequence's token losses.

    One example is one sequence, so Σ_i f_i is the loss summed over every token, the quantity
    whose per-sequence gradients Δ is about. ``outputs`` is (n, context, vocabulary) logits,
    ``targets`` (n, context) integer next tokens. The mean token loss is this / context.
    """
    _one_tensor(outputs, "sequence_cross_entropy")
    if outputs.dim() != 3:
        raise BatchboundError(
            "sequence_cross_entropy needs outputs of shape (n, context, vocabulary), got "
            f"{tuple(outputs.shape)}"
        )
    n, steps, vocabulary = outputs.shape
    if targets.dtype.is_floating_point or tuple(targets.shape) != (n, steps):
        raise BatchboundError(
            f"sequence_cross_entropy needs integer next tokens of shape ({n}, {steps}), got "
            f"{targets.dtype} {tuple(targets.shape)}"
        )
    try:
        tokens = F.cross_entropy(
            outputs.reshape(n * steps, vocabulary), targets.long().reshape(n * steps),
            reduction="none",
        )  # fmt: skip
    except (IndexError, RuntimeError) as exc:  # out-of-range tokens (no check: vmap)
        raise BatchboundError(
            f"sequence_cross_entropy: tokens must be in [0, {vocabulary}): {exc}"
        ) from None
    return tokens.reshape(n, steps).sum(dim=1)


_BY_NAME: dict[str, PerExampleLoss] = {
    "cross_entropy": cross_entropy,
    "mse": mse,
    "sequence_cross_entropy": sequence_cross_entropy,
}


def resolve_loss(loss: str | PerExampleLoss | None, task: str | None = None) -> PerExampleLoss:
    """A per-example loss from a name, a callable, or (``loss=None``) the task's default:
    cross-entropy for ``"classification"``, MSE for ``"regression"``, the summed token
    cross-entropy of a sequence for ``"text"``.

    The result checks that it returns one finite-shaped value per example.
    """
    if loss is None:
        if task is None:
            raise BatchboundError(
                "no loss given and no task to choose one from; pass loss='cross_entropy', "
                "loss='mse', loss='sequence_cross_entropy' or a callable returning one loss "
                "per example"
            )
        if task not in _DEFAULT_FOR_TASK:
            raise BatchboundError(
                f"unknown task {task!r}; choose from {', '.join(_DEFAULT_FOR_TASK)}"
            )
        loss = _DEFAULT_FOR_TASK[task]
    if isinstance(loss, str):
        if loss not in _BY_NAME:
            raise BatchboundError(f"unknown loss {loss!r}{did_you_mean([loss], LOSS_NAMES)}; "
                                  f"choose from {', '.join(LOSS_NAMES)}")
        return _BY_NAME[loss]
    if not callable(loss):
        raise BatchboundError(f"loss must be a name or a callable, got {type(loss).__name__}")
    return _checked(loss)


def _checked(fn: PerExampleLoss) -> PerExampleLoss:
    """The loss must give a 1-D tensor (the engines check its length against the chunk's)."""

    def per_example(outputs: Tensor, targets: Tensor) -> Tensor:
        values = fn(outputs, batch_of(targets))  # a dict batch: the dict, as it came
        if not isinstance(values, Tensor) or values.dim() != 1:
            shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            n = targets.shape[0] if isinstance(targets, Tensor) and targets.dim() else "n"
            raise BatchboundError(
                f"the loss must return one value per example, shape ({n},), got {shape}; use "
                "reduction='none'"
            )
        return values

    per_example.__name__ = getattr(fn, "__name__", "custom")
    per_example.__wrapped__ = fn  # type: ignore[attr-defined]  # the user's loss, for cache keys
    return per_example


def split_gap(loss_fn: PerExampleLoss, outputs: Any, targets: Any, losses: Tensor
              ) -> float | None:
    """How far a user's loss on part of a chunk's examples is from its value on the whole
    chunk, relative to the largest loss: 0 for a loss of each example's own outputs, more
    where the examples' losses pull on each other (a supervised contrastive loss over the
    examples that share a label, wherever they sit in the chunk). The chunk is split in
    halves by each bit of the examples' positions (``bit_halves``), so any two examples
    coupled in it fall in different halves at least once. The model is not run again.
    None where the check cannot run: fewer than 4 examples, an output no pytree splits (a
    plain dataclass), or the loss failing on a part."""
    n = losses.shape[0]
    if n < 4 or not all(_splits(t) for t in tree_flatten(outputs)[0]):
        return None
    scale = float(losses.detach().abs().max()) + 1e-30
    gap = 0.0
    with torch.no_grad():
        for rows in bit_halves(n, losses.device):
            try:
                alone = loss_fn(_rows(outputs, rows, n), targets[rows])
            except Exception:  # any: the user's loss on a part it was not written for
                return None
            if not isinstance(alone, Tensor) or alone.shape != rows.shape:
                return None
            gap = max(gap, float((alone - losses.detach()[rows]).abs().max()) / scale)
    return gap


def loss_joining(loss_fn: PerExampleLoss, outputs: Any, targets: Any, n: int
                 ) -> Joined:
    """Why a user's loss may join the chunk's examples (``pairing.py``), read on the first 2
    and 3 of them: a tensor that pairs them (a mask of the examples sharing a label), or a
    quantity of the batch that flows back into them (a mean of each label's examples); none
    where it cannot run on so few. Such a loss is split on every chunk (``split_gap``), not
    on the first alone: a chunk whose labels all differ joins none."""
    if n < 3 or not all(_splits(t) for t in tree_flatten(outputs)[0]):
        return Joined()
    runs = []
    with torch.no_grad():
        for count in (2, 3):
            part, wanted = _rows(outputs, slice(count), n), targets[:count]
            recorded = OpShapes((part, wanted), count, replay_rows=True)
            try:
                with recorded:
                    loss_fn(part, wanted)
            except Exception:  # any: the user's loss on a part it was not written for
                return Joined()
            runs.append(recorded.ops)
    return joining(runs[0], runs[1], (2, 3), what="the loss")


def _rows(outputs: Any, index: Any, n: int) -> Any:
    """The model's outputs at rows ``index`` of the chunk's ``n`` examples (any pytree, a
    Hugging Face ``ModelOutput`` too); what has no dimension of n rows, whole."""
    return tree_map(lambda t: t[index] if isinstance(t, Tensor) and t.dim() and t.shape[0] == n
                    else t, outputs)


def bit_halves(n: int, device: torch.device | str = "cpu") -> list[Tensor]:
    """The positions 0..n-1 split in two by each bit of their binary index, both halves of
    each split (2·⌈log₂ n⌉ parts): any two positions fall in different parts of some split."""
    index = torch.arange(n, device=device)
    parts = []
    for bit in range(max(1, (n - 1).bit_length())):
        ones = (index >> bit) & 1 == 1
        parts += [index[ones], index[~ones]]
    return parts


def _splits(leaf: object) -> bool:
    """A leaf of a model's outputs that ``split_gap`` can split or pass whole: a tensor, a
    number, or a Hugging Face model's cache of keys and values (no loss reads it); not an
    object that may hold the examples unsplit (a dataclass no pytree knows)."""
    if leaf is None or isinstance(leaf, (Tensor, int, float, str)):
        return True
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(leaf, cache_utils.Cache)


def loss_name(loss: PerExampleLoss) -> str:
    return getattr(loss, "__name__", "custom")


def check_losses(losses: Tensor, n: int, offset: int = 0) -> None:
    """One finite loss per example of a chunk of ``n``."""
    check_shape(losses, n)
    check_finite(losses, offset)


def check_shape(losses: Any, n: int) -> None:
    """One loss per example of a batch of ``n``: a scalar (the batch's mean, as a Hugging
    Face model's ``outputs.loss``) summed by a trainer would be a gradient n times too
    small, silently."""
    if not isinstance(losses, Tensor) or tuple(losses.shape) != (n,):
        got = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise BatchboundError(
            f"the loss must return one value per example, shape ({n},), got {got}; use "
            "reduction='none' (a Hugging Face model's outputs.loss is the batch's mean: "
            "compute the loss from outputs.logits)")


def check_finite(losses: Tensor, offset: int = 0) -> None:
    """Raise naming the first example (global index ``offset + i``) whose loss is not finite."""
    losses = losses.detach()
    finite = torch.isfinite(losses)
    if not bool(finite.all()):
        index = int((~finite).nonzero()[0, 0])
        raise NonFiniteLossError(
            f"the loss of example {offset + index} is not finite ({float(losses[index])}); "
            "check the inputs and the model's outputs"
        )


class DeferredFinite:
    """Each chunk's losses held, and checked finite on the device only at ``check``, for all
    the chunks since: a host read per chunk makes the host wait for the device's work
    before it issues the next chunk, and each operation is a kernel launch (``measure``
    checks at its blocks' ends). The first example not finite is named as ``check_finite``
    names it."""

    def __init__(self) -> None:
        self._held: list[tuple[int, Tensor]] = []  # offset, losses

    def add(self, losses: Tensor, offset: int) -> None:
        self._held.append((offset, losses.detach()))

    def check(self) -> None:
        held, self._held = self._held, []
        if held and not bool(torch.isfinite(torch.cat([v for _, v in held])).all()):
            for offset, v in held:
                check_finite(v, offset)

