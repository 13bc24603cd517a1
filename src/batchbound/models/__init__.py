"""batchbound.models: model families addressed by spec strings.

>>> from batchbound.models import build_model
>>> model = build_model("fc(depth=3,params=16000)", input_shape=(64,), num_outputs=10, seed=0)

Families: fc, linear, lenet, resnet, vgg, mobilenetv2, alexnet, cnn1d, and for text gpt and
lstm. Each module below registers its family when imported; they are all imported here, in
one place.
"""

from batchbound.models import (  # registers
    alexnet,
    cnn1d,
    fc,
    gpt,
    lenet,
    lstm,
    mobilenet,
    resnet,
    vgg,
)
from batchbound.models.describe import LayerRow, ModelDescription, describe_model, model_shape
from batchbound.models.fc import budget_count, solve_width, weight_count
from batchbound.models.layers import ModelShape
from batchbound.models.registry import (
    budget_counts_weights_only,
    build_model,
    check_fits,
    count_parameters,
    family_names,
    get_family,
    register_family,
    sweepable_families,
)
from batchbound.models.sweep import ShapeRow, block_sweep, family_sweep, parse_depths

__all__ = [
    "LayerRow",
    "ModelDescription",
    "ModelShape",
    "ShapeRow",
    "alexnet",
    "block_sweep",
    "budget_count",
    "budget_counts_weights_only",
    "build_model",
    "check_fits",
    "cnn1d",
    "count_parameters",
    "describe_model",
    "family_names",
    "family_sweep",
    "fc",
    "get_family",
    "gpt",
    "lenet",
    "lstm",
    "mobilenet",
    "model_shape",
    "parse_depths",
    "register_family",
    "resnet",
    "solve_width",
    "sweepable_families",
    "vgg",
    "weight_count",
]
