"""Whether a loss written outside the model couples the batch's examples, read off its own
graph before its backward (``watch`` sees the loss only as the graph from it to the model's
outputs, never as a function it could call on each example apart).

A loss that is a sum of per-example terms, L = Σ_i ℓ_i(out_i), has a block-diagonal
Hessian in the outputs: ∂²L/∂out_i∂out_j = 0 for i ≠ j, exactly, since no operation of its
graph reads two examples' rows together. InfoNCE, in-batch negatives, CLIP's two-way
softmax, a batch's mean subtracted inside the loss all fill the blocks off the diagonal. So
a Hessian-vector product with a random vector on some of the examples is exactly zero on the
others for a per-example loss, and not for these. One product per bit of the examples'
index (in a random order): any two examples differ in a bit, so any pair the loss couples
is split by one of them (⌈log₂ n⌉ products, after one double backward; through the loss's
part of the graph only, the model's is not run). ``watch`` runs it on the 1st, 2nd, 4th,
8th, … step of each way the loss is written (``loss_graph``: its operations with their
sizes, and which each reads).

Not seen: a coupling with no second derivative (the hardest example of the batch picked by
a max, top-k mining; its choice is piecewise constant), and one the data switches on (a
mask of same-label pairs) only on steps between the checks. Not checked, with the reason
(``Coupling.checked`` false): a loss through a custom ``autograd.Function`` or with no double
backward, one with a user's hook on its tensors (``steps._LossWatch`` sees them made), one
reading an output and another made from it, an output with several axes of
the examples' size (the examples' own not known), and, on a GPU, one whose check would not
fit in the free memory (about 8 times the outputs it reads).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from batchbound.diversity.graph import Node
from batchbound.diversity.rows import graph_structure

# A per-example loss leaves the product exactly zero off the probed examples; a coupling
# leaves it at its own scale there (a batch's mean subtracted, at 512 examples: 2 % of it)
OFF_DIAGONAL = 1e-6
CHECK_MEMORY = 8  # the check's peak, in multiples of the outputs the loss reads


@dataclass(frozen=True)
class Coupling:
    """The check's answer where it is not "a per-example loss": ``checked`` and ``why`` the
    loss couples the examples, or not ``checked`` and ``why`` not."""

    checked: bool
    why: str


def loss_coupling(loss: Tensor, gradient: Tensor | None, nodes: list[Node],
                  outputs: list[tuple[Node | None, int, Tensor]], fixed: frozenset[int],
                  n: int) -> Coupling | None:
    """None where ``loss`` (backpropagated with ``gradient``, as ``loss.backward(gradient)``;
    its graph's ``nodes``: ``loss_graph``) is a sum of per-example terms of the model's
    outputs that hold its ``n`` examples (``outputs``: each one's node and output number as
    the forward left them, an in-place edit after it being the loss's, and the tensor; not
    those at the ``fixed`` positions, whose size does not follow the examples'; in the
    others the axis of size n holds them, dim 0 where several have it). Both derivatives are
    taken at the edges from the loss's nodes into the outputs, so no node of the model runs
    (nor the rules' hooks on them). The graph is left for the user's backward."""
    if n < 2 or not nodes:  # no nodes: the loss is one of the outputs, the row tracker's
        return None
    if any(isinstance(node, BackwardCFunction) for node in nodes):
        # its backward may run no differentiable operation (once_differentiable, a kernel),
        # whose second derivative then reads as zero
        return _unchecked("it runs a custom autograd.Function, whose second derivative "
                          "cannot be trusted")
    position = {(node, nr): k for k, (node, nr, _) in enumerate(outputs) if node is not None}
    inside = set(nodes)
    edges: dict[tuple[Node, int], int | None] = {}
    for node in nodes:
        for child, nr in node.next_functions:
            if child is None or child in inside:
                continue
            if hasattr(child, "variable"):  # a parameter in the loss: refused as such
                return None
            edges[(child, nr)] = position.get((child, nr))
    if None in edges.values():
        return _unchecked("it reads an output of the model's last operations that watch did "
                          "not see returned")
    tensors = [outputs[k][2] for k in edges.values()]  # type: ignore[index]
    # the examples' axis of each output that holds them (one whose size follows theirs)
    axes: dict[int, int] = {}
    for j, k in enumerate(edges.values()):
        if k in fixed or not tensors[j].is_floating_point():
            continue
        along = [d for d, size in enumerate(tensors[j].shape) if size == n]
        if len(along) > 1 and along[0] != 0:
            return _unchecked(f"which axis of an output of shape {tuple(tensors[j].shape)} "
                              f"holds the {n} examples is not known")
        if along:
            axes[j] = along[0]
    held = list(axes)
    if not held:
        return None
    if _below_another({node for node, _ in edges}):
        return _unchecked("it reads an output of the model and another computed from it, and "
                          "the check would run the model's operations between them")
    device = tensors[held[0]].device
    needed = CHECK_MEMORY * sum(tensors[j].numel() * tensors[j].element_size() for j in held)
    free = _free_bytes(device)
    if free is not None and free < needed:
        return _unchecked(f"the check would take about {needed / 2**30:.1f} GiB of the GPU's "
                          "free memory")
    inputs = [GradientEdge(node, nr) for node, nr in edges]
    try:
        with torch.enable_grad():
            grads = torch.autograd.grad(loss, inputs, gradient, create_graph=True,
                                        retain_graph=True, allow_unused=True)
            held = [j for j in held if grads[j] is not None and grads[j].requires_grad]
            if not held:  # linear in the outputs (aten's double backward raises where it
                return None  # is missing): no example's gradient reads another's
            return _products([(j, grads[j], axes[j]) for j in held],  # type: ignore[misc]
                             inputs, n, device)
    except RuntimeError as exc:  # no double backward somewhere on the loss's graph
        return _unchecked(f"its graph has no second derivative ({str(exc)[:120]})")


def _products(grads: list[tuple[int, Tensor, int]], inputs: list[GradientEdge], n: int,
              device: torch.device) -> Coupling | None:
    """One Hessian-vector product per bit of the examples' index, in a random order: the
    loss's gradients at the ``inputs`` (by their position there, with the examples' axis),
    times random numbers on the examples whose code has the bit, differentiated again."""
    generator = torch.Generator(device=device).manual_seed(0)
    code = torch.randperm(n, generator=generator, device=device)
    for bit in range(max(1, math.ceil(math.log2(n)))):
        probed = (code >> bit) & 1 == 1
        dot = sum((g * torch.randn(g.shape, generator=generator, device=device, dtype=g.dtype)
                   * _rows(probed, g, axis)).sum() for _, g, axis in grads)
        products = torch.autograd.grad(dot, inputs, retain_graph=True, allow_unused=True)
        on, off = 0.0, 0.0
        for j, _, axis in grads:
            if products[j] is not None:
                hv = products[j].detach().abs()
                on = max(on, float((hv * _rows(probed, hv, axis)).max()))
                off = max(off, float((hv * _rows(~probed, hv, axis)).max()))
        if off > OFF_DIAGONAL * on:
            return Coupling(True, (
                f"the loss couples the batch's examples (its gradient for one example moves "
                f"with another's outputs, {off:.2g} against {on:.2g} for its own: InfoNCE, "
                "in-batch negatives, a batch statistic inside the loss), so the per-example "
                "norms would be no example's own gradient's; Δ needs a loss that is a sum of "
                "per-example terms"))
    return None


def _free_bytes(device: torch.device) -> int | None:
    """A GPU's free memory; None elsewhere (the host's is not bounded here)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def _unchecked(why: str) -> Coupling:
    return Coupling(False, why)


def loss_graph(root: Node, outputs: Sequence[Node]) -> tuple[list[Node], Hashable]:
    """The loss's own operations, from its root to the model's ``outputs`` (not into them,
    nor into a parameter's AccumulateGrad), in a fixed order, and what they are: each node's
    type with its saved arguments, sizes included (``rows.graph_structure``: a pair loss
    whose pairs the data chooses reads them at other sizes), and what each reads (a node of
    the loss, an output by position, a parameter), so that a loss written otherwise on a
    later step, or reading the outputs otherwise, is another."""
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
    return nodes, (graph_structure(nodes), reads)


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


def _rows(mask: Tensor, like: Tensor, axis: int) -> Tensor:
    """The boolean mask over examples as a 0/1 factor along ``like``'s ``axis``, broadcast
    over its other axes."""
    shape = [1] * like.dim()
    shape[axis] = -1
    return mask.to(like.dtype).reshape(shape)
