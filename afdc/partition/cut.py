"""Cut selection: where the attention and FFN sides meet, by a min-cut over bytes per token.

Inside each FFN region the weight matrices are pinned to the FFN side, except those that only
compute the input of the largest one (routers, a hyper-connection's stream mixing), which lean
to it and go where the bytes say; everything the region reads from outside, or that is used
outside it, is pinned to the attention side, except what only the region reads (its feeders, see
:func:`_feeders`: experts chosen from the token ids), which the bytes place. Every other node may go
either way; a value costs its bytes per token when its producer and some consumer end up on
different sides (a hyperedge, cut at most once however many consumers it has). Among the cuts of
minimum cost we take the one with the smallest FFN side, so norms and other glue stay with the
residual stream: for a pre-norm layer the attention side sends the normed hidden state and
receives the FFN output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch
import torch.fx as fx

from afdc.errors import UnsupportedModelError
from afdc.partition.mincut import INF, FlowGraph
from afdc.partition.symbolic import SymEmitter
from afdc.passes import graph_facts as gf
from afdc.passes.classify import Classification, FFNRegion

_SOURCE, _SINK = "attention", "ffn"
# A weight matrix that only computes the input of the region's largest one (a router, a
# hyper-connection's stream mixing) leans to the FFN side by this much (it breaks ties); bytes
# decide where it goes. Every other matrix (projections, shared experts) is pinned there.
_PREFER_FFN = 1e-6
aten = torch.ops.aten
# Ops that only re-lay out a value; one on the boundary can move to the FFN side for free.
_RESHAPES = (aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.unsqueeze, aten.squeeze)


class RouterPlacement(str, Enum):
    FFN = "ffn"  # the FFN side routes: only hidden states cross
    ATTN = "attn"  # the attention side routes: top-k ids and weights cross with the hidden states


@dataclass
class Cut:
    """The FFN side of one region and the values that cross each way, in graph order."""

    region: FFNRegion
    ffn_nodes: list[fx.Node]
    to_ffn: list[fx.Node]
    to_attn: list[fx.Node]
    # reshapes of values in ``to_ffn`` that the FFN side redoes rather than receives (the
    # attention side computes them too, for a router there)
    redone: list[fx.Node] = field(default_factory=list)


def _router_parameters(region: FFNRegion, anc: dict[fx.Node, int], index: dict[fx.Node, int]) -> set[fx.Node]:
    topks = [n for n in region.nodes if gf.is_op(n, torch.ops.aten.topk)]
    return {p for p in region.nodes if p.op == "get_attr" and any(anc[t] >> index[p] & 1 for t in topks)}


def _readers(weight: fx.Node, free: set[fx.Node]) -> list[fx.Node]:
    """The nodes that apply ``weight`` (through its transposes and views) to activations."""
    found, stack = [], list(weight.users)
    while stack:
        n = stack.pop()
        if n in free:
            stack.extend(n.users)
        else:
            found.append(n)
    return found


def _feeding_the_largest(matrices: list[fx.Node], anc, index, free) -> set[fx.Node]:
    """The matrices whose every product feeds the product of the largest matrix: they compute
    its input (routing, stream mixing) rather than the FFN's output."""
    if not matrices:
        return set()
    largest = max(matrices, key=lambda m: m.meta["val"].numel())
    targets = _readers(largest, free)
    return {
        m
        for m in matrices
        if m is not largest
        and all(any(anc[t] >> index[r] & 1 for t in targets) for r in _readers(m, free))
    }


def _value_cost(node: fx.Node, tokens, free: set[fx.Node]) -> float:
    if node in free or isinstance(node.meta.get("val"), (tuple, list)):
        return INF  # weights never cross; multi-output ops stay with their getitems
    return gf.bytes_per_token(node, tokens) if gf.is_tensor(node) else 0.0


def _convex_closure(ffn: set[fx.Node], region: list[fx.Node], anc, index) -> set[fx.Node]:
    """Add every node lying on a path between two FFN nodes: one round trip per layer."""
    ffn_bits = gf.bitset(ffn, index)
    changed = True
    while changed:
        changed = False
        for n in region:
            if n in ffn:
                continue
            below_ffn = anc[n] & ffn_bits
            above_ffn = any(anc[f] >> index[n] & 1 for f in ffn)
            if below_ffn and above_ffn:
                ffn.add(n)
                ffn_bits |= 1 << index[n]
                changed = True
    return ffn


