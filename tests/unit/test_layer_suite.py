"""Layer configurations enumerated the way Opacus (tests/grad_samples) and BackPACK (its test
problems) enumerate them, each against the float64 per-example loop with the hooks engine:
no fallback, relative error ≤ 1e-9. Conv and norm layers are also covered by hypothesis in
test_rules.py; this file adds recurrent layers, attention, embeddings and shared weights."""

from __future__ import annotations

import itertools

import pytest
import torch
from reference import assert_exact, feature_loss, feature_targets
from torch import Tensor, nn

from batchbound.diversity.rules import forms
from batchbound.diversity.rules.forms import Dense, Outer, combined_sq_norms, inner


def check(model: nn.Module, x: Tensor, warns: str | None = None) -> None:
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    assert_exact(model, x, feature_targets(model, x), feature_loss, engine="hooks", warns=warns)


@pytest.mark.parametrize("shape", [(3, 5), (3, 2, 5), (2, 3, 2, 5), (2, 2, 2, 3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_on_2d_to_5d_inputs(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    check(nn.Linear(5, 4, bias=bias), torch.randn(*shape))


CONV = [  # (dims, stride, padding, padding_mode, dilation, groups)
    (1, 1, 0, "zeros", 1, 1), (1, 2, 1, "zeros", 1, 1), (1, 1, "same", "zeros", 2, 1),
    (1, 1, "same", "reflect", 1, 2), (1, 2, 2, "circular", 2, 2), (1, 1, "valid", "zeros", 1, 2),
    (2, 1, 0, "zeros", 1, 1), (2, 2, 1, "zeros", 1, 1), (2, 1, "same", "zeros", 2, 1),
    (2, 1, "same", "replicate", 1, 2), (2, 2, 1, "reflect", 2, 2), (2, 1, 1, "circular", 1, 2),
    (2, 1, "valid", "zeros", 2, 2),
]


@pytest.mark.parametrize("dims,stride,padding,mode,dilation,groups", CONV)
def test_conv(dims: int, stride: int, padding: int | str, mode: str, dilation: int,
              groups: int) -> None:
    torch.manual_seed(1)
    layer = (nn.Conv1d if dims == 1 else nn.Conv2d)(
        4, 6, 3, stride=stride, padding=padding, padding_mode=mode, dilation=dilation,
        groups=groups)
    check(layer, torch.randn(3, 4, *([9] * dims)))


@pytest.mark.parametrize("padding_idx,scale_grad_by_freq,sparse", [  # torch has no sparse
    c for c in itertools.product([None, 0, 3], [False, True], [False, True]) if not all(c[1:])
])
def test_embedding(padding_idx: int | None, scale_grad_by_freq: bool, sparse: bool) -> None:
    torch.manual_seed(2)
    layer = nn.Embedding(5, 3, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq,
                         sparse=sparse)
    check(layer, torch.randint(0, 5, (4, 6)),  # 5 rows, 24 lookups: many repeats
          warns="its gradient alone" if scale_grad_by_freq else None)


RECURRENT = [
    (mode, layers, bidirectional, batch_first)
    for mode in ("RNN_TANH", "RNN_RELU", "GRU", "LSTM", "LSTM_PROJ")
    for layers in (1, 2)
    for bidirectional in (False, True)
    for batch_first in (True, False)
]


def recurrent(mode: str, layers: int, bidirectional: bool, batch_first: bool,
              bias: bool) -> nn.Module:
    common = dict(num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                  bias=bias)
    if mode.startswith("RNN"):
        return nn.RNN(3, 4, nonlinearity=mode[4:].lower(), **common)
    if mode == "GRU":
        return nn.GRU(3, 4, **common)
    return nn.LSTM(3, 4, proj_size=2 if mode == "LSTM_PROJ" else 0, **common)


class RecurrentProbe(nn.Module):
    """Uses every output of the layer (the sequence and the final states), optionally from
    a given initial state (which carries an example axis, dimension 1)."""

    def __init__(self, rnn: nn.Module, initial: bool) -> None:
        super().__init__()
        self.rnn, self.initial = rnn, initial

    def forward(self, x: Tensor) -> Tensor:
        rnn = self.rnn
        seq = x if rnn.batch_first else x.transpose(0, 1)
        n, rows = x.shape[0], rnn.num_layers * (2 if rnn.bidirectional else 1)
        hx = None
        if self.initial:
            h0 = torch.tanh(x[:, :1, :1]).transpose(0, 1).expand(rows, n, rnn.proj_size
                                                                  or rnn.hidden_size)
            hx = (h0, torch.tanh(x[:, :1, 1:2]).transpose(0, 1).expand(
                rows, n, rnn.hidden_size)) if isinstance(rnn, nn.LSTM) else h0
        out, state = rnn(seq, hx)
        out = out if rnn.batch_first else out.transpose(0, 1)
        states = state if isinstance(state, tuple) else (state,)
        return torch.cat([out.flatten(1)] + [s.transpose(0, 1).flatten(1) for s in states], 1)


@pytest.mark.parametrize("mode,layers,bidirectional,batch_first", RECURRENT)
def test_recurrent(mode: str, layers: int, bidirectional: bool, batch_first: bool) -> None:
    torch.manual_seed(3)
    bias = (layers + bidirectional) % 2 == 0  # half the cases without biases
    initial = batch_first != bidirectional  # half from a given initial state
    model = RecurrentProbe(recurrent(mode, layers, bidirectional, batch_first, bias), initial)
    check(model, torch.randn(3, 5, 3))


ATTENTION = [  # (batch_first, kdim, add_bias_kv, add_zero_attn, need_weights, mask, padding)
    (True, None, False, False, False, None, False),
    (False, None, False, False, False, None, False),
    (True, None, False, False, True, "causal", False),
    (True, None, True, False, False, None, True),
    (False, None, False, True, True, "3d", False),
    (True, 5, False, False, False, "float", True),
    (False, 5, True, True, True, None, True),
    (True, None, True, True, False, "3d", True),
]


class Attention(nn.Module):
    def __init__(self, batch_first: bool, kdim: int | None, bias_kv: bool, zero_attn: bool,
                 need_weights: bool, mask: str | None, padding: bool) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(6, 2, batch_first=batch_first, kdim=kdim, vdim=kdim,
                                         add_bias_kv=bias_kv, add_zero_attn=zero_attn)
        self.kdim, self.need_weights, self.mask, self.padding = kdim, need_weights, mask, padding

    def forward(self, x: Tensor) -> Tensor:  # x: (n, L, 6)
        n, length = x.shape[:2]
        kv = x if self.kdim is None else torch.tanh(x[..., :1]).expand(n, length, self.kdim)
        q = x if self.mha.batch_first else x.transpose(0, 1)
        kv = kv if self.mha.batch_first else kv.transpose(0, 1)
        mask = None
        if self.mask == "causal":
            mask = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
        elif self.mask == "float":
            mask = torch.linspace(-1, 0, length * length, dtype=x.dtype).reshape(length, length)
        elif self.mask == "3d":  # per example and head, from the example itself
            mask = (x[:, :, :1] * x[:, :, 1:2].transpose(1, 2)).repeat_interleave(2, dim=0)
        padding = (x[:, :, 0] > 1.0) if self.padding else None
        if padding is not None:
            padding[:, 0] = False  # every example keeps a position
        out, weights = self.mha(q, kv, kv, key_padding_mask=padding, attn_mask=mask,
                                need_weights=self.need_weights)
        out = out if self.mha.batch_first else out.transpose(0, 1)
        return out.flatten(1) if weights is None else torch.cat([out.flatten(1),
                                                                 weights.flatten(1)], 1)


@pytest.mark.parametrize("config", ATTENTION)
def test_multihead_attention(config: tuple) -> None:
    torch.manual_seed(4)
    check(Attention(*config).eval(), torch.randn(3, 4, 6))


class Shared(nn.Module):
    """Weights used by several calls: a Linear, a conv and a LayerNorm each run twice, and an
    embedding tied to a head (its Gram cross term or materialised one, by the sizes)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        h = self.conv(torch.tanh(self.conv(h.transpose(1, 2)))).transpose(1, 2)
        h = self.norm(torch.tanh(self.fc(self.norm(self.fc(h)))))
        return self.head(h)


@pytest.mark.parametrize("vocab,steps", [(7, 3), (3, 12)])
def test_weights_shared_between_calls_and_modules(vocab: int, steps: int) -> None:
    torch.manual_seed(5)
    check(Shared(vocab), torch.randint(0, vocab, (4, steps)))


# ----------------------------------------------- the cross terms, against materialised


def random_forms(n: int = 3, p: int = 5, q: int = 4) -> list[forms.PerExampleGrad]:
    g = torch.Generator().manual_seed(6)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return [
        Outer(r(n, 2, p), r(n, 2, q)),
        Outer(r(n, 7, p), r(n, 7, q)),
        Outer(torch.randint(0, p, (n, 6), generator=g), r(n, 6, q), rows=p),
        Outer(torch.randint(0, p, (n, 1), generator=g), r(n, 1, q), rows=p),
        Dense(r(n, p, q)),
    ]


@pytest.mark.parametrize("budget", [forms.MATERIALISE_BUDGET, 7])
def test_inner_products_match_materialised_gradients(budget: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forms, "MATERIALISE_BUDGET", budget)  # 7: one example per block
    items = random_forms()
    for a, b in itertools.product(items, items):
        expected = (a.dense().reshape(3, -1) * b.dense().reshape(3, -1)).sum(dim=1)
        torch.testing.assert_close(inner(a, b, 20), expected, rtol=1e-12, atol=1e-12)
    dense_sum = sum(f.dense().reshape(3, -1) for f in items)
    torch.testing.assert_close(combined_sq_norms(items, 20), dense_sum.square().sum(dim=1),
                               rtol=1e-12, atol=1e-12)
    for f in items:
        torch.testing.assert_close(f.sq_norms(), f.dense().reshape(3, -1).square().sum(dim=1),
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(f.total(), f.dense().sum(dim=0).reshape(-1), rtol=1e-12,
                                   atol=1e-12)
