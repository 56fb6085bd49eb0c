"""Re-deriving symbolic sizes inside a new graph from the shapes of its own tensors.

A partitioned program cannot read a size computed in the other program; it recomputes it from
the shapes of tensors it has (``sym_size`` of its inputs), so that each program stays
shape-polymorphic on its own.
"""

from __future__ import annotations

import operator
from functools import reduce

import sympy
import torch
import torch.fx as fx

from afdc.errors import UnsupportedModelError


class SymEmitter:
    def __init__(self, graph: fx.Graph, sources: list[fx.Node]):
        self._graph = graph
        self._known: dict[sympy.Expr, tuple[fx.Node, int]] = {}
        self._emitted: dict[sympy.Expr, fx.Node | int] = {}
        for src in sources:
            for dim, size in enumerate(src.meta["val"].shape):
                if isinstance(size, torch.SymInt):
                    self._known.setdefault(size.node.expr, (src, dim))

    def emit(self, value: torch.SymInt | int) -> fx.Node | int:
        return self._emit(value.node.expr) if isinstance(value, torch.SymInt) else value

    def _emit(self, expr: sympy.Expr) -> fx.Node | int:
        if expr.is_Integer:
            return int(expr)
        if expr in self._emitted:
            return self._emitted[expr]
        if expr in self._known:
            src, dim = self._known[expr]
            out = self._graph.call_function(torch.ops.aten.sym_size.int, (src, dim))
        elif (factored := self._factor(expr)) is not None:
            out = factored
        elif expr.is_Mul or expr.is_Add:
            op = operator.mul if expr.is_Mul else operator.add
            parts = [self._emit(a) for a in expr.args]
            out = reduce(lambda x, y: self._graph.call_function(op, (x, y)), parts)
        else:
            raise UnsupportedModelError(f"the size {expr} cannot be recomputed from the values that cross the cut")
        self._emitted[expr] = out
        return out

    def _factor(self, expr: sympy.Expr) -> fx.Node | None:
        """``expr`` as a known size times an integer: ``2*b*s`` from a flattened ``[b*s, h]`` input."""
        for known in self._known:
            ratio = sympy.cancel(expr / known)
            if ratio.is_Integer:
                node = self._emit(known)
                return node if ratio == 1 else self._graph.call_function(operator.mul, (int(ratio), node))
        return None
