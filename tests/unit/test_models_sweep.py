"""``family_sweep`` and ``block_sweep``: concrete specs with the count closest to the budget."""

from __future__ import annotations

import pytest
from torch import nn

from batchbound.models import block_sweep, build_model, count_parameters, family_sweep
from batchbound.models.fc import budget_count
from batchbound.models.options import meta_parameter_count


def test_fc_sweep_rows_rebuild_to_their_counts():
    rows = family_sweep("fc", 5000, range(0, 6), (64,), 10, options={"act": "tanh"},
                        count_biases=True)
    assert [r.depth for r in rows] == list(range(6))
    assert rows[0].width is None and rows[0].spec == "fc(depth=0,act=tanh,bias=true)"
    for row in rows[1:]:
        model = build_model(row.spec, (64,), 10)
        assert count_parameters(model) == row.total_params == row.params  # biases counted
        assert row.params == budget_count(64, row.width, row.depth, 10, count_biases=True)
        for k in (row.width - 1, row.width + 1):
            if k >= 1:
                other = budget_count(64, k, row.depth, 10, count_biases=True)
                assert abs(other - 5000) >= abs(row.params - 5000)


@pytest.mark.parametrize("family,options,shape", [
    ("lenet", {"width_mult": 0.5}, (1, 28, 28)),
    ("resnet", {"blocks": [1, 1], "width": 4}, (3, 16, 16)),
])
def test_head_sweep_holds_the_trunk_and_solves_the_head(family, options, shape):
    budget = 60_000
    rows = family_sweep(family, budget, [1, 2, 3], shape, 10, options=options)
    trunk = None
    for row in rows:
        model = build_model(row.spec, shape, 10)
        assert count_parameters(model) == row.params
        # the part before the head is the same in every row
        conv = sum(p.numel() for m in model.modules() if not isinstance(m, nn.Linear)
                   for p in m.parameters(recurse=False))
        trunk = conv if trunk is None else trunk
        assert conv == trunk
        head = [row.width] * row.depth
        for k in (row.width - 1, row.width + 1):
            spec = row.spec.replace(f"head={head}".replace(" ", ""),
                                    f"head={[k] * row.depth}".replace(" ", ""))
            assert spec != row.spec
            other = meta_parameter_count(lambda spec=spec: build_model(spec, shape, 10))
            assert abs(other - budget) >= abs(row.params - budget)
        assert abs(row.relative_error) < 0.02


def test_cnn1d_and_block_sweeps():
    rows = family_sweep("cnn1d", 5000, [1, 2, 3, 4], (1, 40), 10)
    assert [r.depth for r in rows] == [1, 2, 3, 4]
    assert all(abs(r.relative_error) < 0.05 for r in rows)
    blocks = block_sweep(100_000, [[1, 1, 1, 1], [2, 2, 2, 2]], (3, 16, 16), 10)
    assert [r.depth for r in blocks] == [10, 18]
    assert blocks[0].width > blocks[1].width  # fewer blocks buy more filters
    for row in blocks:
        assert count_parameters(build_model(row.spec, (3, 16, 16), 10)) == row.params
