"""Every registered layer rule, by exact type and by dotted name, has a case here and is
exact against the float64 per-example loop under the hooks engine: a rule registered without
a case fails ``test_every_registered_rule_has_a_case``."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
from reference import assert_exact, feature_loss, feature_targets
from torch import Tensor, nn

from batchbound.diversity.rules import RULES
from batchbound.diversity.rules.norm import NanoGPTLayerNorm
from batchbound.diversity.rules.registry import NAMED_RULES


class First(nn.Module):
    """A module whose output is a tuple (recurrent layers, attention): its first element."""

    def __init__(self, layer: nn.Module, self_attention: bool = False) -> None:
        super().__init__()
        self.layer, self.self_attention = layer, self_attention

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x, x, x)[0] if self.self_attention else self.layer(x)[0]


def _named(path: str, *args: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)(*args)
        except ImportError:
            pytest.skip(f"{module} is not installed")

    return build


def _tokens() -> Tensor:
    return torch.randint(0, 11, (4, 3))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "torch.nn.modules.linear.Linear": (lambda: nn.Linear(5, 3), lambda: torch.randn(4, 2, 5)),
    "torch.nn.modules.conv.Conv1d": (lambda: nn.Conv1d(2, 3, 3, padding=1),
                                     lambda: torch.randn(4, 2, 7)),
    "torch.nn.modules.conv.Conv2d": (lambda: nn.Conv2d(2, 3, 3, stride=2),
                                     lambda: torch.randn(4, 2, 7, 7)),
    "torch.nn.modules.conv.ConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2),
                                              lambda: torch.randn(4, 2, 5)),
    "torch.nn.modules.conv.ConvTranspose2d": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2,
                                   dilation=2),
        lambda: torch.randn(4, 4, 5, 4)),
    "torch.nn.modules.sparse.Embedding": (lambda: nn.Embedding(11, 4), _tokens),
    "torch.nn.modules.sparse.EmbeddingBag": (lambda: nn.EmbeddingBag(11, 4, mode="mean"),
                                             _tokens),
    "batchbound.diversity.rules.norm.NanoGPTLayerNorm": (lambda: NanoGPTLayerNorm(5, True),
                                                         lambda: torch.randn(4, 3, 5)),
    "torch.nn.modules.normalization.LayerNorm": (lambda: nn.LayerNorm(5),
                                                 lambda: torch.randn(4, 3, 5)),
    "torch.nn.modules.normalization.RMSNorm": (lambda: nn.RMSNorm(5),
                                               lambda: torch.randn(4, 3, 5)),
    "torch.nn.modules.normalization.GroupNorm": (lambda: nn.GroupNorm(2, 4),
                                                 lambda: torch.randn(4, 4, 3)),
    "torch.nn.modules.batchnorm.BatchNorm1d": (lambda: nn.BatchNorm1d(3).eval(),
                                               lambda: torch.randn(4, 3, 5)),
    "torch.nn.modules.batchnorm.BatchNorm2d": (lambda: nn.BatchNorm2d(3).eval(),
                                               lambda: torch.randn(4, 3, 2, 2)),
    "torch.nn.modules.batchnorm.BatchNorm3d": (lambda: nn.BatchNorm3d(3).eval(),
                                               lambda: torch.randn(4, 3, 2, 2, 2)),
    "torch.nn.modules.rnn.RNN": (lambda: First(nn.RNN(3, 4, batch_first=True)),
                                 lambda: torch.randn(4, 5, 3)),
    "torch.nn.modules.rnn.LSTM": (lambda: First(nn.LSTM(3, 4, batch_first=True)),
                                  lambda: torch.randn(4, 5, 3)),
    "torch.nn.modules.rnn.GRU": (lambda: First(nn.GRU(3, 4, batch_first=True)),
                                 lambda: torch.randn(4, 5, 3)),
    "torch.nn.modules.activation.MultiheadAttention": (
        lambda: First(nn.MultiheadAttention(4, 2, batch_first=True), self_attention=True),
        lambda: torch.randn(4, 3, 4)),
    "transformers.pytorch_utils.Conv1D": (_named("transformers.pytorch_utils.Conv1D", 3, 5),
                                          lambda: torch.randn(4, 2, 5)),
}
for _path in NAMED_RULES:
    if _path.endswith("RMSNorm"):  # the transformers families' copies of Llama's RMSNorm
        CASES[_path] = (_named(_path, 5), lambda: torch.randn(4, 3, 5))


def _registered() -> list[str]:
    return sorted([f"{t.__module__}.{t.__qualname__}" for t in RULES] + list(NAMED_RULES))


def test_every_registered_rule_has_a_case() -> None:
    assert set(_registered()) <= set(CASES), sorted(set(_registered()) - set(CASES))


@pytest.mark.parametrize("path", _registered())
def test_rule_is_exact_against_the_loop(path: str) -> None:
    build, inputs = CASES[path]
    torch.manual_seed(0)
    model, x = build().double(), inputs()
    assert f"{type(_inner(model)).__module__}.{type(_inner(model)).__qualname__}" == path
    y = feature_targets(model, x.double() if x.is_floating_point() else x)
    assert_exact(model, x, y, feature_loss, engine="hooks")


def _inner(model: nn.Module) -> nn.Module:
    return model.layer if isinstance(model, First) else model
