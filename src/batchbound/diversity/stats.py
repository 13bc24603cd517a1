"""The data types and model checks every engine shares (the bottom of ``diversity``).

``PerExampleStats`` is the per-example statistics of one chunk: the unit every engine
produces and ``measure`` sums.

For a chunk of n examples with per-example gradients g_i (f_i is the per-example loss):

- ``losses``: f_i, shape (n,);
- ``sq_norms[name]``: ‖g_i restricted to parameter ``name``‖², shape (n,);
- ``grad_sum[name]``: Σ_i g_i restricted to ``name``, the parameter's shape.

S = Σ_i ``total_sq_norms`` and T = ‖``grad_sum``‖² over all parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge

from batchbound.errors import BatchboundError

ENGINES = ("auto", "hooks", "vmap", "loop")
LOW_PRECISION = (torch.float16, torch.bfloat16)


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """What per-example norms and sums are computed in: float32 for a float16 or bfloat16
    model (whose own gradients carry that rounding), the model's dtype otherwise."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@dataclass
class PerExampleStats:
    losses: Tensor
    sq_norms: dict[str, Tensor]
    grad_sum: dict[str, Tensor]
    fallback: tuple[str, ...] = ()  # parameters an exact fallback engine computed

    @property
    def n(self) -> int:
        return int(self.losses.shape[0])

    @property
    def total_sq_norms(self) -> Tensor:
        """‖g_i‖² over all parameters, shape (n,)."""
        return torch.stack(list(self.sq_norms.values())).sum(dim=0)

    @property
    def S(self) -> float:
        return float(self.total_sq_norms.sum())

    @property
    def T(self) -> float:
        return float(sum(g.square().sum() for g in self.grad_sum.values()))


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters with requires_grad, in ``named_parameters`` order (tied ones once)."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    lazy = [name for name, p in params.items() if isinstance(p, nn.UninitializedParameter)]
    if lazy:
        raise BatchboundError(
            f"{type(model).__name__} has lazy parameters not yet initialised ({', '.join(lazy)}): "
            "their shapes exist after the first forward pass; run the model once on a batch "
            "before measuring it")
    if not params:
        raise BatchboundError(
            f"{type(model).__name__} has no trainable parameters (none with requires_grad); "
            "gradient diversity needs at least one"
        )
    return params


def batch_norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def check_model_mode(
    model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None
) -> None:
    """Per-example gradients need examples to be independent: no batch statistics."""
    for name, module in batch_norm_modules(model) if modules is None else modules:
        if module.training or module.running_mean is None:  # type: ignore[union-attr]
            raise BatchboundError(
                f"module {name or type(module).__name__!r} ({type(module).__name__}) uses batch "
                "statistics (train mode or track_running_stats=False), so examples interact and "
                "per-example gradients do not exist; call model.eval() first (measure() does)"
            )


def check_chunk(x: Tensor, y: Tensor) -> None:
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise BatchboundError(
            f"inputs and targets must be tensors, got {type(x).__name__} and {type(y).__name__}"
        )
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise BatchboundError(
            f"inputs {tuple(x.shape)} and targets {tuple(y.shape)} must share their first "
            "(example) dimension"
        )
    if x.shape[0] == 0:
        raise BatchboundError("empty chunk: no examples")


def any_training(model: nn.Module) -> bool:
    """Whether any module of ``model`` is in train mode: ``model.modules()``'s modules, walked
    without its generators (a frame per module and level; this is asked on every chunk)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if module.training:
            return True
        for child in module._modules.values():
            if child is not None:
                stack.append(child)
    return False


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode; every module's own mode is restored afterwards. A model in
    eval mode already is left as it is (``measure`` called again and again in a loop:
    ``Module.__setattr__`` on every module twice was a tenth of a small model's call)."""
    modes = [(module, module.training) for module in model.modules()]
    if any(training for _, training in modes):
        model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            if module.training != training:
                module.training = training


def gradients(total: Tensor,
              tensors: Sequence[Tensor | GradientEdge]) -> tuple[Tensor | None, ...]:
    """∂total/∂tensors (or ∂total/∂ a node's output, for a GradientEdge) by
    ``torch.autograd.grad`` (so no ``.grad`` field is touched)."""
    try:
        return torch.autograd.grad(total, tensors, allow_unused=True)
    except RuntimeError as exc:
        if "use_reentrant" in str(exc):
            raise BatchboundError(
                "the model uses torch.utils.checkpoint with use_reentrant=True, whose backward "
                "pass can only write .grad fields, and batchbound never touches them; pass "
                "use_reentrant=False (what PyTorch recommends) to measure this model"
            ) from None
        raise
