"""``linear``'s init option: PyTorch's default (unchanged) or [width]'s i.i.d. N(0, init_std²)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models import build_model, family_sweep

SHAPE = (50,)  # synthetic-linear's default d


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in model.parameters()]


def test_default_init_is_pytorchs_for_the_seed():
    """init=default builds exactly what the family built before the option existed: the
    nn.Linear stack under torch.manual_seed(seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        expected = [nn.Linear(50, 16, bias=False), nn.Linear(16, 16, bias=False),
                    nn.Linear(16, 3, bias=False)]
    for spec in ("linear(depth=2,width=16)", "linear(depth=2,width=16,init=default)"):
        got = weights(build_model(spec, SHAPE, 3, seed=5))
        assert len(got) == 3
        assert all(torch.equal(g, e.weight) for g, e in zip(got, expected, strict=True))
    assert (build_model("linear(depth=2,width=16,init=default)", SHAPE, 3)
            .batchbound_shape.resolved == "linear(depth=2,width=16)")


@pytest.mark.parametrize("std", [1.0, 0.2])
def test_normal_init_has_unit_or_given_std_in_every_layer(std):
    spec = "linear(depth=3,width=64,init=normal)" if std == 1.0 else \
        f"linear(depth=3,width=64,init=normal,init_std={std})"
    model = build_model(spec, SHAPE, 10, seed=0)
    layers = weights(model)
    assert [tuple(w.shape) for w in layers] == [(64, 50), (64, 64), (64, 64), (10, 64)]
    for w in layers:  # 640 to 4096 draws each: the sample std is within a few % of std
        assert w.std().item() == pytest.approx(std, rel=0.08)
        assert abs(w.mean().item()) < 0.1 * std


def test_normal_init_is_seeded_by_the_model_seed():
    spec = "linear(depth=2,width=32,init=normal)"
    a, b, c = (weights(build_model(spec, SHAPE, 1, seed=s)) for s in (3, 3, 4))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not any(torch.equal(p, r) for p, r in zip(a, c, strict=True))
    default = weights(build_model("linear(depth=2,width=32)", SHAPE, 1, seed=3))
    assert not any(torch.equal(p, d) for p, d in zip(a, default, strict=True))


def test_resolved_spec_names_the_init_and_rebuilds_the_same_weights():
    cases = {
        "linear(depth=2,params=3000,init=normal)": "init=normal)",
        "linear(depth=2,width=8,init=normal,init_std=1)": "linear(depth=2,width=8,init=normal)",
        "linear(depth=2,width=8,init=normal,init_std=0.25)":
            "linear(depth=2,width=8,init=normal,init_std=0.25)",
        "linear(depth=0,init=normal,init_std=2e-1)": "linear(depth=0,init=normal,init_std=0.2)",
    }
    for spec, resolved in cases.items():
        model = build_model(spec, SHAPE, 1, seed=7)
        shape = model.batchbound_shape
        assert shape.resolved.endswith(resolved), (spec, shape.resolved)
        again = build_model(shape.resolved, SHAPE, 1, seed=7)
        assert all(torch.equal(p, q) for p, q in
                   zip(weights(model), weights(again), strict=True)), spec


def test_a_sweep_carries_the_init():
    rows = family_sweep("linear", 3000, [1, 2], SHAPE, 1, options={"init": "normal",
                                                                    "init_std": 0.5})
    assert [r.spec.split(",", 2)[-1] for r in rows] == ["init=normal,init_std=0.5)"] * 2


@pytest.mark.parametrize("spec,message", [
    ("linear(depth=2,width=4,init=xavier)",
     "linear: unknown init 'xavier'; choose from default, normal"),
    ("linear(depth=2,width=4,init_std=0.5)", "init_std applies to init=normal only"),
    ("linear(depth=2,width=4,init=default,init_std=1)", "init_std applies to init=normal only"),
    ("linear(depth=2,width=4,init=normal,init_std=0)", "linear: init_std must be a number > 0"),
    ("linear(depth=2,width=4,init=normal,init_std=big)", "init_std must be a number > 0"),
])
def test_bad_init_options_name_the_valid_ones(spec, message):
    with pytest.raises(BatchboundError) as caught:
        build_model(spec, SHAPE, 1)
    assert message in str(caught.value)
