"""Reading an op call's arguments by name, from the op's own schema.

An FX node holds a call's arguments as it was traced: some positional, some by keyword, trailing
defaults left out. :func:`bound` gives them all by name, so a pass reads ``call.window`` rather
than ``node.args[8]``, and adding an argument to an op touches its schema and its typed call
only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def bound(node: fx.Node, op: torch._ops.OpOverload) -> dict[str, Any]:
    """Every argument of ``node`` (a call of ``op``) by its schema name, defaults filled in."""
    if node.target is not op:
        raise TypeError(f"{node.format_node()} is not a call of {op}")
    out = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise TypeError(f"{node.format_node()} lacks argument {arg.name!r} of {op}")
    return out


def position(op: torch._ops.OpOverload, name: str) -> int:
    """Where argument ``name`` of ``op`` stands in a positional call."""
    names = [a.name for a in op._schema.arguments]
    if name not in names:
        raise KeyError(f"{op} has no argument {name!r} (it has {', '.join(names)})")
    return names.index(name)


def calls(graph: fx.Graph, op: torch._ops.OpOverload) -> list[fx.Node]:
    return list(graph.find_nodes(op="call_function", target=op))


class OpCall:
    """Base of a typed call: a frozen dataclass whose fields after ``node`` are ``OP``'s arguments."""

    OP: torch._ops.OpOverload

    @classmethod
    def of(cls, node: fx.Node):
        return cls(node, **bound(node, cls.OP))

    @classmethod
    def matches(cls, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target is cls.OP

    @classmethod
    def all_in(cls, graph: fx.Graph) -> list:
        """Every call of ``OP`` in ``graph``, in graph order."""
        return [cls.of(n) for n in calls(graph, cls.OP)]

    @classmethod
    def position(cls, name: str) -> int:
        """Where argument ``name`` stands in the node's ``args`` (for rewriting a call)."""
        return position(cls.OP, name)
