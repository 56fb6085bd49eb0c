"""A MoE layer's routing and expert computation as afdc's fused MoE kernels.

transformers' grouped-matmul experts (the implementation capture selects) compute a MoE layer as:
flatten the top-k ids and sort them; gather each (token, choice) pair's row; a grouped matmul by
the fused gate/up weights; ``act(gate) * up``; a grouped matmul by the down weights; scale by the
routing weight; unsort and sum over the k choices. The pass matches exactly that data flow,
anchored on the first grouped matmul, with every shape and constant checked (the choices per
token, the experts' count in the histogram, the chunk into gate and up halves), and replaces it
by one ``afdc::fused_moe`` over ``(x, w_gate_up, w_down, topk_weights, topk_ids)``. Under expert
parallelism the grouped matmuls are ``afdc::grouped_mm_local`` with this rank's first expert,
which the fused op takes as well. ``topk(softmax(logits))`` routing becomes ``afdc::moe_route``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from afdc.passes.fuse_activation import activation_of
from afdc.passes.fusion import FusionReport, arg, expect, only_user, run_matches, strip_float_casts, val
from afdc.passes.graph_facts import op_name

_GROUPED = ("grouped_mm_fallback", "_grouped_mm", "grouped_mm", "grouped_mm_local")


def fuse_moe(graph: fx.Graph) -> FusionReport:
    """Replace every exactly matched MoE expert block and softmax top-k router in ``graph``."""
    grouped = [n for n in graph.nodes if op_name(n) in _GROUPED]
    report = run_matches(graph, "fused_moe", grouped, lambda n: _rewrite_experts(graph, n))
    report.merge(run_matches(graph, "moe_route", [n for n in graph.nodes if op_name(n) == "topk"],
                             lambda n: _rewrite_router(graph, n)))
    graph.eliminate_dead_code()
    graph.lint()
    return report


def _grouped(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, object]:
    """``(rows, weights, offs, first expert)`` of a grouped matmul."""
    expect(op_name(node) in _GROUPED, f"{node.name} is not a grouped matmul")
    rows, weights = node.args[0], node.args[1]
    offs = arg(node, 2, "offs")
    first = node.args[3] if op_name(node) == "grouped_mm_local" else 0
    expect(isinstance(offs, fx.Node), "a grouped matmul without offsets")
    return rows, weights, offs, first


def _same(a, b) -> bool:
    """Whether two arguments are the same value: equal constants, or nodes computing the same
    op of the same arguments (the expert-parallel split writes ``rank * experts`` at each use)."""
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        return a is b or (
            a.op == b.op == "call_function" and a.target == b.target and a.kwargs == b.kwargs
            and len(a.args) == len(b.args) and all(_same(x, y) for x, y in zip(a.args, b.args))
        )
    return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and a == b


def _transposed_experts(node) -> fx.Node:
    """``W`` of ``W.transpose(-2, -1)`` for stacked expert weights ``W [E, n, k]``."""
    expect(op_name(node) == "transpose" and sorted(d % 3 for d in node.args[1:3]) == [1, 2], "weights not W^T")
    weights = node.args[0]
    expect(val(weights) is not None and val(weights).dim() == 3, "weights are not stacked experts")
    return weights


def _gated(up_proj: fx.Node) -> tuple[fx.Node, str]:
    """Past ``gate_up = rows @ W1^T``: ``act(gate) * up`` of its two halves; returns the product."""
    chunk = only_user(up_proj)
    expect(op_name(chunk) == "chunk" and chunk.args[1] == 2 and arg(chunk, 2, "dim", 0) in (-1, 1),
           "gate and up are not the two halves of the last dim")
    halves = sorted(chunk.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
    expect([h.args[1] if h.target is operator.getitem else -1 for h in halves] == [0, 1], "halves not gate, up")
    gate, up = halves
    act = only_user(gate)
    expect(op_name(act) in ("silu", "gelu"), f"activation {op_name(act) or act.target}")
    activation = activation_of(act)
    product = only_user(act)
    expect(op_name(product) == "mul" and set(product.args) == {act, up} and only_user(up) is product,
           "not act(gate) * up")
    return product, activation


def _sorted_pairs(rows: fx.Node, offs: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int]:
    """From the gathered rows back to ``(x, top-k ids, the sort's permutation, k)``, checking that
    ``offs`` counts the same sorted ids into one bin per expert."""
    gather = strip_float_casts(rows)
    expect(op_name(gather) == "index" and len(gather.args[1]) == 1, "rows are not gathered by token")
    x, (token,) = gather.args[0], gather.args[1]
    expect(op_name(token) == "floor_divide" and isinstance(token.args[1], int), "rows not of pair // k")
    perm, k = token.args
    expect(perm.target is operator.getitem and op_name(perm.args[0]) == "sort" and perm.args[1] == 1,
           "pairs not in sorted order")
    sort = perm.args[0]
    flat = sort.args[0]
    expect(op_name(flat) in ("reshape", "view") and list(flat.args[1]) == [-1], "the sort is not over all choices")
    ids = flat.args[0]
    expect(tuple(val(ids).shape[1:]) == (k,) and val(x).dim() == 2, "ids are not [tokens, k]")
    cumsum = offs
    expect(op_name(cumsum) == "cumsum", "offsets are not a running count")
    hist = cumsum.args[0]
    expect(op_name(hist) == "histc", "offsets do not count experts")
    counted = hist.args[0]
    if op_name(counted) in ("to", "_to_copy"):  # histc counts floats; ids below 2**24 are exact
        counted = counted.args[0]
    expect(counted.target is operator.getitem and counted.args == (sort, 0), "the count is not of the sorted ids")
    bins, low, high = (arg(hist, i, name) for i, name in ((1, "bins"), (2, "min"), (3, "max")))
    expect(low == 0 and high == bins - 1, "histogram bins are not one per expert")
    return x, ids, perm, k


def _rewrite_experts(graph: fx.Graph, up_proj: fx.Node) -> None:
    rows, w1t, offs, first = _grouped(up_proj)
    w_gate_up = _transposed_experts(w1t)
    product, activation = _gated(up_proj)
    down_in = only_user(product)
    down = only_user(down_in) if op_name(down_in) in ("to", "_to_copy") else down_in
    rows2, w2t, offs2, first2 = _grouped(down)
    expect(offs2 is offs and _same(first2, first) and strip_float_casts(rows2) is product, "down proj of other rows")
    w_down = _transposed_experts(w2t)
    x, ids, perm, k = _sorted_pairs(rows, offs)

    scale = only_user(down)
    expect(op_name(scale) == "mul", "the down projection is not scaled by the routing weight")
    unsqueeze = scale.args[1] if scale.args[0] is down else scale.args[0]
    expect(op_name(unsqueeze) == "unsqueeze" and unsqueeze.args[1] in (-1, 1), "not a per-row routing weight")
    picked = unsqueeze.args[0]
    expect(op_name(picked) == "index" and list(picked.args[1]) == [perm], "routing weights not in sorted order")
    flat_weights = picked.args[0]
    expect(op_name(flat_weights) in ("reshape", "view") and list(flat_weights.args[1]) == [-1], "weights not flat")
    weights = flat_weights.args[0]
    expect(val(weights).shape == val(ids).shape, "routing weights and ids differ in shape")

    unsort = only_user(scale)
    expect(op_name(unsort) == "index" and len(unsort.args[1]) == 1, "rows are not put back in choice order")
    inverse = unsort.args[1][0]
    expect(op_name(inverse) == "index_put_" and list(inverse.args[1]) == [perm], "not the sort's inverse")
    per_choice = only_user(unsort)
    expect(op_name(per_choice) in ("view", "reshape") and val(per_choice).shape[1:] == (k, val(x).shape[1]),
           "not viewed as [tokens, k, hidden]")
    total = only_user(per_choice)
    expect(op_name(total) == "sum" and list(total.args[1]) in ([1], [-2]), "the k choices are not summed")
    expect(val(total).dtype == val(x).dtype, "the layer's output dtype differs from its input's")
    expect(val(w_gate_up).shape[0] == val(w_down).shape[0], "gate/up and down hold different experts")

    with graph.inserting_before(total):
        fused = graph.call_function(
            torch.ops.afdc.fused_moe.default, (x, w_gate_up, w_down, weights, ids, first, activation)
        )
    fused.meta = dict(total.meta)
    total.replace_all_uses_with(fused)
    chain = [total, per_choice, unsort, inverse, scale, unsqueeze, picked, down, down_in, product]
    for node in dict.fromkeys(chain):  # down_in is product when nothing casts between
        if not node.users:
            graph.erase_node(node)


def _rewrite_router(graph: fx.Graph, topk: fx.Node) -> None:
    probs, k = topk.args[0], topk.args[1]
    expect(op_name(probs) == "softmax" and len(probs.users) == 1, "top-k of something other than a softmax")
    logits = probs.args[0]
    expect(probs.args[1] in (-1, val(logits).dim() - 1) and val(logits).dim() == 2, "softmax not over experts")
    expect(val(probs).dtype == torch.float32, "probabilities in a half type (the kernel returns float32)")
    expect(arg(topk, 2, "dim", -1) in (-1, 1) and arg(topk, 3, "largest", True) and arg(topk, 4, "sorted", True),
           "not the largest k in order")
    with graph.inserting_before(topk):
        route = graph.call_function(
            torch.ops.afdc.moe_route.default, (logits, k, "softmax", False, 1, 1, "max", None, 1.0)
        )
    route.meta = dict(topk.meta)
    topk.replace_all_uses_with(route)
    graph.erase_node(topk)
    graph.erase_node(probs)
