"""Loss and accuracy over a whole split, in chunks, each rank on its share, all-reduced."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchbound.diversity.losses import PerExampleLoss, check_shape
from batchbound.train.distributed import DistContext, all_reduce_sum


def _is_sequence(outputs: torch.Tensor, y: torch.Tensor) -> bool:
    """Next-token prediction: (n, T, V) logits against (n, T) integer tokens."""
    return outputs.dim() == 3 and y.dim() == 2 and not y.is_floating_point()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: PerExampleLoss,
    ctx: DistContext,
    chunk_size: int,
    classification: bool,
    accuracy: bool = True,
) -> dict[str, float]:
    """Mean loss per example, and accuracy where predictions are labels, over (x, y).

    Classification: the fraction of examples whose argmax is the label. Text (a text task,
    or any (n, T, V) output against (n, T) integer targets): the fraction of tokens whose
    argmax is the next token, over all tokens, while the loss stays the mean per sequence
    (for ``sequence_cross_entropy`` the summed token loss; divide by T for per-token).
    Rank r evaluates examples r, r+P, r+2P, ...; the sums are all-reduced, so every rank
    returns the same numbers. Returns ``{"loss": ..., "acc": ...}`` (acc only when it has one:
    not for a model returning an object, e.g. a ModelOutput, that only the loss reads, nor
    where ``accuracy`` is False: targets that are not labels, advise's packed dict rows).
    """
    was_training = model.training
    model.eval()
    mine = torch.arange(ctx.rank, x.shape[0], ctx.world_size, device=x.device)
    # loss, correct predictions, examples, predictions, whether this rank saw sequences
    sums = torch.zeros(5, dtype=torch.float64, device=x.device)
    readable = accuracy  # whether the outputs are logits an accuracy can be read off
    for start in range(0, len(mine), chunk_size):
        idx = mine[start : start + chunk_size]
        outputs = model(x[idx])
        losses = loss_fn(outputs, y[idx])
        check_shape(losses, len(idx))  # a scalar would be summed as if one example
        sums[0] += losses.double().sum()
        if not isinstance(outputs, torch.Tensor):  # an output object (a ModelOutput): the
            readable = False  # user's loss reads it; no predictions to count here
        elif _is_sequence(outputs, y):
            sums[1] += (outputs.argmax(dim=-1) == y[idx]).sum()
            sums[3] += y[idx].numel()
            sums[4] = 1
        elif classification:
            sums[1] += (outputs.argmax(dim=1) == y[idx]).sum()
            sums[3] += len(idx)
        sums[2] += len(idx)
    all_reduce_sum(sums)
    model.train(was_training)
    count, predictions = float(sums[2]), float(sums[3])
    loss = float(sums[0]) / count if count else math.nan
    out = {"loss": loss}
    if readable and (classification or sums[4] > 0):
        out["acc"] = float(sums[1]) / predictions if predictions else math.nan
    return out
