"""Per-example statistics of one chunk: the unit every engine produces and ``measure`` sums.

For a chunk of n examples with per-example gradients g_i (f_i is the per-example loss):

- ``losses``: f_i, shape (n,);
- ``sq_norms[name]``: ‖g_i restricted to parameter ``name``‖², shape (n,);
- ``grad_sum[name]``: Σ_i g_i restricted to ``name``, the parameter's shape.

S = Σ_i ``total_sq_norms`` and T = ‖``grad_sum``‖² over all parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from batchbound.errors import BatchboundError

ENGINES = ("auto", "hooks", "vmap", "loop")


@dataclass
class PerExampleStats:
    losses: Tensor
    sq_norms: dict[str, Tensor]
    grad_sum: dict[str, Tensor]
    fallback: tuple[str, ...] = ()  # parameters whose norms the vmap fallback computed

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


class PreparedStats:
    """``per_example_stats`` for one model called many times (a training loop, ``measure``'s
    chunks): the checks over the model and the hooks engine's plan of which module computes
    which parameter's norms are made once, here, instead of on every call.

    The model's structure (its modules and which parameters train) must stay as it was when
    this was made; its weights and its train/eval mode may change (BatchNorm's mode is
    checked on every call).
    """

    def __init__(self, model: nn.Module, loss: object = None, engine: str = "auto") -> None:
        from batchbound.diversity.hooks import plan_hooks
        from batchbound.diversity.losses import resolve_loss

        if engine not in ENGINES:
            raise BatchboundError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
        self.model, self.engine = model, engine
        self.loss_fn = resolve_loss(loss)  # type: ignore[arg-type]
        self.params = trainable_parameters(model)
        self.batch_norms = batch_norm_modules(model)
        self.plan = plan_hooks(model, self.params) if engine in ("auto", "hooks") else None

    def __call__(self, x: Tensor, y: Tensor, offset: int = 0) -> PerExampleStats:
        from batchbound.diversity.engines import loop_stats, vmap_stats
        from batchbound.diversity.hooks import hooks_stats

        check_chunk(x, y)
        check_model_mode(self.model, self.batch_norms)
        with torch.enable_grad():  # also when called under torch.no_grad()
            if self.engine == "loop":
                return loop_stats(self.model, x, y, self.loss_fn, offset=offset)
            if self.engine == "vmap":
                return vmap_stats(self.model, x, y, self.loss_fn, offset=offset)
            assert self.plan is not None
            return hooks_stats(self.model, x, y, self.loss_fn, self.plan, self.params,
                               strict=self.engine == "hooks", offset=offset)


def per_example_stats(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: object = None,
    *,
    engine: str = "auto",
    offset: int = 0,
) -> PerExampleStats:
    """Per-example losses, squared gradient norms per parameter, and the gradient sum, for one
    chunk, from one forward and one backward pass (``engine="hooks"``/``"auto"``).

    ``loss`` is a name (``"cross_entropy"``, ``"mse"``) or a callable returning one loss per
    example (see ``resolve_loss``). The model is used in its current mode (BatchNorm must be
    in eval mode; dropout in train mode gives the gradients under the masks drawn in this
    pass, except for parameters left to the vmap fallback, which draws its own), and its
    ``.grad`` fields are left untouched. ``offset`` is the index of the chunk's first example,
    used to name an example whose loss is not finite. For many calls on one model,
    ``PreparedStats`` skips the per-call checks and planning.

    Engines: ``"hooks"`` (per-layer rules; BatchboundError on a parameter no rule covers),
    ``"auto"`` (hooks, with torch.func vmap for uncovered parameters and a warning naming
    their modules), ``"vmap"`` (torch.func for everything), ``"loop"`` (one backward per
    example: the slow reference).
    """
    return PreparedStats(model, loss, engine)(x, y, offset)


def per_example_gradients(
    model: nn.Module, x: Tensor, y: Tensor, loss: object = None
) -> dict[str, Tensor]:
    """Materialised per-example gradients, name -> (n, *param.shape), via torch.func.vmap.

    Memory is n × (number of parameters): use it on chunks (mechanisms, Monte Carlo checks).
    """
    from batchbound.diversity.engines import vmap_gradients
    from batchbound.diversity.losses import resolve_loss

    loss_fn = resolve_loss(loss)  # type: ignore[arg-type]
    check_chunk(x, y)
    params = trainable_parameters(model)
    check_model_mode(model)
    with torch.enable_grad():
        return vmap_gradients(model, x, y, loss_fn, list(params))


def per_example_l1_l2(
    model: nn.Module, x: Tensor, y: Tensor, loss: object = None
) -> tuple[Tensor, Tensor]:
    """(‖g_i‖₁, ‖g_i‖₂) over all parameters, each shape (n,); from materialised gradients.

    Stochastic quantization's diversity needs R = Σ_i ‖g_i‖₂‖g_i‖₁.
    """
    grads = per_example_gradients(model, x, y, loss)
    n = x.shape[0]
    l1 = sum(g.reshape(n, -1).abs().sum(dim=1) for g in grads.values())
    sq = sum(g.reshape(n, -1).square().sum(dim=1) for g in grads.values())
    return l1, sq.sqrt()  # type: ignore[union-attr]
