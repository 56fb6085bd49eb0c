"""A program cut at its sends to the FFN side into pieces, each to be compiled on its own.

A program compiled whole (Inductor) is one call that cannot pause, so a step's micro-batches
could only take turns at its sends from threads of their own. Cut after each ``afdc::send``,
it becomes pieces (piece k runs from the reply of send k-1, its ``afdc::recv``, through send
k) called in order by a straight-line parent (:mod:`afdc.lowering.straight_line`) that pauses
after every piece ending in a send: one thread then interleaves the micro-batches, as it does
the eager backend's code. It is the cut vLLM's piecewise compilation makes at attention, here
at the exchange, and each piece is what a CUDA graph could hold per token bucket.

The cut follows the graph's order, which is topological, so a piece reads only the program's
inputs and values of earlier pieces; those it reads are passed in, and each piece returns the
values later pieces (or the output) read. Weights stay ``get_attr`` nodes of every piece that
reads them: a compiler sees them as the module's attributes, not as inputs of the piece.

:func:`split_at_exchange` cuts before and after every send and receive instead: each exchange op
is a piece of its own (:attr:`Piece.exchange`), which talks to the host-side connector, and the
pieces between them compute only, which is what a CUDA graph can hold
(:mod:`afdc.runtime.decode_graphs`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx

from afdc.ops import RecvCall, SendCall


@dataclass(eq=False)
class Piece:
    """One piece: called with the values it reads from outside it (as its module's placeholders
    name them), it returns the tuple of its values that later pieces or the output read. ``run``
    is what runs :attr:`module`: the module itself until the lowering sets its compiled form."""

    module: fx.GraphModule
    sends: bool  # ends in a send: the parent may pause after it
    name: str
    exchange: bool = False  # one send or receive alone (split_at_exchange): it talks to the connector
    run: Callable = field(init=False)

    def __post_init__(self):
        self.run = self.module
        self.__name__ = self.name  # the parent's code calls the piece by this name

    def __call__(self, *args):
        return self.run(*args)


def pauses_after_piece(node: fx.Node) -> bool:
    """Whether the parent may pause after ``node``: a call of a piece that ends in a send."""
    return isinstance(node.target, Piece) and node.target.sends


def split_at_sends(module: fx.GraphModule) -> tuple[fx.GraphModule, list[Piece]] | None:
    """``module`` as a parent that calls its pieces (``call_function`` nodes whose target is a
    :class:`Piece`), and the pieces in order; None where the program sends nothing."""
    return _split(module, lambda node: False)


def split_at_exchange(module: fx.GraphModule) -> tuple[fx.GraphModule, list[Piece]] | None:
    """As :func:`split_at_sends`, but each ``afdc::send`` and ``afdc::recv`` is a piece of its own."""
    return _split(module, lambda node: node.target in (SendCall.OP, RecvCall.OP))


def _split(module: fx.GraphModule, alone: Callable[[fx.Node], bool]) -> tuple[fx.GraphModule, list[Piece]] | None:
    """Pieces cut after each send, and around each node ``alone`` names."""
    graph = module.graph
    if not graph.find_nodes(op="call_function", target=SendCall.OP):
        return None
    cut: dict[fx.Node, int] = {}
    k, after = 0, False  # after: the next node starts a piece
    for node in graph.nodes:
        if node.op == "call_function":
            single = alone(node)
            k += bool(cut) and (after or single)
            cut[node] = k
            after = single or node.target is SendCall.OP
    count = max(cut.values()) + 1
    reads = [_reads(graph, cut, i) for i in range(count)]
    later = [{v for r in reads[i + 1:] for v in r} | set(graph.output_node().all_input_nodes) for i in range(count)]
    parent = fx.Graph()
    env = {n: parent.placeholder(n.name) for n in graph.find_nodes(op="placeholder")}
    for n, p in env.items():
        p.meta = dict(n.meta)
    pieces = []
    for i in range(count):
        members = [n for n in graph.nodes if cut.get(n) == i]
        returns = [n for n in members if n in later[i]]
        ends_in_send = members[-1].target is SendCall.OP
        single = len(members) == 1 and alone(members[0])
        piece = Piece(_piece_module(module, members, reads[i], returns), ends_in_send, f"piece_{i}", single)
        call = parent.call_function(piece, tuple(env[v] for v in reads[i]))
        for j, value in enumerate(returns):
            env[value] = parent.call_function(operator.getitem, (call, j), name=value.name)
            env[value].meta = dict(value.meta)
        pieces.append(piece)
    parent.output(fx.map_arg(graph.output_node().args[0], lambda v: env[v] if v in env else parent.get_attr(v.target)))
    return fx.GraphModule(module, parent), pieces


def _reads(graph: fx.Graph, cut: dict[fx.Node, int], i: int) -> list[fx.Node]:
    """The values piece ``i`` reads from outside it: program inputs and earlier pieces' values."""
    reads: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if cut.get(node) == i:
            for value in node.all_input_nodes:
                if value.op == "placeholder" or (value.op == "call_function" and cut[value] != i):
                    reads[value] = None
    return list(reads)


def _piece_module(
    module: fx.GraphModule, members: list[fx.Node], reads: list[fx.Node], returns: list[fx.Node]
) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in reads:
        env[value] = g.placeholder(value.name)
        env[value].meta = dict(value.meta)

    def arg(value: fx.Node) -> fx.Node:
        if value not in env:  # a weight: read where it is used
            env[value] = g.get_attr(value.target)
            env[value].meta = dict(value.meta)
        return env[value]

    for node in members:
        env[node] = g.node_copy(node, arg)
    g.output(tuple(env[v] for v in returns))
    return fx.GraphModule(module, g)
