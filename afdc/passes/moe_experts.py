"""A MoE layer's routed experts recognised as one ``afdc::fused_moe`` node.

transformers' grouped-matmul experts (the implementation capture selects) compute a MoE layer as:
flatten the top-k ids and sort them; gather each (token, choice) pair's row; a grouped matmul by
the fused gate/up weights; ``act(gate) * up``; a grouped matmul by the down weights; scale by the
routing weight; unsort and sum over the k choices. :func:`experts_as_op` matches exactly that data
flow, anchored on the first grouped matmul, with every shape and constant checked (the choices per
token, the experts' count in the histogram, the chunk into gate and up halves), and replaces it
by one ``afdc::fused_moe`` over ``(x, w_gate_up, w_down, topk_weights, topk_ids)``. Under expert
parallelism the grouped matmuls are ``afdc::grouped_mm_local`` with this rank's first expert,
which the op takes as well.

gpt-oss's experts differ in four places, each matched as exactly and passed to the op as an
option: input-major weights (the grouped matmul takes ``W`` itself, not ``W^T``), per-expert biases
gathered by the sorted ids and added to each projection, gate and up as the even and odd columns,
and the clamped ``swigluoai`` activation with its ``alpha`` and ``limit`` read from the graph.

This is a graph analysis as much as a rewrite: the op's contract ("choices of experts outside
this rank's range add zero") is what expert routing (:mod:`afdc.passes.expert_routing`) proves
its facts from, and the kernel lowering (:mod:`afdc.lowering.fuse_moe`) starts from the same node.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from afdc.codegen.fused_moe import FusedMoeCall
from afdc.passes.graph_facts import op_name, shapes_match
from afdc.passes.matching import (
    FusionReport,
    activation_of,
    arg,
    erase_unused,
    expect,
    only_user,
    run_matches,
    strip_float_casts,
    val,
)

GROUPED = ("grouped_mm_fallback", "_grouped_mm", "grouped_mm", "grouped_mm_local")
PASS_THROUGH = ("to", "_to_copy", "view", "reshape")  # the same values, cast or reshaped


def experts_as_op(graph: fx.Graph) -> FusionReport:
    """Replace every exactly matched routed-experts block in ``graph`` by one ``afdc::fused_moe``."""
    grouped = [n for n in graph.nodes if op_name(n) in GROUPED]
    report = run_matches(graph, "fused_moe", grouped, lambda n: _as_op(graph, n))
    graph.lint()
    return report


def _grouped(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, object]:
    """``(rows, weights, offs, first expert)`` of a grouped matmul."""
    expect(op_name(node) in GROUPED, f"{node.name} is not a grouped matmul")
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


def _stacked_experts(node) -> tuple[fx.Node, bool]:
    """``(W, transposed)`` of a grouped matmul's right operand: ``W.transpose(-2, -1)`` for
    output-major expert weights ``W [E, n, k]``, or input-major ``W [E, k, n]`` itself."""
    transposed = op_name(node) != "transpose"
    weights = node if transposed else node.args[0]
    expect(transposed or sorted(d % 3 for d in node.args[1:3]) == [1, 2], "weights not W^T")
    expect(val(weights) is not None and val(weights).dim() == 3, "weights are not stacked experts")
    return weights, transposed


def _biased(projection: fx.Node, sorted_ids: fx.Node, first) -> tuple[fx.Node, fx.Node | None]:
    """``(projection + b[sorted ids], b)`` when each row adds its expert's bias row, else
    ``(projection, None)``. Under expert parallelism the bias rows are ``gather_local``'s."""
    users = list(projection.users)
    add = users[0] if len(users) == 1 else None
    if add is None or op_name(add) not in ("add", "add_") or add.args[0] is not projection:
        return projection, None
    picked = add.args[1]
    if op_name(picked) == "index":
        expect(list(picked.args[1]) == [sorted_ids] and _same(first, 0), "bias rows not of the sorted ids")
    else:
        expect(op_name(picked) == "gather_local" and picked.args[1] is sorted_ids and _same(picked.args[2], first),
               "bias rows not of the sorted ids")
    bias = picked.args[0]
    expect(val(bias).dim() == 2 and val(bias).shape[1] == val(projection).shape[1], "not one bias row per expert")
    return add, bias


