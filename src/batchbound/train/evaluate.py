"""Loss and accuracy over a whole split, in chunks, each rank on its share, all-reduced."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchbound.diversity.losses import PerExampleLoss
from batchbound.train.distributed import DistContext, all_reduce_sum


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: PerExampleLoss,
    ctx: DistContext,
    chunk_size: int,
    classification: bool,
) -> dict[str, float]:
    """Mean loss (and accuracy for classification) over (x, y).

    Rank r evaluates examples r, r+P, r+2P, ...; the sums are all-reduced, so every rank
    returns the same numbers. Returns ``{"loss": ..., "acc": ...}`` (acc only when classifying).
    """
    was_training = model.training
    model.eval()
    mine = torch.arange(ctx.rank, x.shape[0], ctx.world_size, device=x.device)
    sums = torch.zeros(3, dtype=torch.float64, device=x.device)  # loss, correct, count
    for start in range(0, len(mine), chunk_size):
        idx = mine[start : start + chunk_size]
        outputs = model(x[idx])
        sums[0] += loss_fn(outputs, y[idx]).double().sum()
        if classification:
            sums[1] += (outputs.argmax(dim=1) == y[idx]).sum()
        sums[2] += len(idx)
    all_reduce_sum(sums)
    model.train(was_training)
    count = float(sums[2])
    loss = float(sums[0]) / count if count else math.nan
    out = {"loss": loss}
    if classification:
        out["acc"] = float(sums[1]) / count if count else math.nan
    return out
