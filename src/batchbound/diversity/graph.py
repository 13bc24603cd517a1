"""Reading the autograd graph of one forward pass through torch's public Node API
(``grad_fn``, ``next_functions``, ``AccumulateGrad.variable``, ``register_prehook``).

The graph is the ground truth of where a parameter's gradient comes from: every operation
that used the parameter has an edge into its AccumulateGrad node. The hooks engine trusts a
layer rule for a parameter only if each of those operations lies inside a call of a module
whose rule covers the parameter, so a weight also used through ``F.linear``, ``@`` or
indexing elsewhere is caught however it was written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Node = Any  # torch.autograd.graph.Node; C++ nodes have no common Python class to annotate
Edge = tuple[Node, int]  # (consumer node, index of the edge among its next_functions)

# Operations that only re-view their input: the gradient of their output, reshaped, is the
# gradient of their input, entry for entry.
VIEW_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward2", "ReshapeAliasBackward0", "AliasBackward0",
    "CloneBackward0",
})
# Broadcasting operations whose gradient for one input is the output's gradient (times a
# constant), summed over the broadcast dimensions.
BROADCAST_NODES = frozenset({"AddBackward0", "SubBackward0", "ExpandBackward0"})


def name_of(node: Node) -> str:
    return type(node).__name__


def is_accumulator(node: Node) -> bool:
    return hasattr(node, "variable")


def walk(roots: Iterable[Node]) -> tuple[list[Node], dict[Node, list[Edge]]]:
    """Every node reachable from ``roots``, and for each node the edges that point to it."""
    seen: set[Node] = set()
    order: list[Node] = []
    users: dict[Node, list[Edge]] = {}
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        for index, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            users.setdefault(child, []).append((node, index))
            if child not in seen:
                stack.append(child)
    return order, users


def parameter_users(nodes: Iterable[Node], names: dict[int, str]) -> dict[str, list[Node]]:
    """For each parameter (``names``: id of the tensor -> name), the nodes that use it."""
    found: dict[str, list[Node]] = {}
    for node in nodes:  # every node, every step: is_accumulator inline (host time)
        for child, _ in node.next_functions:
            if child is not None and hasattr(child, "variable"):
                name = names.get(id(child.variable))
                if name is not None:
                    found.setdefault(name, []).append(node)
    return found


def region(outputs: Iterable[Node], stops: set[Node]) -> set[Node]:
    """The operations of one module call: nodes reachable from its outputs' nodes without
    entering its inputs' nodes (``stops``) or any AccumulateGrad."""
    inside: set[Node] = set()
    stack = [node for node in outputs if node is not None]
    while stack:  # once per node of every call, every step: no calls inside (host time)
        node = stack.pop()
        if node in inside or node in stops or hasattr(node, "variable"):  # AccumulateGrad
            continue
        inside.add(node)
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)
    return inside


def loss_users(root: Node, outputs: Iterable[Node], names: dict[int, str]) -> set[str]:
    """The parameters the loss itself uses, between the model's outputs and ``root``: uses
    that torch.func's ``functional_call`` (which swaps parameters inside the model's forward
    only) cannot see."""
    return set(parameter_users(region([root], set(outputs)), names))


def broadcast_chain(start: Node, users: dict[Node, list[Edge]]) -> tuple[list[Node], Edge] | None:
    """From a node whose output has no example axis, follow its only user through re-viewing
    operations to a broadcasting one: (the re-viewing nodes, (broadcast node, edge index)),
    or None when the path branches or meets any other operation."""
    chain: list[Node] = []
    node = start
    while True:
        edges = users.get(node, [])
        if len(edges) != 1:
            return None
        user, index = edges[0]
        if name_of(user) in BROADCAST_NODES:
            if sum(1 for child, _ in user.next_functions if child is node) != 1:
                return None  # x + x: both operands are ours
            return chain, (user, index)
        if name_of(user) not in VIEW_NODES:
            return None
        chain.append(user)
        node = user


def broadcast_factor(edge: Edge) -> float:
    """The constant the broadcast node multiplies the gradient by on this edge."""
    node, index = edge
    if name_of(node) == "ExpandBackward0" or index == 0:
        return 1.0
    alpha = float(getattr(node, "_saved_alpha", 1.0))
    return -alpha if name_of(node) == "SubBackward0" else alpha