def two_halves(node: fx.Node) -> bool:
    """Whether ``node`` cuts its ``[pairs, 2n]`` input into two ``n`` halves along the last dim:
    ``chunk(2)``, ``split(n)`` or ``split_with_sizes([n, n])``."""
    name, width = op_name(node), val(node.args[0]).shape[-1]
    if arg(node, 2, "dim", 0) not in (-1, 1):
        return False
    if name == "chunk":
        return node.args[1] == 2
    if name == "split":
        return node.args[1] * 2 == width
    return name == "split_with_sizes" and list(node.args[1]) == [width // 2] * 2 and width % 2 == 0


def _gate_and_up(gate_up: fx.Node) -> tuple[fx.Node, fx.Node, bool]:
    """``(gate, up, interleaved)``: the two halves of ``gate_up``'s last dim, or its even and odd
    columns."""
    users = list(gate_up.users)
    if len(users) == 1:
        chunk = users[0]
        expect(two_halves(chunk), "gate and up are not the two halves of the last dim")
        halves = sorted(chunk.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
        expect([h.args[1] if h.target is operator.getitem else -1 for h in halves] == [0, 1], "halves not gate, up")
        return halves[0], halves[1], False
    width = val(gate_up).shape[-1]
    columns = sorted(users, key=lambda n: n.args[2] if op_name(n) == "slice" and len(n.args) == 5 else -1)
    expect(len(users) == 2 and all(op_name(n) == "slice" and len(n.args) == 5 and n.args[1] in (-1, 1)
                                   and n.args[3] >= width and n.args[4] == 2 for n in columns)
           and [n.args[2] for n in columns] == [0, 1], "gate and up are neither halves nor even and odd columns")
    return columns[0], columns[1], True


def _swigluoai(gate: fx.Node, up: fx.Node) -> tuple[fx.Node, float, float]:
    """gpt-oss's ``(clamp(up, -L, L) + 1) * (g * sigmoid(alpha * g))`` with ``g = clamp(gate, max=L)``:
    ``(product, alpha, L)``."""
    clamped = only_user(gate)
    expect(op_name(clamped) == "clamp" and clamped.args[1:] == (None, clamped.args[2])
           and isinstance(clamped.args[2], float), "gate not clamped from above")
    limit = clamped.args[2]
    up_clamped = only_user(up)
    expect(op_name(up_clamped) == "clamp" and up_clamped.args[1:] == (-limit, limit), "up not clamped to ±limit")
    shifted = only_user(up_clamped)
    expect(op_name(shifted) == "add" and shifted.args == (up_clamped, 1), "not up + 1")
    scaled = next((u for u in clamped.users if op_name(u) == "mul" and u.args[0] is clamped
                   and isinstance(u.args[1], float)), None)
    expect(scaled is not None, "no alpha * gate")
    sigmoid = only_user(scaled)
    glu = only_user(sigmoid)
    expect(op_name(sigmoid) == "sigmoid" and op_name(glu) == "mul" and set(glu.args) == {clamped, sigmoid}
           and set(clamped.users) == {scaled, glu}, "not gate * sigmoid(alpha * gate)")
    product = only_user(glu)
    expect(op_name(product) == "mul" and set(product.args) == {shifted, glu} and only_user(shifted) is product,
           "not (up + 1) * glu")
    return product, scaled.args[1], limit


def _swiglu_limit(gate: fx.Node, up: fx.Node) -> tuple[fx.Node, float]:
    """DeepSeek-V4's ``silu(clamp(gate, max=L)) * clamp(up, -L, L)``: ``(product, L)``."""
    clamped = only_user(gate)
    limit = clamped.args[2] if len(clamped.args) == 3 else None
    expect(op_name(clamped) == "clamp" and clamped.args[1] is None and isinstance(limit, float),
           "gate not clamped from above")
    up_clamped = only_user(up)
    expect(op_name(up_clamped) == "clamp" and up_clamped.args[1:] == (-limit, limit), "up not clamped to ±limit")
    act = only_user(clamped)
    product = only_user(act)
    expect(op_name(act) == "silu" and op_name(product) == "mul" and set(product.args) == {act, up_clamped}
           and only_user(up_clamped) is product, "not silu(gate) * up")
    return product, limit


def _gated(gate_up: fx.Node) -> tuple[fx.Node, str, bool, float | None, float | None]:
    """Past the gate/up projection: ``act(gate) * up``; returns the product, the activation, whether
    gate and up are interleaved, and the clamped activations' alpha and limit."""
    gate, up, interleaved = _gate_and_up(gate_up)
    if op_name(only_user(gate)) == "clamp":
        if [op_name(u) for u in only_user(gate).users] == ["silu"]:
            product, limit = _swiglu_limit(gate, up)
            return product, "swiglu_limit", interleaved, None, limit
        product, alpha, limit = _swigluoai(gate, up)
        return product, "swigluoai", interleaved, alpha, limit
    act = only_user(gate)
    expect(op_name(act) in ("silu", "gelu"), f"activation {op_name(act) or act.target}")
    activation = activation_of(act)
    product = only_user(act)
    expect(op_name(product) == "mul" and set(product.args) == {act, up} and only_user(up) is product,
           "not act(gate) * up")
    return product, activation, interleaved, None, None


def _per_token(flat, k: int, what: str):
    """``[tokens, k]`` of a flat tensor of (token, choice) pairs: the tensor it was flattened from,
    or the flat tensor itself (a segment input when the cut crosses after the flatten), which
    :func:`_as_pairs` views as ``[tokens, k]`` once the match is certain. Pair ``p`` belongs to
    token ``p // k``: the gather by ``pair // k`` says so."""
    if op_name(flat) in ("reshape", "view") and list(flat.args[1]) == [-1]:
        expect(tuple(val(flat.args[0]).shape[1:]) == (k,), f"{what} are not [tokens, {k}]")
        return flat.args[0]
    expect(val(flat) is not None and val(flat).dim() == 1, f"{what} are not a flat run of pairs")
    return flat


def _as_pairs(graph: fx.Graph, node: fx.Node, k: int, before: fx.Node) -> fx.Node:
    if val(node).dim() == 2:
        return node
    with graph.inserting_before(before):
        view = graph.call_function(torch.ops.aten.view.default, (node, [-1, k]))
    view.meta["val"] = val(node).view(-1, k)
    return view


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
    ids = _per_token(sort.args[0], k, "expert ids")
    expect(val(x).dim() == 2, "rows are not gathered from [tokens, hidden]")
    cumsum = offs
    expect(op_name(cumsum) == "cumsum", "offsets are not a running count")
    hist = cumsum.args[0]
    expect(op_name(hist) == "histc", "offsets do not count experts")
    counted = hist.args[0]
    while op_name(counted) in ("to", "_to_copy"):  # histc counts floats; ids below 2**24 are exact
        counted = counted.args[0]
    expect(counted.target is operator.getitem and counted.args == (sort, 0), "the count is not of the sorted ids")
    bins, low, high = (arg(hist, i, name) for i, name in ((1, "bins"), (2, "min"), (3, "max")))
    expect(low == 0 and high == bins - 1, "histogram bins are not one per expert")
    return x, ids, perm, k


def _as_op(graph: fx.Graph, up_proj: fx.Node) -> None:
    rows, w1t, offs, first = _grouped(up_proj)
    w_gate_up, transposed = _stacked_experts(w1t)
    x, ids, perm, k = _sorted_pairs(rows, offs)
    sorted_ids = next(u for u in perm.args[0].users if u.args[1] == 0)  # the histogram counts them
    gate_up, b_gate_up = _biased(up_proj, sorted_ids, first)
    product, activation, interleaved, alpha, limit = _gated(gate_up)
    down_in = only_user(product)
    down = only_user(down_in) if op_name(down_in) in ("to", "_to_copy") else down_in
    rows2, w2t, offs2, first2 = _grouped(down)
    expect(offs2 is offs and _same(first2, first) and strip_float_casts(rows2) is product, "down proj of other rows")
    w_down, transposed2 = _stacked_experts(w2t)
    expect(transposed2 == transposed, "gate/up and down weights in different layouts")
    down, b_down = _biased(down, sorted_ids, first)

    scale = only_user(down)
    expect(op_name(scale) == "mul", "the down projection is not scaled by the routing weight")
    unsqueeze = scale.args[1] if scale.args[0] is down else scale.args[0]
    expect(op_name(unsqueeze) == "unsqueeze" and unsqueeze.args[1] in (-1, 1), "not a per-row routing weight")
    picked = unsqueeze.args[0]
    expect(op_name(picked) == "index" and list(picked.args[1]) == [perm], "routing weights not in sorted order")
    weights = _per_token(picked.args[0], k, "routing weights")
    expect(shapes_match(val(weights).shape, val(ids).shape), "routing weights and ids differ in shape")

    unsort = only_user(scale)
    expect(op_name(unsort) == "index" and len(unsort.args[1]) == 1, "rows are not put back in choice order")
    inverse = unsort.args[1][0]
    expect(op_name(inverse) in ("index_put_", "index_put") and list(inverse.args[1]) == [perm],
           "not the sort's inverse")
    per_choice = only_user(unsort)
    expect(op_name(per_choice) in ("view", "reshape") and val(per_choice).shape[1:] == (k, val(x).shape[1]),
           "not viewed as [tokens, k, hidden]")
    total = only_user(per_choice)
    expect(op_name(total) == "sum" and list(total.args[1]) in ([1], [-2]), "the k choices are not summed")
    out = total
    if val(total).dtype != val(x).dtype:  # float32 routing weights widened the sum: its cast back
        out = only_user(total)
        expect(op_name(out) in ("to", "_to_copy") and val(out).dtype == val(x).dtype,
               "the layer's output dtype differs from its input's")
    expect(val(w_gate_up).shape[0] == val(w_down).shape[0], "gate/up and down hold different experts")

    weights, ids = _as_pairs(graph, weights, k, out), _as_pairs(graph, ids, k, out)
    options = {"b_gate_up": b_gate_up, "b_down": b_down, "transposed": transposed, "interleaved": interleaved,
               "alpha": alpha, "limit": limit}
    with graph.inserting_before(out):
        fused = FusedMoeCall.emit(
            graph, x=x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=weights, topk_ids=ids, first_expert=first,
            activation=activation, **options,
        )
    fused.meta = dict(out.meta)
    out.replace_all_uses_with(fused)
    erase_unused(graph, [out])
