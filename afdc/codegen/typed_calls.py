"""The typed calls of afdc's kernel ops: a node's arguments by name, and new calls emitted from them.

A graph pass reads an op's node as a frozen dataclass (``FusedMoeCall.of(node)``), changes what it
must, and emits the changed call; arguments left at their defaults stay out of the new node, so
graphs read the same whatever the op's optional arguments.
"""

from __future__ import annotations

from dataclasses import fields

import torch.fx as fx

from afdc.ops.call import OpCall


class EmittedCall(OpCall):
    """An :class:`OpCall` that also writes calls: the schema's arguments without a default are
    positional, the others keywords, and only where they differ from the dataclass default."""

    @classmethod
    def emit(cls, graph: fx.Graph, **arguments) -> fx.Node:
        """A new call; arguments left at their defaults are left out of the node."""
        schema = cls.OP._schema.arguments
        required = [a.name for a in schema if not a.has_default_value()]
        args = tuple(arguments[n] for n in required)
        defaults = {f.name: f.default for f in fields(cls) if f.name not in required}
        kwargs = {k: v for k, v in arguments.items() if k not in required and v != defaults[k]}
        return graph.call_function(cls.OP, args, kwargs)

    def arguments(self) -> dict:
        """Every argument by name, to emit a changed call (``emit(graph, **{**call.arguments(), ...})``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "node"}
