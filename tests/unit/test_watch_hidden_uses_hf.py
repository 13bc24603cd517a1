"""watch() where only the fingerprints can see the loss: a backward started by
``torch.autograd.backward`` (not ``loss.backward()``) on float32 Hugging Face models built
from configs, gradient checkpointing on and off. An honest step is never refused and its
n·Δ is the float64 loop's to float32's 1e-3; a weight decay hidden in the loss, 3 % of the
step's gradient on the first Linear's weight, is refused (before the fingerprints' bound,
forms.project_bound, such a regulariser passed with n·Δ off by up to a few per cent)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_outside_hf_configs import CASES, B, loop
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

pytest.importorskip("transformers")


def first_linear(model: nn.Module) -> tuple[str, nn.Parameter]:
    name, layer = next((k, m) for k, m in model.named_modules()
                       if isinstance(m, nn.Linear) and m.weight.requires_grad)
    return f"{name}.weight", layer.weight


def watched(model: nn.Module, batch: dict, loss, penalty: float = 0.0) -> OnlineDiversity:
    _, weight = first_linear(model)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost, transformers' deprecations
        for _ in range(2):  # the first step checks the model
            model.zero_grad(set_to_none=True)
            with watch(model, monitor, reduction="sum"):
                total = loss(model(**batch), batch).sum()
                total = total + 0.5 * penalty * weight.square().sum()
                torch.autograd.backward(total)
    return monitor


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", ["gpt-neox", "llama-gqa", "bert-mlm", "bart-layerdrop"])
def test_an_honest_step_passes_and_a_hidden_decay_is_refused(name: str,
                                                              checkpointing: bool) -> None:
    build, data, loss, _ = CASES[name]
    torch.manual_seed(0)
    model, batch = build().eval(), data()
    if checkpointing:
        model.gradient_checkpointing_enable()
    S, T = loop(copy.deepcopy(model).double(), batch, loss)
    want = OnlineDiversity(1000, decay=0.0)
    want.update_from_norms(S, T, B)
    got = watched(model, batch, loss)
    assert B * got.m2 / (got.m2 + (B - 1) * got.cross) == pytest.approx(
        B * want.m2 / (want.m2 + (B - 1) * want.cross), rel=1e-3)
    grads = torch.autograd.grad(loss(model(**batch), batch).sum(),
                                [p for p in model.parameters() if p.requires_grad])
    step = float(torch.sqrt(sum(g.double().square().sum() for g in grads)))
    name_w, weight = first_linear(model)
    with pytest.raises(BatchboundError, match=name_w.replace(".", r"\.")):
        watched(model, batch, loss, penalty=0.03 * step / float(weight.detach().norm()))
