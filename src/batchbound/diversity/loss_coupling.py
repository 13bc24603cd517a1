"""Whether a loss written outside the model couples the batch's examples, read off its own
graph before its backward (``watch`` sees the loss only as the graph from it to the model's
outputs, never as a function it could call on each example apart).

A loss that is a sum of per-example terms, L = Σ_i ℓ_i(out_i), has a block-diagonal
Hessian in the outputs: ∂²L/∂out_i∂out_j = 0 for i ≠ j, exactly, since no operation of its
graph reads two examples' rows together. InfoNCE, in-batch negatives, CLIP's two-way
softmax, a batch's mean subtracted inside the loss all fill the blocks off the diagonal. So
one Hessian-vector product, with a random vector on a random half of the examples, is zero
on the other half for a per-example loss and not for these (double backward through the
loss's part of the graph only: the model's is not run). It runs once per way the loss is
written (``loss_graph``: its operations apart from sizes, and which each reads), on the
first step that writes it so.

Not seen: a coupling with no second derivative (the hardest example of the batch picked by
a max, top-k mining; its choice is piecewise constant), and a loss whose graph has no double
backward (a fused kernel, a custom ``autograd.Function``): then the check says it could not
look (``UNCHECKED``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from batchbound.diversity.graph import Node
from batchbound.diversity.rows import graph_structure, operations
from batchbound.diversity.rule_check import tolerance

UNCHECKED = "unchecked"


def loss_coupling(loss: Tensor, gradient: Tensor | None, nodes: list[Node],
                  outputs: list[Tensor], fixed: frozenset[int], n: int) -> str | None:
    """None where ``loss`` (backpropagated with ``gradient``, as ``loss.backward(gradient)``;
    its graph's ``nodes``: ``loss_graph``) is a sum of per-example
    terms of the model's ``outputs`` that hold its ``n`` examples along dim 0 (not those at
    the ``fixed`` positions), ``UNCHECKED`` where this cannot be read, else what couples
    them. Both derivatives are taken at the edges from the loss's nodes into the outputs, so
    no node of the model runs (nor the rules' hooks on them): where one would (an output
    the loss reads computed from another it reads), it is not taken (``UNCHECKED``). The
    graph is left for the user's backward."""
    if n < 2 or not nodes:  # no nodes: the loss is one of the outputs, the row tracker's
        return None
    if any(isinstance(node, BackwardCFunction) for node in nodes):
        # a custom autograd.Function: its backward may run no differentiable operation
        # (once_differentiable, a kernel), whose second derivative then reads as zero
        return UNCHECKED
    position = {(t.grad_fn, t.output_nr): k for k, t in enumerate(outputs)
                if t.grad_fn is not None}
    inside = set(nodes)
    edges: dict[tuple[Node, int], int | None] = {}
    for node in nodes:
        for child, nr in node.next_functions:
            if child is None or child in inside:
                continue
            if hasattr(child, "variable"):  # a parameter in the loss: refused as such
                return None
            edges[(child, nr)] = position.get((child, nr))
    held = [j for j, k in enumerate(edges.values()) if k is not None and k not in fixed
            and outputs[k].is_floating_point() and outputs[k].dim() > 0
            and outputs[k].shape[0] == n]
    if not held:
        return None
    targets = {node for node, _ in edges}
    if _below_another(targets):  # the derivative at that edge would run the model's nodes
        return UNCHECKED
    inputs = [GradientEdge(node, nr) for node, nr in edges]
    try:
        with torch.enable_grad():
            grads = torch.autograd.grad(loss, inputs, gradient, create_graph=True,
                                        retain_graph=True, allow_unused=True)
            held = [j for j in held if grads[j] is not None and grads[j].requires_grad]
            if not held:  # linear in the outputs (aten's double backward raises where it
                return None  # is missing): no example's gradient reads another's
            device = grads[held[0]].device
            generator = torch.Generator(device=device).manual_seed(0)
            half = torch.randperm(n, generator=generator, device=device) < n // 2
            dot = sum((grads[j] * torch.randn(grads[j].shape, generator=generator,
                                              device=device, dtype=grads[j].dtype)
                       * _rows(half, grads[j])).sum() for j in held)
            products = torch.autograd.grad(dot, inputs, retain_graph=True, allow_unused=True)
    except RuntimeError:  # no double backward somewhere on the loss's graph
        return UNCHECKED
    on, off = 0.0, 0.0
    for j in held:
        if products[j] is not None:
            hv = products[j].detach().abs()
            on = max(on, float((hv * _rows(half, hv)).max()))
            off = max(off, float((hv * _rows(~half, hv)).max()))
    if off > tolerance(grads[held[0]].dtype) * on:
        return (f"the loss couples the batch's examples (its gradient for one example moves "
                f"with another's outputs, {off:.2g} against {on:.2g} for its own: InfoNCE, "
                "in-batch negatives, a batch statistic inside the loss), so the per-example "
                "norms would be no example's own gradient's; Δ needs a loss that is a sum of "
                "per-example terms")
    return None


def _below_another(targets: set[Node]) -> bool:
    """Whether one of the outputs' nodes the loss reads lies below another's in the model's
    graph (logits computed from a hidden state the loss also reads): the derivative at its
    edge would then run the nodes between them, and the rules' and the user's hooks on
    them. One walk of the model's graph below them, on the check's step only."""
    if len(targets) < 2:
        return False
    seen: set[Node] = set()
    stack = [child for node in targets for child, _ in node.next_functions
             if child is not None]
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return False


def loss_graph(root: Node, outputs: Sequence[Node]) -> tuple[list[Node], Hashable]:
    """The loss's own operations, from its root to the model's ``outputs`` (not into them,
    nor into a parameter's AccumulateGrad), in a fixed order, and what they are apart from
    sizes: each node's type with its saved arguments that are no size (``rows.operations``)
    and what each reads (a node of the loss, an output by position, a parameter), so that a
    loss written otherwise on a later step, or reading the outputs otherwise, is another."""
    stops = {node: k for k, node in enumerate(outputs)}
    order: dict[Node, int] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node in order or node in stops or hasattr(node, "variable"):  # AccumulateGrad
            continue
        order[node] = len(order)
        stack.extend(reversed([child for child, _ in node.next_functions if child is not None]))
    nodes = list(order)

    def read(child: Node | None) -> Hashable:
        if child is None:
            return None
        if child in order:
            return order[child]
        return ("output", stops[child]) if child in stops else "parameter"

    reads = tuple(tuple(read(child) for child, _ in node.next_functions) for node in nodes)
    return nodes, (operations((), graph_structure(nodes))[1], reads)


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    """The boolean mask over examples as a 0/1 factor broadcast over ``like``'s other axes."""
    return mask.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))
