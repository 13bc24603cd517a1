"""Shape tables at a fixed parameter budget: the width/depth grids [width]'s sweeps train.

``family_sweep`` returns one ``ShapeRow`` per depth, each with a concrete spec (no budget
left to solve), the count the budget is compared with, and the relative error. A family is
sweepable when it registers how (``register_family(name, sweep=...)``):

- ``layers`` (fc, linear): depth = hidden layers L, width K from [width]'s solver
  d_in·K + (L−1)·K² + K·d_out = p (biases too with ``count_biases``).
- ``head`` (lenet, resnet): the convolutional trunk stays as ``options`` fix it and the fully
  connected head varies ([width]'s Fig. 3e/3f): depth = hidden head layers L, width = their
  common width K, the integer whose *total* parameter count is closest to p.
- ``solved`` (cnn1d): the family takes depth and params and solves its width for the total.

``block_sweep`` is the other ResNet sweep ([width]'s Fig. 3g/3h): the head stays fixed, the
blocks per chunk change, and the filter count is solved for the budget.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.fc import budget_count, solve_width
from batchbound.models.options import (
    MAX_LAYERS,
    closest_integer,
    int_list,
    meta_parameter_count,
    parameter_budget,
)
from batchbound.models.registry import (
    build_model,
    count_parameters,
    family_names,
    get_family,
    sweep_kind,
    sweepable_families,
)
from batchbound.spec import Spec

# the options each kind of sweep sets itself
SWEPT_OPTIONS = {"layers": {"depth", "width", "params", "count_biases"},
                 "head": {"params", "head"},
                 "solved": {"depth", "width", "params", "count_biases"}}


@dataclass(frozen=True)
class ShapeRow:
    """One network of a sweep. ``params`` is the count the budget is compared with (weights
    only for fc/linear unless biases are counted; everything otherwise); ``total_params``
    counts every trainable parameter of the built model."""

    depth: int
    width: int | float | None
    params: int
    total_params: int
    budget: int
    spec: str

    @property
    def relative_error(self) -> float:
        return (self.params - self.budget) / self.budget

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "relative_error": self.relative_error}


def _total(spec: Spec, input_shape: Sequence[int], num_outputs: int) -> int:
    return meta_parameter_count(lambda: build_model(spec, input_shape, num_outputs))


def _skeleton(spec: Spec, input_shape: Sequence[int], num_outputs: int) -> nn.Module:
    """The model a spec builds, on the meta device: shapes and counts without the memory."""
    with torch.device("meta"):
        return build_model(spec, input_shape, num_outputs)


def family_sweep(
    family: str,
    params: int,
    depths: Iterable[int],
    input_shape: Sequence[int],
    num_outputs: int,
    *,
    options: dict[str, Any] | None = None,
    count_biases: bool = False,
) -> list[ShapeRow]:
    """One row per depth: the width that meets ``params`` and the concrete spec."""
    kind = sweep_kind(family)  # an unknown name gets the registry's error with the full list
    if kind is None:
        raise BatchboundError(f"no depth sweep for family {family!r}; sweeps exist for "
                              f"{', '.join(sweepable_families())}")
    budget = parameter_budget(family, params)
    if count_biases and not _has_option(family, "count_biases"):
        takers = [name for name in family_names() if _has_option(name, "count_biases")]
        raise BatchboundError(
            f"count_biases applies to {', '.join(takers)} only: {family} budgets "
            + ("count weights, and it has no biases" if kind == "layers"
               else "count every parameter"))
    depth_list = int_list(family, "depths", list(depths), minimum=0, maximum=MAX_LAYERS)
    options = dict(options or {})
    clash = sorted(SWEPT_OPTIONS[kind] & set(options))
    if clash:
        raise BatchboundError(
            f"{family} sweep: {', '.join(clash)} are set by the sweep, not by options"
        )
    row = {"layers": _layers_row, "head": _head_row, "solved": _solved_row}[kind]
    return [row(family, budget, depth, input_shape, num_outputs, options, count_biases)
            for depth in depth_list]


def _has_option(family: str, option: str) -> bool:
    return option in inspect.signature(get_family(family)).parameters


def _solved_row(
    family: str,
    budget: int,
    depth: int,
    input_shape: Sequence[int],
    num_outputs: int,
    options: dict[str, Any],
    count_biases: bool,
) -> ShapeRow:
    model = _skeleton(Spec(family, {**options, "depth": depth, "params": budget}),
                      input_shape, num_outputs)
    shape = model.batchbound_shape
    total = count_parameters(model)
    return ShapeRow(depth, shape.width, total, total, budget, shape.resolved)


def _layers_row(
    family: str,
    budget: int,
    depth: int,
    input_shape: Sequence[int],
    num_outputs: int,
    options: dict[str, Any],
    count_biases: bool,
) -> ShapeRow:
    d_in = math.prod(input_shape)
    with_biases = count_biases and options.get("bias", True) is True
    width = solve_width(budget, d_in, depth, num_outputs, with_biases) if depth else 0
    spec = Spec(family, {"depth": depth, **({"width": width} if depth else {}), **options})
    model = _skeleton(spec, input_shape, num_outputs)  # validates the options too
    counted = budget_count(d_in, width, depth, num_outputs, with_biases)
    return ShapeRow(depth, width or None, counted, count_parameters(model), budget,
                    model.batchbound_shape.resolved)


def _head_row(
    family: str,
    budget: int,
    depth: int,
    input_shape: Sequence[int],
    num_outputs: int,
    options: dict[str, Any],
    count_biases: bool,
) -> ShapeRow:
    def spec(width: int) -> Spec:
        return Spec(family, {**options, "head": [width] * depth})

    width = closest_integer(lambda k: _total(spec(k), input_shape, num_outputs), budget) \
        if depth else 0
    model = _skeleton(spec(width), input_shape, num_outputs)
    total = count_parameters(model)
    return ShapeRow(depth, width or None, total, total, budget, model.batchbound_shape.resolved)


def block_sweep(
    params: int,
    block_configs: Iterable[Sequence[int]],
    input_shape: Sequence[int],
    num_outputs: int,
    *,
    options: dict[str, Any] | None = None,
) -> list[ShapeRow]:
    """ResNets with the given blocks per chunk, each with the filter count that meets
    ``params``; depth is the main-path weight layers (18 for [2,2,2,2])."""
    budget = parameter_budget("resnet", params)
    options = dict(options or {})
    clash = sorted({"blocks", "width", "params"} & set(options))
    if clash:
        raise BatchboundError(f"resnet block sweep: {', '.join(clash)} are set by the sweep")
    rows = []
    for blocks in block_configs:
        model = _skeleton(Spec("resnet", {**options, "blocks": list(blocks), "params": budget}),
                          input_shape, num_outputs)
        shape = model.batchbound_shape
        total = count_parameters(model)
        rows.append(ShapeRow(shape.depth, shape.width, total, total, budget, shape.resolved))
    return rows


def parse_depths(text: str) -> list[int]:
    """``"1-10"``, ``"1,2,4,8"`` or ``"0-3,6"`` → a list of depths."""
    depths: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                first, last = (int(x) for x in part.split("-"))
                if last < first:
                    raise ValueError
            else:
                first = last = int(part)
        except ValueError:
            raise BatchboundError(
                f"bad depths {text!r}: give a range like 1-10 or a list like 1,2,4,8"
            ) from None
        if last > MAX_LAYERS:  # before the list: 1-100000000 is never built
            raise BatchboundError(f"bad depths {text!r}: a depth is at most {MAX_LAYERS:,}")
        depths.extend(range(first, last + 1))
    return depths
