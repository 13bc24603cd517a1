"""Every family builds, runs forward and backward on its data sets' shapes in train and eval
mode, has the published size at its reference setting, meets parameter budgets, and is
measured by the diversity engine's hook rules alone."""

from __future__ import annotations

import warnings

import pytest
import torch

from batchbound.data import get_entry, load_dataset
from batchbound.models import build_model, count_parameters, family_names
from batchbound.models.options import meta_parameter_count


def data_shape(name: str) -> tuple[int, ...]:
    """The input shape the data registry states for ``name`` (no files needed)."""
    shape = get_entry(name).input_shape
    assert shape is not None, name
    return tuple(shape)


DIGITS = data_shape("digits")  # (64,)
MNIST = data_shape("mnist5k")  # (1, 28, 28), as mnist, fashion-mnist, emnist
MNIST1D = data_shape("mnist1d")  # (1, 40)
CIFAR = data_shape("cifar10")  # (3, 32, 32)

# (spec, input shape): every family on the shapes of the data sets it is meant for, at widths
# small enough for a 2-core CPU.
CASES = [
    ("fc(depth=3,params=4000)", DIGITS),
    ("fc(depth=2,width=16,act=tanh,bias=false)", MNIST),
    ("linear(depth=4,params=3000)", (50,)),  # synthetic-linear's default d
    ("lenet(width_mult=0.3,head=[32])", MNIST),
    ("lenet(width_mult=0.3,head=[16,16],act=tanh)", CIFAR),
    ("lenet(params=3000,image=[1,8,8],padding=2)", DIGITS),
    ("resnet(blocks=[1,1,1,1],width=4,head=[16])", CIFAR),
    ("resnet(blocks=[2,1],width=4,norm=group)", MNIST),
    ("resnet(blocks=[1,1,1,1],width=4,image=[1,8,8],norm=none)", DIGITS),
    ("vgg(cfg=11,width=0.0625)", CIFAR),
    ("vgg(cfg=16,width=0.0625)", MNIST),
    ("mobilenetv2(width=0.1)", CIFAR),
    ("alexnet(width=0.0625)", CIFAR),
    ("alexnet(width=0.0625)", MNIST),
    ("cnn1d", MNIST1D),
    ("cnn1d(width=8)", (MNIST1D[-1],)),
]


# The language models read token ids and give per-token logits; tests/unit/test_models_text.py
# covers them the same way (forward, exact norms, options, resolved specs).
TEXT_FAMILIES = {"gpt", "lstm"}


def test_the_cases_cover_every_family():
    assert {spec.split("(")[0] for spec, _ in CASES} | TEXT_FAMILIES == set(family_names())


@pytest.mark.parametrize("spec,shape", CASES, ids=[f"{s}-{'x'.join(map(str, d))}"
                                                   for s, d in CASES])
def test_forward_and_backward_in_train_and_eval_mode(spec, shape):
    model = build_model(spec, shape, 10, seed=0)
    x = torch.randn(4, *shape)
    y = torch.randint(0, 10, (4,))
    for mode in ("train", "eval"):
        model.train(mode == "train")
        model.zero_grad()
        out = model(x)
        assert out.shape == (4, 10)
        torch.nn.functional.cross_entropy(out, y).backward()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)


def test_seed_makes_initialisation_reproducible():
    a = build_model("resnet(blocks=[1,1],width=4)", CIFAR, 10, seed=3)
    b = build_model("resnet(blocks=[1,1],width=4)", CIFAR, 10, seed=3)
    c = build_model("resnet(blocks=[1,1],width=4)", CIFAR, 10, seed=4)
    pairs = list(zip(a.parameters(), b.parameters(), c.parameters(), strict=True))
    assert all(torch.equal(p, q) for p, q, _ in pairs)
    assert not all(torch.equal(p, r) for p, _, r in pairs)


# Published sizes at the reference settings, 10 classes (counted on the meta device).
REFERENCE_SIZES = [
    ("lenet", MNIST, 431_080),  # Caffe LeNet; [width]'s "LeNet 431k"
    ("resnet", CIFAR, 11_173_962),  # ResNet-18; [width]'s "11m"
    ("resnet(blocks=[3,4,6,3])", CIFAR, 21_282_122),  # ResNet-34; [width]'s "21m"
    ("vgg(cfg=16)", CIFAR, 14_724_042),
    ("mobilenetv2", CIFAR, 2_236_682),
    ("alexnet", CIFAR, 2_472_266),
    ("cnn1d", MNIST1D, 5_210),  # mnist1d's ConvBase
]


@pytest.mark.parametrize("spec,shape,expected", REFERENCE_SIZES)
def test_reference_architectures_have_their_published_size(spec, shape, expected):
    assert meta_parameter_count(lambda: build_model(spec, shape, 10)) == expected


# Budgets: the achieved count must be the closest the family can reach (its neighbours in
# width are no closer) and within the stated tolerance.
BUDGETS = [
    ("resnet", "width", {}, 2_000_000, CIFAR, 0.01),
    ("resnet", "width", {"blocks": [3, 4, 6, 3]}, 2_000_000, CIFAR, 0.05),
    ("cnn1d", "width", {}, 5_000, MNIST1D, 0.05),
]


@pytest.mark.parametrize("family,key,options,budget,shape,tolerance", BUDGETS)
def test_parameter_budgets_pick_the_closest_width(family, key, options, budget, shape, tolerance):
    from batchbound.spec import Spec

    model = build_model(Spec(family, {**options, "params": budget}), shape, 10)
    achieved = count_parameters(model)
    width = model.batchbound_shape.width
    assert abs(achieved - budget) <= tolerance * budget
    for neighbour in (width - 1, width + 1):
        if neighbour >= 1:
            other = meta_parameter_count(
                lambda n=neighbour: build_model(Spec(family, {**options, key: n}), shape, 10))
            assert abs(other - budget) >= abs(achieved - budget)


