"""The mechanism table: a new mechanism is one module's worth of code.

A toy mechanism, registered for a test only (the table is restored afterwards), goes through
everything the built-in ones do: parsing and its errors, the closed form against Monte Carlo,
the exact measurement on a model, and the trainer at worker and example granularity.

The toy: M(g) = c·g with c = 1 − a or 1 + a, each with probability 1/2, one c per vector.
E M(g) = g (unbiased) and E‖M(g)‖² = (1 + a²)‖g‖², so
Δ = (1 + a²)S / ((1 + a²)S + T − S) = (1 + a²)S / (T + a²S).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from batchbound.diversity import mechanisms, per_example_gradients
from batchbound.diversity.losses import cross_entropy
from batchbound.diversity.mechanisms import (
    MECHANISMS,
    Mechanism,
    Option,
    Sums,
    apply_mechanism,
    diversity_under,
    mechanism_diversity,
    mechanism_names,
    monte_carlo_diversity,
    parse_mechanism,
    register_mechanism,
)
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer
from batchbound.train.mechanisms import apply_to_worker, example_gradients

# ------------------------------------------------------------- the toy mechanism's module


def check_a(a: float) -> str | None:
    return None if 0.0 <= a <= 1.0 else f"random_scale needs a in [0, 1], got {a}"


def closed_form(mech: Mechanism, sums: Sums) -> float:
    second = 1.0 + mech.a**2
    return second * sums.S / (second * sums.S + sums.T - sums.S)


def sample(
    mech: Mechanism,
    tensors: list[Tensor],
    generator: torch.Generator | None,
    *,
    batch_dims: int,
    rescale: bool,
) -> list[Tensor]:
    lead = tensors[0].shape[:batch_dims]
    sign = torch.randint(0, 2, lead, generator=generator, device=tensors[0].device) * 2 - 1
    factor = 1.0 + mech.a * sign.to(tensors[0].dtype)  # one c per vector, shared by its tensors
    return [t * factor.reshape(*lead, *([1] * (t.dim() - batch_dims))) for t in tensors]


def register_toy() -> None:
    register_mechanism(
        "random_scale",
        closed_form=closed_form,
        options=(Option("a", 0.0, required="random_scale needs a, e.g. random_scale(a=0.5)",
                        check=check_a),),
        aliases=("rscale",),
    )(sample)


# -------------------------------------------------------------------------------- tests

BUILT_IN = ("none", "dropconnect", "sgld", "quantization")


@pytest.fixture
def toy() -> Iterator[Mechanism]:
    saved = dict(MECHANISMS)
    register_toy()
    try:
        yield parse_mechanism("random_scale(a=0.5)")
    finally:  # restore the table, order included
        MECHANISMS.clear()
        MECHANISMS.update(saved)
    assert mechanism_names() == BUILT_IN


def test_the_built_in_table_is_complete_and_in_order() -> None:
    assert mechanism_names() == BUILT_IN == mechanisms.MECHANISM_NAMES
    assert [m for m in BUILT_IN if MECHANISMS[m].identity] == ["none"]
    built_in = [Mechanism(name) for name in BUILT_IN]  # every option at its default
    assert {m.name for m in built_in if m.needs_per_example} == {"dropconnect", "quantization"}
    assert {m.name for m in built_in if m.needs_R} == {"quantization"}
    assert parse_mechanism("quantization(per_tensor=true)").splits_tensors
    assert not parse_mechanism("quantization").splits_tensors


def test_toy_parses_like_a_built_in(toy: Mechanism) -> None:
    assert toy == Mechanism("random_scale", a=0.5) == parse_mechanism("RSCALE(a=0.5)")
    assert str(toy) == "random_scale(a=0.5)" and toy.a == 0.5
    assert toy.to_dict() == {"name": "random_scale", "p": 0.0, "sigma": 0.0,
                             "per_tensor": False, "a": 0.5}
    assert parse_mechanism("sgld(sigma=0.1)").to_dict()["a"] == 0.0  # one flat record
    assert "random_scale" in mechanisms.MECHANISM_NAMES
    assert not toy.is_identity and toy.needs_per_example and not toy.needs_R
    for spec, message in [
        ("random_scale", "needs a, e.g."),
        ("random_scale(a=2)", r"a in \[0, 1\], got 2.0"),
        ("random_scale(a=true)", "a must be a number"),
        ("random_scale(b=1)", "has no option 'b'; options: a"),
        ("bogus", "choose from none, dropconnect, sgld, quantization, random_scale"),
    ]:
        with pytest.raises(BatchboundError, match=message):
            parse_mechanism(spec)


def test_toy_closed_form_matches_monte_carlo(toy: Mechanism) -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(5, generator=gen, dtype=torch.float64) + 0.8 * torch.randn(
        6, 5, generator=gen, dtype=torch.float64)
    n, d = g.shape
    S, T = float(g.square().sum()), float(g.sum(0).square().sum())
    exact = diversity_under(toy, S=S, T=T, n=n, d=d)
    assert exact == pytest.approx(1.25 * S / (T + 0.25 * S))
    assert exact != pytest.approx(S / T, rel=0.01)  # the toy does change Δ
    est = monte_carlo_diversity(toy, g, samples=20000, block=2000,
                                generator=torch.Generator().manual_seed(1))
    assert abs(est.diversity - exact) <= 5 * est.diversity_se
    assert est.diversity_se < 0.02 * exact


def test_toy_exact_measurement_on_a_model(toy: Mechanism) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(23, 4), torch.randint(0, 2, (23,))
    report = mechanism_diversity(model, (x, y), "cross_entropy", toy, chunk_size=5,
                                 dtype=torch.float64)
    assert report.R is None and report.engine != "materialise"  # S and T suffice
    assert report.mechanism == "random_scale(a=0.5)"
    assert report.diversity == pytest.approx(1.25 * report.S / (report.T + 0.25 * report.S))


def test_toy_applies_at_worker_granularity(toy: Mechanism) -> None:
    gen = torch.Generator().manual_seed(2)
    plain = [torch.randn(3, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)]
    scale = 0.25
    factors = []
    for _ in range(2000):
        grads = [g * scale for g in plain]
        apply_to_worker(toy, grads, scale, gen)  # in place, the default homogeneous form
        ratios = [g / (p * scale) for g, p in zip(grads, plain, strict=True)]
        c = float(ratios[0].reshape(-1)[0])
        assert min(abs(c - 0.5), abs(c - 1.5)) < 1e-12  # one factor for the whole vector
        assert all(torch.allclose(r, torch.full_like(r, c)) for r in ratios)
        factors.append(c)
    assert sum(factors) / len(factors) == pytest.approx(1.0, abs=5 * 0.5 / math.sqrt(2000))


def test_toy_at_example_granularity_draws_one_factor_per_example(toy: Mechanism) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3)).double()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randint(0, 3, (4,))
    per_example = per_example_gradients(model, x, y, cross_entropy)
    gen = torch.Generator().manual_seed(3)
    _, grads = example_gradients(toy, model, x, y, cross_entropy, 0.5, gen)
    # the same draws by hand: one factor per example, on the per-example gradients
    drawn = apply_mechanism(toy, per_example, torch.Generator().manual_seed(3), batch_dims=1)
    assert torch.allclose(grads[0], drawn["0.weight"].sum(0) * 0.5)


def test_toy_trains(toy: Mechanism) -> None:
    small = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
                 max_iterations=3, eval_every_iterations=3, dtype="float64")
    finals = {}
    for mechanism, granularity in [("none", "worker"), ("random_scale(a=0.5)", "worker"),
                                   ("random_scale(a=0.5)", "example")]:
        trainer = Trainer(TrainConfig(**small, mechanism=mechanism,
                                      mechanism_granularity=granularity), DistContext())
        trainer.run()
        finals[mechanism, granularity] = torch.cat(
            [p.detach().reshape(-1) for p in trainer.model.parameters()])
    plain = finals["none", "worker"]
    assert not torch.equal(finals["random_scale(a=0.5)", "worker"], plain)
    assert not torch.equal(finals["random_scale(a=0.5)", "example"], plain)


def test_the_table_refuses_clashes() -> None:
    saved = dict(MECHANISMS)
    try:
        with pytest.raises(ValueError, match="registered twice"):
            register_mechanism("quantize", closed_form=closed_form)(sample)
        with pytest.raises(ValueError, match="another default"):
            register_mechanism("other", closed_form=closed_form,
                               options=(Option("p", 0.5),))(sample)
        with pytest.raises(ValueError, match="hides a Mechanism attribute"):
            register_mechanism("other", closed_form=closed_form,
                               options=(Option("name", 0.0),))(sample)
    finally:
        MECHANISMS.clear()
        MECHANISMS.update(saved)
    assert mechanism_names() == BUILT_IN
