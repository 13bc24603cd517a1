"""nn.RNN, nn.GRU and nn.LSTM: any number of layers, either direction, either batch_first,
LSTM projections (``proj_size``), with or without biases and an initial state.

The fused kernels keep the gates to themselves, so the rule reruns the recurrence step by
step from the call's inputs and weights (detached), with the input-side pre-activations
G_i = x W_ihᵀ + b_ih of each layer and direction as leaves, and backpropagates the call's
output gradients through it once. Then, per example and with δ the gradient of a
pre-activation:

- ``weight_ih`` = Σ_t δgi_t x_tᵀ and ``bias_ih`` = Σ_t δgi_t (x_t: the layer's input);
- ``weight_hh`` = Σ_t δgh_t h_{t−1}ᵀ and ``bias_hh`` = Σ_t δgh_t, where gh = h W_hhᵀ + b_hh
  is the hidden-side pre-activation (δgh = δgi for RNN and LSTM; GRU multiplies its
  candidate's hidden part by the reset gate, so there it is taken separately);
- ``weight_hr`` (LSTM projection) = Σ_t δh_t m_tᵀ, with m_t = o_t ⊙ tanh(c_t).

All are ``Outer`` forms. The rerun costs about one more forward and backward of the layer.
Declined: packed sequences, unbatched inputs, and dropout between layers in train mode
(the kernel's masks cannot be replayed).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchbound.diversity.rules.forms import Dense, Outer, PerExampleGrad
from batchbound.diversity.rules.registry import Call, register_rule


def _suffix(layer: int, direction: int) -> str:
    return f"_l{layer}" + ("_reverse" if direction else "")


def _params(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in module.named_parameters(recurse=False))


def _batch_axis(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _unsupported(call: Call, n: int) -> str | None:
    m, x = call.module, call.input
    if not isinstance(x, Tensor):
        return "its input is a packed sequence"
    if x.dim() != 3:
        return f"its input {tuple(x.shape)} is unbatched"
    if m.training and m.dropout > 0 and m.num_layers > 1:
        return "dropout between its layers in train mode draws masks the rule cannot replay"
    hx = call.inputs.get("hx")
    for h in (hx if isinstance(hx, (tuple, list)) else [hx]):
        if isinstance(h, Tensor) and (h.dim() != 3 or h.shape[1] != n):
            return f"its initial state {tuple(h.shape)} does not hold the {n} examples"
    return None


def _initial(call: Call, n: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    m = call.module
    rows = m.num_layers * (2 if m.bidirectional else 1)
    out_size = m.proj_size or m.hidden_size
    hx = call.inputs.get("hx")
    if isinstance(hx, (tuple, list)):
        return hx[0].detach(), hx[1].detach()
    h0 = hx.detach() if isinstance(hx, Tensor) else torch.zeros(rows, n, out_size, dtype=dtype,
                                                       device=device)
    return h0, torch.zeros(rows, n, m.hidden_size, dtype=dtype, device=device)


def _linear(x: Tensor, m: nn.Module, kind: str, suffix: str) -> Tensor:
    out = x @ getattr(m, f"weight_{kind}{suffix}").detach().to(x.dtype).T
    if m.bias:
        out = out + getattr(m, f"bias_{kind}{suffix}").detach().to(x.dtype)
    return out


class _Direction:
    """One layer and direction of the rerun, with what the forms need."""

    def __init__(self, suffix: str, x: Tensor, gi: Tensor) -> None:
        self.suffix, self.x, self.gi = suffix, x, gi
        self.h_prev: list[Tensor] = []  # h_{t−1} for each t, in time order
        self.gh: list[Tensor] = []  # GRU: hidden-side pre-activations, in time order
        self.h_proj: list[Tensor] = []  # LSTM projection outputs, in time order
        self.m: list[Tensor] = []  # LSTM projection inputs, in time order


def _step(m: nn.Module, d: _Direction, t: int, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    gi = d.gi[:, t]
    gh = _linear(h, m, "hh", d.suffix)
    if m.mode == "GRU":
        if not gh.requires_grad:  # the first step from a state that needs no gradient
            gh.requires_grad_()
        d.gh.append(gh)
        ir, iz, i_n = gi.chunk(3, dim=1)
        hr, hz, h_n = gh.chunk(3, dim=1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        new = torch.tanh(i_n + r * h_n)
        return (1 - z) * new + z * h, c
    if m.mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        if m.proj_size:
            d.m.append(h)
            h = h @ getattr(m, f"weight_hr{d.suffix}").detach().to(h.dtype).T
            d.h_proj.append(h)
        return h, c
    pre = gi + gh
    return (torch.tanh(pre) if m.mode == "RNN_TANH" else torch.relu(pre)), c


def _rerun(call: Call, x: Tensor) -> tuple[list[_Direction], list[Tensor]]:
    """The recurrence on batch-first ``x``: its directions and [output, h_n, c_n]."""
    m, n, steps = call.module, x.shape[0], x.shape[1]
    directions = 2 if m.bidirectional else 1
    h0, c0 = _initial(call, n, x.dtype, x.device)
    layer_input, runs, h_last, c_last = x, [], [], []
    for layer in range(m.num_layers):
        outputs = []
        for direction in range(directions):
            suffix = _suffix(layer, direction)
            gi = _linear(layer_input, m, "ih", suffix)  # a leaf in the first layer only
            if not gi.requires_grad:
                gi.requires_grad_()
            d = _Direction(suffix, layer_input, gi)
            row = layer * directions + direction
            h, c = h0[row], c0[row]
            order = range(steps) if direction == 0 else range(steps - 1, -1, -1)
            hs: list[Tensor | None] = [None] * steps
            for t in order:
                d.h_prev.append(h)
                h, c = _step(m, d, t, h, c)
                hs[t] = h
            if direction:  # the lists were filled in processing order: put them in time order
                for items in (d.h_prev, d.gh, d.h_proj, d.m):
                    items.reverse()
            outputs.append(torch.stack(hs, dim=1))  # type: ignore[arg-type]
            h_last.append(h)
            c_last.append(c)
            runs.append(d)
        layer_input = torch.cat(outputs, dim=2) if directions == 2 else outputs[0]
    return runs, [layer_input, torch.stack(h_last), torch.stack(c_last)]


@register_rule(nn.RNN, nn.GRU, nn.LSTM, params=_params, example_axis=_batch_axis,
               unsupported=_unsupported)
def recurrent_rule(call: Call) -> dict[str, PerExampleGrad]:
    m = call.module
    x = call.input.detach()  # rerun from it with grad enabled: not into the model's graph
    x = x if m.batch_first else x.transpose(0, 1)
    grads = [g if m.batch_first or k else g.transpose(0, 1) for k, g in enumerate(call.grads)]
    with torch.enable_grad():
        runs, outputs = _rerun(call, x)
        wanted = [(d, kind, t) for d in runs for kind, t in _leaves(m, d)]
        found = torch.autograd.grad(
            outputs[: len(grads)], [t for _, _, t in wanted], grads, allow_unused=True
        )
    deltas: dict[tuple[str, str], list[Tensor]] = {}
    for (d, kind, t), g in zip(wanted, found, strict=True):
        deltas.setdefault((d.suffix, kind), []).append(torch.zeros_like(t) if g is None else g)
    forms: dict[str, PerExampleGrad] = {}
    for d in runs:
        s = d.suffix
        d_gi = deltas[(s, "gi")][0]
        d_gh = torch.stack(deltas[(s, "gh")], dim=1) if m.mode == "GRU" else d_gi
        forms[f"weight_ih{s}"] = Outer(d_gi, d.x.detach(), autograd_terms=False)
        forms[f"weight_hh{s}"] = Outer(d_gh, torch.stack(d.h_prev, dim=1).detach(),
                                        autograd_terms=False)
        if m.bias:
            forms[f"bias_ih{s}"] = Dense(d_gi.sum(dim=1))
            forms[f"bias_hh{s}"] = Dense(d_gh.sum(dim=1))
        if m.proj_size:
            d_h = torch.stack(deltas[(s, "h_proj")], dim=1)
            forms[f"weight_hr{s}"] = Outer(d_h, torch.stack(d.m, dim=1).detach(),
                                            autograd_terms=False)
    return {k: v for k, v in forms.items() if getattr(m, k).requires_grad}


def _leaves(m: nn.Module, d: _Direction) -> list[tuple[str, Tensor]]:
    leaves = [("gi", d.gi)]
    if m.mode == "GRU":
        leaves += [("gh", t) for t in d.gh]
    if m.proj_size:
        leaves += [("h_proj", t) for t in d.h_proj]
    return leaves
