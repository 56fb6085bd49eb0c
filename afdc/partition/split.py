"""Partition: split the captured graph at the cuts into an attention and an FFN program.

The attention program is the captured graph without the FFN nodes, with an ``afdc::send`` where
all of a layer's FFN inputs exist (as early as possible) and an ``afdc::recv`` right before the
first use of each FFN output (as late as possible). Each FFN region becomes a segment graph
``(weights..., inputs...) -> outputs``; regions with the same structure share one segment graph
and differ only in the weights bound to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from afdc import segment
from afdc.errors import UnsupportedModelError
from afdc.ops import RecvCall, SendCall
from afdc.partition.cut import Cut
from afdc.partition.symbolic import SymEmitter
from afdc.passes import graph_facts as gf
from afdc.segment import SegmentBinding


@dataclass
class Partition:
    attention_graph: fx.Graph
    segments: list[fx.Graph]
    layers: list[SegmentBinding]  # indexed by FFN layer (cut) index
    origins: list[list[fx.Node]]  # per FFN layer: the captured nodes its segment's v0, v1, ... compute


def _copy(graph: fx.Graph, node: fx.Node, lookup, name: str | None = None) -> fx.Node:
    args = fx.map_arg(node.args, lookup)
    kwargs = fx.map_arg(node.kwargs, lookup)
    new = graph.create_node(node.op, node.target, args, kwargs, name=name or node.name)
    new.meta = dict(node.meta)
    return new


def build_attention_graph(graph: fx.Graph, cuts: list[Cut]) -> fx.Graph:
    ffn_nodes = {n for c in cuts for n in c.ffn_nodes}
    returned = {n: (c, i) for c in cuts for i, n in enumerate(c.to_attn)}
    waiting = {c.region.index: set(c.to_ffn) for c in cuts}
    needs = {}  # value -> the layers whose send waits for it
    for c in cuts:
        for v in c.to_ffn:
            needs.setdefault(v, []).append(c)

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    tickets: dict[int, fx.Node] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    emitter = SymEmitter(new, [])

    lazy = _reshapes_of(graph, returned, ffn_nodes, needs)

    def lookup(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        if n in lazy:
            place(n)
            return env[n]
        if n in returned:
            cut, i = returned[n]
            layer = cut.region.index
            shape = [emitter.emit(d) for d in n.meta["val"].shape]
            env[n] = RecvCall.emit(new, tickets[layer], layer, i, shape, n.meta["val"].dtype)
            env[n].meta["val"] = n.meta["val"]
            return env[n]
        if isinstance(n.meta.get("val"), torch.SymInt):
            return emitter.emit(n.meta["val"])
        raise UnsupportedModelError(f"the attention program needs {gf.where(n)}, which the cut left on the FFN side")

    def waits(node: fx.Node) -> bool:
        unsent = (p in returned and returned[p][0].region.index not in tickets for p in node.all_input_nodes)
        inputs = node.all_input_nodes
        return any(unsent) or any(p in deferred or (p in lazy and waits(p)) for p in inputs)

    def place(node: fx.Node) -> bool:
        """Copy ``node``; whether that emitted a send."""
        nonlocal emitter
        env[node] = _copy(new, node, lookup)
        if node.op == "placeholder" and node is placeholders[-1]:
            emitter = SymEmitter(new, [env[p] for p in placeholders])
        sent = False
        for cut in needs.get(node, ()):
            pending = waiting[cut.region.index]
            pending.discard(node)
            if not pending:
                layer = cut.region.index
                tickets[layer] = SendCall.emit(new, [env[v] for v in cut.to_ffn], layer)
                sent = True
        return sent

    # Graph order, except that a node reading a layer's FFN output waits for that layer's send
    # (a branch that reads it may come before the last FFN input is made, when the FFN side
    # returns partial sums for the attention side to normalize).
    deferred: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if node in ffn_nodes or node in lazy:
            continue
        if waits(node):
            deferred[node] = None
            continue
        if place(node):
            while ready := next((d for d in deferred if not waits(d)), None):
                del deferred[ready]
                place(ready)
    if deferred:  # they wait for a send that waits for them
        cut = next(returned[p][0] for d in deferred for p in d.all_input_nodes if p in returned)
        raise UnsupportedModelError("an FFN input depends on an FFN output of the same layer", cut.region.label)
    new.eliminate_dead_code()
    new.lint()
    return new


# ops that only reshape or cast a value: placed where their result is first used
_RESHAPES = (
    torch.ops.aten.view, torch.ops.aten.reshape, torch.ops.aten._unsafe_view, torch.ops.aten.unsqueeze,
    torch.ops.aten.squeeze, torch.ops.aten.flatten, torch.ops.aten.to, torch.ops.aten._to_copy, torch.ops.aten.alias,
)


def _reshapes_of(graph: fx.Graph, returned, ffn_nodes: set[fx.Node], needs) -> set[fx.Node]:
    """The attention-side nodes that only reshape or cast an FFN output (or such a reshape), and
    are no FFN input: copied where first used, so that their FFN output is received as late as
    the computation allows. A branch added to the stream past later sub-layers (a
    shortcut-connected MoE) then runs on the FFN side while the attention side computes those."""
    lazy: set[fx.Node] = set()
    for node in graph.nodes:
        if node in ffn_nodes or node in needs or not gf.is_op(node, *_RESHAPES):
            continue
        tensors = [p for p in node.all_input_nodes if gf.is_tensor(p)]
        if len(tensors) == 1 and (tensors[0] in returned or tensors[0] in lazy):
            lazy.add(node)
    return lazy


def _segment_closure(cut: Cut, free: set[fx.Node]) -> list[fx.Node]:
    """The FFN nodes plus what they recompute locally: the input-independent values they need,
    and the reshapes of received values that the cut redoes."""
    keep = {*cut.ffn_nodes, *cut.redone}
    stack = list(keep)
    while stack:
        for p in stack.pop().all_input_nodes:
            if p not in keep and p in free and (p.op == "get_attr" or gf.holds_tensors(p)):
                keep.add(p)
                stack.append(p)
    return [n for n in cut.ffn_nodes[0].graph.nodes if n in keep]


def extract_segment(cut: Cut, free: set[fx.Node]) -> tuple[fx.Graph, list[str], list[fx.Node]]:
    """One FFN region as ``(w0.., x0..) -> outputs`` with canonical node names, its weights' names
    and the captured nodes behind ``v0, v1, ...``."""
    closure = _segment_closure(cut, free)
    computed = [x for x in closure if x.op != "get_attr"]
    weights = [n for n in closure if n.op == "get_attr"]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, w in enumerate(weights):
        env[w] = segment.add_weight(g, i)
        env[w].meta = dict(w.meta)
    for i, x in enumerate(cut.to_ffn):
        env[x] = segment.add_input(g, i)
        env[x].meta = dict(x.meta)
    emitter = SymEmitter(g, [env[x] for x in cut.to_ffn])

    def lookup(n: fx.Node):
        if n in env:
            return env[n]
        if isinstance(n.meta.get("val"), torch.SymInt):
            return emitter.emit(n.meta["val"])
        raise UnsupportedModelError(f"FFN segment needs {gf.where(n)} from the attention side", cut.region.label)

    for k, n in enumerate(computed):
        env[n] = _copy(g, n, lookup, name=f"v{k}")
    g.output(tuple(env[n] for n in cut.to_attn))
    g.eliminate_dead_code()
    g.lint()
    return g, [w.target for w in weights], computed


def _structure_key(graph: fx.Graph) -> tuple:
    code = graph.python_code("self").src
    shapes = tuple(
        (tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in graph.nodes if n.op == "placeholder"
    )
    return code, str(shapes)


def partition(graph: fx.Graph, cuts: list[Cut]) -> Partition:
    free = gf.data_free(graph)
    segments: list[fx.Graph] = []
    keys: dict[tuple, int] = {}
    layers, origins = [], []
    for cut in cuts:
        seg, weights, computed = extract_segment(cut, free)
        key = _structure_key(seg)
        if key not in keys:
            keys[key] = len(segments)
            segments.append(seg)
        layers.append(SegmentBinding(keys[key], weights))
        origins.append(computed)
    return Partition(build_attention_graph(graph, cuts), segments, layers, origins)
