"""What a model spec builds: its layers, output shapes, depth, width and parameter count.

``describe_model`` builds the model on the meta device (shapes without memory, so a spec of
any size can be described), runs one dummy batch through it in eval mode with forward hooks
on every leaf module to record output shapes, and reads the family's shape record (token
models get an int64 batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import ModelShape
from batchbound.models.registry import build_model, count_parameters
from batchbound.models.user import is_user_spec, untagged_shape
from batchbound.spec import Spec, parse_spec


@dataclass(frozen=True)
class LayerRow:
    name: str
    type: str
    output_shape: list[int]
    params: int


@dataclass(frozen=True)
class ModelDescription:
    """``params`` counts every trainable parameter; ``weights`` leaves out biases (the count
    [width]'s fc budget uses). ``depth``/``width`` follow the family's convention (see
    ``ModelShape``); ``weight_layers`` counts every Linear/Conv module, shortcuts included."""

    family: str
    spec: str
    resolved: str
    input_shape: list[int]
    num_outputs: int
    params: int
    weights: int
    depth: int
    width: int | float
    weight_layers: int
    layers: list[LayerRow]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """The layers as aligned text, with a summary line first."""
        lines = [
            f"{self.resolved}",
            f"input {tuple(self.input_shape)} → {self.num_outputs} outputs; depth {self.depth}, "
            f"width {self.width}, {self.params:,} parameters ({self.weights:,} without biases)",
            "",
        ]
        name_w = max([5, *(len(r.name) for r in self.layers)])
        type_w = max([4, *(len(r.type) for r in self.layers)])
        lines.append(f"{'layer':<{name_w}}  {'type':<{type_w}}  {'output':<18}  {'params':>10}")
        for r in self.layers:
            shape = "×".join(map(str, r.output_shape))
            lines.append(f"{r.name:<{name_w}}  {r.type:<{type_w}}  {shape:<18}  {r.params:>10,}")
        return "\n".join(lines)


def model_shape(model: nn.Module) -> ModelShape | None:
    """The shape record a family attached to ``model`` (or to the model a DDP/compile wrapper
    holds as ``.module``), if a family built it."""
    inner = getattr(model, "module", None)
    return getattr(model, "batchbound_shape", None) or getattr(inner, "batchbound_shape", None)


def describe_model(
    spec: str | Spec, input_shape: Sequence[int], num_outputs: int
) -> ModelDescription:
    user = is_user_spec(spec)
    parsed = None if user else parse_spec(spec) if isinstance(spec, str) else spec
    with torch.device("meta"):
        model = build_model(str(spec) if user else parsed, input_shape, num_outputs)
    shape = model_shape(model)
    if shape is None:  # a user's module, or a family that does not tag: read it off
        depth, width = untagged_shape(model)
        shape = ModelShape(family=str(spec), resolved=str(spec), depth=depth, width=width)
    rows: list[LayerRow] = []
    handles = []
    for name, module in model.named_modules():
        if name and not list(module.children()):
            def record(mod: nn.Module, inputs: Any, output: Any, name: str = name) -> None:
                if isinstance(output, (tuple, list)):  # nn.LSTM: (output, (h, c))
                    output = output[0]
                rows.append(LayerRow(
                    name, type(mod).__name__, list(output.shape[1:]),
                    sum(p.numel() for p in mod.parameters()),
                ))
            handles.append(module.register_forward_hook(record))
    model.eval()
    try:
        with torch.no_grad():
            _dummy_forward(model, input_shape, shape.tokens, user)
    finally:
        for handle in handles:
            handle.remove()
    weight_layers = sum(isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) for m in model.modules())
    return ModelDescription(
        family=shape.family,
        spec=str(spec if parsed is None else parsed),
        resolved=shape.resolved,
        input_shape=list(input_shape),
        num_outputs=num_outputs,
        params=count_parameters(model),
        weights=count_parameters(model, include_biases=False),
        depth=shape.depth,
        width=shape.width,
        weight_layers=weight_layers,
        layers=rows,
    )


def _dummy_forward(model: nn.Module, input_shape: Sequence[int], tokens: bool,
                   user: bool) -> None:
    """Two examples of zeros through ``model``: int64 token ids for token models; a user's
    model says nothing, so float features first and token ids when those fail."""
    kinds = [torch.long] if tokens else [torch.get_default_dtype()]
    if user:
        kinds = [torch.get_default_dtype(), torch.long]
    for kind in kinds:
        try:
            model(torch.zeros(2, *input_shape, device="meta", dtype=kind))
            return
        except Exception as exc:
            if kind is kinds[-1]:
                if not user:
                    raise
                raise BatchboundError(f"model {model.__class__.__name__} does not run on a "
                                      f"batch of shape {(2, *input_shape)}: {exc}") from exc