def _feeders(region: FFNRegion, free: set[fx.Node], positional: set[fx.Node], attention_side: set[fx.Node]
             ) -> list[fx.Node]:
    """The values computed outside the region that only the region reads, and those that only
    they and the region read, back to the graph's inputs: hash routing's ``table[input_ids]`` and
    the sort and offsets of its expert ids. Pinned to the attention side they would all cross (four
    id tensors and the offsets for DeepSeek-V4's hash-routed layers, where the token ids alone
    suffice), and a quantized MoE's experts must see their routing whole to run as one fused op.
    Not feeders: inputs, what either side recomputes, what the attention side must keep, and what
    is computed from the mask or positions (an FFN region never reads those)."""
    members = set(region.nodes)
    found: set[fx.Node] = set()
    grew = True
    while grew:
        grew = False
        for p in {p for n in (*members, *found) for p in n.all_input_nodes} - members - found:
            if p.op != "call_function" or p in free or p in attention_side or p in positional:
                continue
            if all(u in members or u in found or u in free or not u.users for u in p.users):
                found |= {p, *(u for u in p.users if not u.users)}  # a sort's unread output goes with it
                grew = True
    return list(found)


def cut_region(
    region: FFNRegion, graph_info: tuple, params: set[str], router: RouterPlacement, attention_side: set[fx.Node]
) -> Cut:
    anc, index, free, tokens, positional = graph_info
    if router is RouterPlacement.FFN:  # under --router attn the attention side routes, so it keeps the ids
        feeders = _feeders(region, free, positional, attention_side)
        if feeders:
            region = replace(region, nodes=sorted({*region.nodes, *feeders}, key=index.__getitem__))
    members = set(region.nodes)
    pinned_attn = _router_parameters(region, anc, index) if router is RouterPlacement.ATTN else set()
    pinned_attn |= members & attention_side
    flow = FlowGraph()

    def hyperedge(key, ends: list, cost: float) -> None:
        if cost == 0.0 or len(ends) < 2:
            return
        a, b = ("in", key), ("out", key)
        for e in ends:
            flow.add_edge(e, a, INF)
            flow.add_edge(b, e, INF)
        flow.add_edge(a, b, cost)

    matrices = [n for n in region.nodes if gf.is_parameter(n, params) and n.meta["val"].ndim >= 2]
    feeding = _feeding_the_largest([m for m in matrices if m not in pinned_attn], anc, index, free)
    for n in region.nodes:
        users = [u for u in n.users if u in members]
        outside = len(users) < len(n.users)
        hyperedge(n, [n, *users, *([_SOURCE] if outside else [])], _value_cost(n, tokens, free))
        if n in pinned_attn:
            flow.add_edge(_SOURCE, n, INF)
        elif n in matrices:
            flow.add_edge(n, _SINK, _PREFER_FFN if n in feeding else INF)
    external = {p for n in region.nodes for p in n.all_input_nodes if p not in members}
    for e in sorted(external, key=index.__getitem__):
        if e in free or not gf.is_tensor(e):
            continue  # recomputed on the FFN side
        hyperedge(e, [_SOURCE, *(u for u in e.users if u in members)], gf.bytes_per_token(e, tokens))

    if flow.max_flow(_SOURCE, _SINK) == INF:
        raise UnsupportedModelError("the FFN weights cannot be separated from the attention side", region.label)
    ffn = _convex_closure({n for n in flow.sink_side(_SINK) if n in members}, region.nodes, anc, index)
    if ffn & pinned_attn:
        what = ", ".join(n.name for n in sorted(ffn & pinned_attn, key=index.__getitem__))
        raise UnsupportedModelError(f"{what} (router or partial-sum reader) cannot be placed on the attention side "
                                    "without a second round trip", region.label)
    cut = _crossings(region, ffn, free, index)
    # A value flattened to [b*s, h] before it crosses loses b and s, which the FFN side may need
    # (to unflatten its output): then move the flattening to the FFN side; the bytes are the same.
    while not _sizes_recomputable(cut):
        reshapes = {v for v in cut.to_ffn if v in members and v not in pinned_attn and gf.is_op(v, *_RESHAPES)}
        if not reshapes:
            break
        cut = _keep_returned_reshapes(_crossings(region, ffn | reshapes, free, index), index)
        ffn = set(cut.ffn_nodes)
    return _redo_reshapes(cut, index)


