"""The typed calls of afdc's kernel ops: a node's arguments by name, and new calls emitted from them.

An op's arguments are a frozen dataclass too: its fields give the op its signature
(:func:`takes_arguments_of`), so the op, its reference and its launcher declare them once.
A graph pass reads an op's node as a frozen dataclass (``FusedMoeCall.of(node)``), changes what it
must, and emits the changed call; arguments left at their defaults stay out of the new node, so
graphs read the same whatever the op's optional arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
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


def takes_arguments_of(cls: type, **keyword_only: object) -> Callable[[Callable], Callable]:
    """Gives a ``(*args, **kwargs)`` function the signature of ``cls``'s fields (plus keyword-only
    ``keyword_only`` with their defaults), returning a tensor: what ``inspect`` shows, and what
    ``torch.library.custom_op`` reads the op's schema from."""
    base = inspect.signature(cls)
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation="int | None")
             for n, d in keyword_only.items()]

    def wrap(fn: Callable) -> Callable:
        fn.__signature__ = base.replace(parameters=[*base.parameters.values(), *extra],
                                        return_annotation="torch.Tensor")
        return fn

    return wrap