def test_lenet_budget_searches_the_channel_widths():
    model = build_model("lenet(params=200000)", MNIST, 10)
    achieved = count_parameters(model)
    m = model.batchbound_shape.width
    # One more conv2 channel adds 16·500 head weights plus its filters (~8.6k): coarse steps.
    assert abs(achieved - 200_000) <= 0.025 * 200_000
    for c2 in (round(m * 50) - 1, round(m * 50) + 1):
        other = meta_parameter_count(lambda c2=c2: build_model(f"lenet(width_mult={c2 / 50})",
                                                                MNIST, 10))
        assert abs(other - 200_000) >= abs(achieved - 200_000)


def test_resolved_spec_rebuilds_the_same_architecture():
    for spec, shape in CASES:
        model = build_model(spec, shape, 10)
        again = build_model(model.batchbound_shape.resolved, shape, 10)
        assert [tuple(p.shape) for p in model.parameters()] == [
            tuple(p.shape) for p in again.parameters()
        ], spec


def test_depth_conventions():
    assert build_model("fc(depth=4,width=8)", DIGITS, 10).batchbound_shape.depth == 4
    assert build_model("resnet(width=4)", CIFAR, 10).batchbound_shape.depth == 18
    assert build_model("resnet(width=4,blocks=[3,4,6,3])", CIFAR, 10).batchbound_shape.depth == 34
    assert build_model("vgg(width=0.1)", CIFAR, 10).batchbound_shape.depth == 16
    assert build_model("lenet", MNIST, 10).batchbound_shape.depth == 4


# One case per family, plus BatchNorm, GroupNorm and no normalisation in a ResNet; small
# images keep the per-example loop reference cheap.
HOOK_CASES = [
    ("fc(depth=3,params=4000)", DIGITS),
    ("linear(depth=4,params=3000)", (50,)),
    ("lenet(width_mult=0.3,head=[32])", MNIST),
    ("resnet(blocks=[1,1],width=4,head=[8])", (3, 8, 8)),
    ("resnet(blocks=[2,1],width=4,norm=group)", (1, 8, 8)),
    ("resnet(blocks=[1,1],width=4,norm=none,image=[1,8,8])", DIGITS),
    ("vgg(cfg=11,width=0.0625)", (3, 8, 8)),
    ("mobilenetv2(width=0.1)", (3, 8, 8)),
    ("alexnet(width=0.0625)", CIFAR),
    ("cnn1d(width=8)", (MNIST1D[-1],)),
]


def test_hook_cases_cover_every_family():
    assert {spec.split("(")[0] for spec, _ in HOOK_CASES} | TEXT_FAMILIES == set(family_names())


@pytest.mark.parametrize("spec,shape", HOOK_CASES,
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_measure_uses_hook_rules_only(spec, shape):
    """The hook engine covers every layer (engine="hooks" raises for an uncovered one, where
    "auto" would warn and fall back) with no warning, and agrees with the per-example loop in
    float64."""
    diversity = pytest.importorskip("batchbound.diversity")
    if not hasattr(diversity, "measure"):
        pytest.skip("batchbound.diversity.measure is not there yet")
    model = build_model(spec, shape, 10, seed=0)
    x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hooks = diversity.measure(model, (x, y), loss="cross_entropy", engine="hooks",
                                  dtype=torch.float64)
    loop = diversity.measure(model, (x, y), loss="cross_entropy", engine="loop",
                             dtype=torch.float64)
    assert hooks.diversity == pytest.approx(loop.diversity, rel=1e-8)


@pytest.fixture(scope="module")
def digits_images():
    return load_dataset("digits(image=true)")


@pytest.mark.parametrize("spec", [
    "fc(depth=2,width=32)",
    "lenet(width_mult=0.5,head=[32],padding=2)",
    "resnet(blocks=[1,1],width=8)",
])
def test_families_learn_real_digits(spec, digits_images):
    """Fifteen SGD steps on 128 real 8×8 digits (the embedded set's image form) lower the
    training loss by 10% or more: the models train on real data, not only on random tensors."""
    data = digits_images
    x, y = data.x_train[:128], data.y_train[:128]
    model = build_model(spec, data.input_shape, data.num_outputs, seed=0)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(15):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]


def test_a_family_registered_with_a_sweep_kind_is_sweepable_without_other_edits():
    """A family that names its sweep kind at registration is swept like the built-in ones
    (models/sweep.py never names a family); the registry is restored afterwards."""
    from batchbound.models import family_sweep, registry, sweepable_families
    from batchbound.models.fc import fully_connected
    from batchbound.models.layers import ModelShape, tag

    @registry.register_family("toyfc", sweep="layers")
    def toy(input_shape, num_outputs, depth=2, width=None, params=None, act="relu"):
        model = fully_connected(input_shape, num_outputs, depth=depth, width=width,
                                params=params, act=act)
        shape = model.batchbound_shape
        return tag(model, ModelShape("toyfc", shape.depth, shape.width,
                                     "toy" + shape.resolved))

    try:
        assert "toyfc" in sweepable_families()
        rows = family_sweep("toyfc", 4000, [1, 3], (64,), 10)
        reference = family_sweep("fc", 4000, [1, 3], (64,), 10)
        assert [(r.depth, r.width, r.params) for r in rows] == \
            [(r.depth, r.width, r.params) for r in reference]
        assert all(r.spec.startswith("toyfc(") for r in rows)
    finally:
        registry._FAMILIES.pop("toyfc", None)
        registry._SWEEPS.pop("toyfc", None)