def _keep_returned_reshapes(cut: Cut, index: dict[fx.Node, int]) -> Cut:
    """``cut`` with each value it would return that is only a reshape of a value it sends kept on
    the attention side and redone on the FFN side: a flattening moved to the FFN side for its sizes
    may also be read by a router on the attention side (Aria under ``--router attn``), which would
    otherwise wait for the FFN output that waits for it."""
    sent, ffn = set(cut.to_ffn), set(cut.ffn_nodes)
    kept: set[fx.Node] = set()
    for v in cut.to_attn:
        chain = [v]
        while gf.is_op(chain[-1], *_RESHAPES) and chain[-1].args[0] in ffn:
            chain.append(chain[-1].args[0])
        if gf.is_op(chain[-1], *_RESHAPES) and chain[-1].args[0] in sent:
            kept.update(chain)
    if not kept:
        return cut
    order = index.__getitem__
    return Cut(cut.region, [n for n in cut.ffn_nodes if n not in kept], cut.to_ffn,
               [v for v in cut.to_attn if v not in kept], sorted(kept | set(cut.redone), key=order))


def _redo_reshapes(cut: Cut, index: dict[fx.Node, int]) -> Cut:
    """``cut`` with each crossing value that is only a reshape of another crossing value redone on
    the FFN side: under ``--router attn`` the router may read the flattened hidden state that the
    experts read while a shared expert reads it unflattened, and the bytes need cross only once."""
    crossing, ffn = set(cut.to_ffn), set(cut.ffn_nodes)
    redone: list[fx.Node] = []
    for v in cut.to_ffn:
        chain = [v]
        while gf.is_op(chain[-1], *_RESHAPES) and chain[-1].args[0] not in crossing:
            chain.append(chain[-1].args[0])
        if gf.is_op(chain[-1], *_RESHAPES) and not ffn & set(chain):
            redone.extend(chain)
    if not redone:
        return cut
    sharing = Cut(cut.region, cut.ffn_nodes, [v for v in cut.to_ffn if v not in redone], cut.to_attn,
                  sorted({*redone, *cut.redone}, key=index.__getitem__))
    return sharing if _sizes_recomputable(sharing) else cut


def _sizes_recomputable(cut: Cut) -> bool:
    """Whether every size the FFN side reads can be recomputed from the shapes of what it receives."""
    scratch = fx.Graph()
    sources = []
    for v in cut.to_ffn:
        sources.append(scratch.placeholder(v.name))
        sources[-1].meta = dict(v.meta)
    emitter = SymEmitter(scratch, sources)
    members = set(cut.ffn_nodes) | set(cut.redone)
    try:
        for n in members:
            for p in n.all_input_nodes:
                if p not in members and isinstance(p.meta.get("val"), torch.SymInt):
                    emitter.emit(p.meta["val"])
    except UnsupportedModelError:
        return False
    return True


def _crossings(region: FFNRegion, ffn: set[fx.Node], free: set[fx.Node], index) -> Cut:
    to_ffn = {
        p
        for n in ffn
        for p in n.all_input_nodes
        if p not in ffn and p not in free and gf.is_tensor(p)
    }
    to_attn = {n for n in ffn if any(u not in ffn for u in n.users)}
    for n in to_attn:
        if not gf.is_tensor(n):
            raise UnsupportedModelError(f"a non-tensor value ({gf.where(n)}) would cross the cut", region.label)
    order = index.__getitem__
    return Cut(region, sorted(ffn, key=order), sorted(to_ffn, key=order), sorted(to_attn, key=order))


def select_cuts(
    graph: fx.Graph,
    classification: Classification,
    params: set[str],
    router: RouterPlacement,
    attention_side: set[fx.Node] = frozenset(),
) -> list[Cut]:
    """One cut per FFN region; the nodes in ``attention_side`` stay on the attention side."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    free = gf.data_free(graph)
    info = (gf.ancestors(graph), index, free, gf.token_symbols(graph), gf.positional(graph, free))
    return [cut_region(r, info, params, router, attention_side) for r in classification.regions]
