"""The AMP loss scale a step's gradients carry (``torch.amp.GradScaler`` multiplies the loss
by it): read where the gradients are measured and divided out, so that steps taken at
different scales fold together (``watch``, the callbacks, ``gns_hook``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from batchbound.errors import BatchboundError


def check_loss_scale(scaler: Any) -> None:
    """None, a positive number, or something with a GradScaler's ``scale``/``is_enabled``."""
    if scaler is None:
        return
    if isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
        if not math.isfinite(scaler) or scaler <= 0:
            raise BatchboundError(f"loss_scale must be a positive number, got {scaler!r}")
        return
    if not hasattr(scaler, "scale") or not hasattr(scaler, "is_enabled"):
        raise BatchboundError(f"loss_scale must be a number or a torch.amp.GradScaler, got "
                              f"{type(scaler).__name__}")


def loss_scale_of(scaler: Any, device: torch.device) -> float | Tensor:
    """The AMP loss scale now, as a tensor on ``device`` (no host sync), or 1.0 without an
    enabled GradScaler. Read it before ``scaler.update()``: that is the scale the gradients
    of this step carry."""
    check_loss_scale(scaler)
    if scaler is None:
        return 1.0
    if isinstance(scaler, (int, float)):
        return float(scaler)
    if not scaler.is_enabled():
        return 1.0
    return scaler.scale(torch.ones((), device=device, dtype=torch.float32)).double()
