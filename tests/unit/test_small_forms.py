"""The op-saving paths of the hooks engine against the float64 per-example loop: small
``Outer`` forms materialised and normed with their like (``Outer.small_dense``), and the cap
on what waits for the end of the backward pass (``HooksPass.defer_budget``)."""

from __future__ import annotations

import pytest
import torch
from tests.support.reference import assert_exact, feature_loss, feature_targets
from torch import nn

from batchbound.diversity import hooks
from batchbound.diversity.rules.forms import DEFER_NUMEL, Outer


def _loop_sq_norms(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.stack([sum(torch.outer(u[i, t], v[i, t]) for t in range(u.shape[1]))
                        .square().sum() for i in range(u.shape[0])])


def test_small_dense_norms_equal_the_gram_form_and_a_float64_loop() -> None:
    g = torch.Generator().manual_seed(0)
    u = torch.randn(5, 7, 6, generator=g, dtype=torch.float64)
    v = torch.randn(5, 7, 4, generator=g, dtype=torch.float64)
    form = Outer(u, v)
    small = form.small_dense()
    assert small is not None and small.grads.shape == (5, 6, 4)
    ref = _loop_sq_norms(u, v)
    torch.testing.assert_close(small.sq_norms(), ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(form.sq_norms(), ref, rtol=1e-12, atol=0)


def test_small_dense_declines_large_indexed_and_single_step_forms() -> None:
    u = torch.zeros(2, 3, 1024)
    v = torch.zeros(2, 3, DEFER_NUMEL // 1024)  # n·p·q = 2·DEFER_NUMEL
    assert Outer(u, v).small_dense() is None
    assert Outer(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)).small_dense() is None
    assert Outer(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, DEFER_NUMEL // 8),
                 rows=10).small_dense() is None  # an indexed one of n·p·q > DEFER_NUMEL
    # two positions of a 64 × 64 weight: the product costs far more than the Gram form
    assert Outer(torch.zeros(2, 2, 64), torch.zeros(2, 2, 64)).small_dense() is None


class _Seq(nn.Module):
    """Linear layers and LayerNorms on (n, T, d): the forms the deferral holds."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.c, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.a(x)))
        return self.head(torch.tanh(self.c(torch.tanh(self.b(h)))))


DEFAULT = hooks.DEFER_BUDGET


@pytest.mark.parametrize("budget", [DEFAULT, 100, 1])
def test_deferred_norms_are_exact_under_any_budget(budget: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    held: list[int] = []
    defer = hooks.HooksPass._defer

    def tracked(self: hooks.HooksPass, name: str, grads: torch.Tensor) -> None:
        defer(self, name, grads)
        held.append(self._held)

    monkeypatch.setattr(hooks, "DEFER_BUDGET", budget)
    monkeypatch.setattr(hooks.HooksPass, "_defer", tracked)
    torch.manual_seed(0)
    model = _Seq()
    x = torch.randn(4, 5, 6)
    assert_exact(model, x, feature_targets(model.double(), x.double()), feature_loss,
                 engine="hooks")
    assert held and max(held) <= budget  # the cap on the extra memory
    if budget == DEFAULT:
        assert max(held) > 4 * 8 * 8  # several layers' forms did wait, together


@pytest.mark.parametrize("small", [True, False])
def test_combined_norms_of_tied_uses_equal_a_float64_loop(
        small: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight used by an embedding and a head (indexed and dense ``Outer``) and by a
    ``Dense`` form: the materialised sum (small) and the cross terms (not) agree with the
    per-example sum of the materialised gradients."""
    from batchbound.diversity.rules import forms

    if not small:
        monkeypatch.setattr(forms, "DEFER_NUMEL", 0)
    g = torch.Generator().manual_seed(1)
    n, steps, p, q = 3, 4, 5, 6
    embedding = Outer(torch.randint(p, (n, steps), generator=g),
                      torch.randn(n, steps, q, generator=g, dtype=torch.float64), rows=p)
    head = Outer(torch.randn(n, steps, p, generator=g, dtype=torch.float64),
                 torch.randn(n, steps, q, generator=g, dtype=torch.float64))
    extra = forms.Dense(torch.randn(n, p, q, generator=g, dtype=torch.float64))
    parts = [embedding, head, extra]
    ref = torch.stack([sum(f.dense()[i].reshape(-1) for f in parts).square().sum()
                       for i in range(n)])
    torch.testing.assert_close(forms.combined_sq_norms(parts, p * q), ref, rtol=1e-12, atol=0)


def test_small_indexed_forms_are_scattered_and_equal_a_float64_loop() -> None:
    """An embedding's ``Outer`` (one-hot u given by row indices, repeated within an example)
    small enough is materialised by index_add (no ``unique``, which waits for the device):
    its norms equal the unique-pair path and a float64 loop over one-hot outer products."""
    g = torch.Generator().manual_seed(3)
    rows, n, steps, q = 6, 4, 9, 5
    idx = torch.randint(rows, (n, steps), generator=g)
    v = torch.randn(n, steps, q, generator=g, dtype=torch.float64)
    form = Outer(idx, v, rows=rows)
    small = form.small_dense()
    assert small is not None and small.grads.shape == (n, rows, q)
    one_hot = torch.nn.functional.one_hot(idx, rows).to(torch.float64)
    ref = _loop_sq_norms(one_hot, v)
    torch.testing.assert_close(small.sq_norms(), ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(form.sq_norms(), ref, rtol=1e-12, atol=0)


def test_a_one_position_outer_given_flat_equals_it_given_by_position() -> None:
    """A Linear layer's ``Outer`` on 2-d inputs comes as (n, p) and (n, q), its batch sum added
    from them as they are: every quantity equals the same form given as (n, 1, ·), and the
    cross terms with another form too."""
    from batchbound.diversity.rules import forms

    g = torch.Generator().manual_seed(4)
    n, p, q = 5, 3, 4
    u, v = (torch.randn(n, k, generator=g, dtype=torch.float64) for k in (p, q))
    flat, positions = Outer(u, v), Outer(u.unsqueeze(1), v.unsqueeze(1))
    other = Outer(torch.randn(n, 2, p, generator=g, dtype=torch.float64),
                  torch.randn(n, 2, q, generator=g, dtype=torch.float64))
    assert (flat.n, flat.steps, flat.p, flat.q) == (positions.n, 1, p, q)
    for got, want in [(flat.sq_norms(), positions.sq_norms()), (flat.dense(), positions.dense()),
                      (flat.total(), positions.total()),
                      (flat.part(slice(1, 3)).sq_norms(), positions.part(slice(1, 3)).sq_norms()),
                      (forms.inner(flat, other, p * q), forms.inner(positions, other, p * q))]:
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    sums = [torch.ones(p, q, dtype=torch.float64) for _ in range(2)]
    flat.add_total_to(sums[0])
    positions.add_total_to(sums[1])
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-14, atol=0)
    torch.testing.assert_close(sums[0] - 1, torch.einsum("np,nq->pq", u, v), rtol=1e-12, atol=0)
