"""What the kernel-substitution passes share: walking a matched chain and swapping it for one op.

A substitution pass finds a computation structurally (by ops and data flow, never by module
name), checks every condition that makes the kernel exact, and only then rewrites. Anything
short of an exact match raises :class:`NoMatch` with the reason; the pass logs it and leaves the
nodes alone, so a pattern it does not know costs speed, never correctness.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from afdc.passes.graph_facts import op_name

logger = logging.getLogger("afdc.fusion")


class NoMatch(Exception):
    """A candidate that is not exactly the pattern; the message says why."""


@dataclass
class FusionReport:
    """How many of each kernel a pass put in, and the candidates it left alone (with why)."""

    fused: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def add(self, kind: str) -> None:
        self.fused[kind] = self.fused.get(kind, 0) + 1

    def merge(self, other: FusionReport) -> FusionReport:
        for kind, count in other.fused.items():
            self.fused[kind] = self.fused.get(kind, 0) + count
        self.skipped += other.skipped
        return self


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A graph of the same nodes, to rewrite without touching ``graph``."""
    copy = fx.Graph()
    copy._codegen = graph._codegen
    copy.output(copy.graph_copy(graph, {}))
    return copy


def expect(condition: bool, reason: str) -> None:
    if not condition:
        raise NoMatch(reason)


def arg(node: fx.Node, index: int, name: str, default=None):
    """Argument ``index`` of ``node``, given by position or as keyword ``name``."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def only_user(node: fx.Node) -> fx.Node:
    """The single user of ``node`` (a pattern's inner values must not be read elsewhere)."""
    expect(len(node.users) == 1, f"{node.name} is used outside the pattern")
    return next(iter(node.users))


def val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def constant_factor(node) -> float | None:
    """``c`` when ``node`` is ``x * c`` or ``x / (1 / c)`` for a finite number ``c`` (a routed
    scaling factor): a scaling that keeps a zero row zero."""
    name = op_name(node) if isinstance(node, fx.Node) else ""
    c = node.args[1] if name in ("mul", "div") and len(node.args) == 2 else None
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c) or (name == "div" and c == 0):
        return None
    return float(c) if name == "mul" else 1.0 / c


def strip_float_casts(node):
    """``node`` past the casts that change no value: to float32 from a floating type (the half
    types the kernels read and widen themselves), or to the dtype it already has (transformers'
    ``x.to(weight.dtype)`` in a model loaded in bf16)."""
    while isinstance(node, fx.Node) and op_name(node) in ("to", "_to_copy", "type_as"):
        source, cast = val(node.args[0]), val(node)
        if source is None or cast is None:
            break
        widened = cast.dtype == torch.float32 and source.is_floating_point()
        if not (widened or cast.dtype == source.dtype):
            break
        node = node.args[0]
    return node


def erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase ``nodes`` and then their inputs, as far as nothing else reads them.

    Unlike dead-code elimination this also erases in-place ops of a matched chain (the unsort's
    ``index_put_``, a group mask's ``scatter_``), but only where the tensor they write is read by
    nothing else, so no live value loses a write.
    """
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        name = op_name(node)
        if name.endswith("_") and isinstance(node.args[0], fx.Node) and len(node.args[0].users) > 1:
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        stack += inputs


def run_matches(
    graph: fx.Graph, kind: str, anchors: list[fx.Node], rewrite: Callable[[fx.Node], str | None]
) -> FusionReport:
    """``rewrite`` each anchor that matches; log and keep the others. A rewrite may return the kind
    it put in, where one anchor leads to several."""
    report = FusionReport()
    for anchor in anchors:
        if anchor not in set(graph.nodes):  # erased with an earlier match
            continue
        try:
            done = rewrite(anchor)
        except NoMatch as why:
            report.skipped.append(f"{kind} at {anchor.name}: {why}")
            logger.debug("afdc backend: %s at %s left to Inductor: %s", kind, anchor.name, why)
        else:
            report.add(done or kind)
    return report


def activation_of(node: fx.Node) -> str:
    """The kernels' name for a ``silu`` or ``gelu`` node's activation."""
    if op_name(node) == "silu":
        return "silu"
    approximate = arg(node, 1, "approximate", "none")
    expect(approximate in ("none", "tanh"), f"gelu approximation {approximate!r}")
    return "gelu" if approximate == "none" else "gelu_tanh"
