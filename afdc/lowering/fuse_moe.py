"""A MoE layer's routing and expert computation as afdc's fused MoE kernels.

The routed experts are one ``afdc::fused_moe`` node first (:mod:`afdc.passes.moe_experts`). A
shared expert added to the routed experts' output, ``down(act(gate x) * up x)`` of the same rows
by 2-D weights, optionally times a per-token scale (Qwen2-MoE's sigmoid gate, the owner mark of
expert routing), goes into the same ``fused_moe`` (its ``s_*`` arguments) when it uses the routed
experts' activation.

``topk(softmax(logits))`` routing becomes ``afdc::moe_route``. gpt-oss's ``softmax(topk(logits))``
does not: its weights equal the renormalized top-k of the softmax, but it chooses on the logits,
and the kernel chooses on the probabilities, where rounding can tie two logits that differ.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from afdc.codegen import moe_routing as _moe_route_op  # noqa: F401 (defines the routing op this pass emits)
from afdc.codegen.fused_moe import FusedMoeCall
from afdc.passes.graph_facts import op_name, shapes_match
from afdc.passes.matching import (
    FusionReport,
    activation_of,
    arg,
    constant_factor,
    erase_unused,
    expect,
    only_user,
    run_matches,
    strip_float_casts,
    val,
)
from afdc.passes.moe_experts import PASS_THROUGH, experts_as_op, two_halves


def fuse_moe(graph: fx.Graph) -> FusionReport:
    """Replace every exactly matched MoE expert block and softmax top-k router in ``graph``."""
    report = experts_as_op(graph)
    # last top-k first: a grouped router's final top-k takes its group top-ks with it
    routers = [n for n in reversed(graph.nodes) if op_name(n) == "topk"]
    report.merge(run_matches(graph, "moe_route", routers, lambda n: _rewrite_router(graph, n)))
    graph.lint()
    return report


def fuse_shared_experts(graph: fx.Graph) -> FusionReport:
    """Move every shared expert added to a fused MoE's output into that ``fused_moe``. Separate
    from :func:`fuse_moe`, whose graph the expert-routing proof reads with the term still added."""
    added = [n for n in graph.nodes if FusedMoeCall.matches(n) and _sum_with(n) is not None]
    report = run_matches(graph, "shared_expert", added, lambda n: _take_shared_expert(graph, n))
    graph.lint()
    return report


def _rows(node):
    """``node`` past views, reshapes and widening casts: the same rows, in another shape or in
    float32 (which the kernel casts back to the weights' dtype exactly)."""
    while isinstance(node, fx.Node) and op_name(node) in ("view", "reshape", "to", "_to_copy"):
        stripped = strip_float_casts(node) if op_name(node) in ("to", "_to_copy") else node.args[0]
        if stripped is node:
            break
        node = stripped
    return node


def _gate_and_up_of(first: fx.Node, second: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """``(rows, W_gate, W_up)`` of the shared expert's gate and up projections: two bias-free
    linears of the same rows, or the two halves of one (GraniteMoE-shared's fused input linear:
    ``W_up`` None, ``W_gate`` the fused weight)."""
    if all(n.target is operator.getitem for n in (first, second)) and first.args[0] is second.args[0]:
        chunk = first.args[0]
        expect(two_halves(chunk) and [first.args[1], second.args[1]] == [0, 1], "gate and up are not two halves")
        rows, weight = _plain_linear(chunk.args[0], "gate/up")
        return rows, weight, None
    (rows, w_gate), (rows_up, w_up) = _plain_linear(first, "gate"), _plain_linear(second, "up")
    expect(_rows(rows) is _rows(rows_up), "the shared expert's gate and up read other rows")
    return rows, w_gate, w_up


def _weight_halves(graph: fx.Graph, weight: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Views of the first and second half of ``weight``'s rows (gate, then up)."""
    half = val(weight).shape[0] // 2
    halves = tuple(graph.call_function(torch.ops.aten.slice.Tensor, (weight, 0, a, a + half)) for a in (0, half))
    for node, start in zip(halves, (0, half)):
        node.meta["val"] = val(weight)[start : start + half]
    return halves


def _plain_linear(node, what: str) -> tuple[fx.Node, fx.Node]:
    """``(input, weight)`` of a bias-free ``linear`` by a 2-D weight."""
    expect(op_name(node) == "linear" and (len(node.args) < 3 or node.args[2] is None) and not node.kwargs,
           f"the shared expert's {what} is not a bias-free linear")
    weight = val(node.args[1])
    expect(weight is not None and weight.dim() == 2, f"the shared expert's {what} weight is not 2-D")
    return node.args[0], node.args[1]


def _shared_mlp(down: fx.Node, x: fx.Node, activation: str) -> tuple[fx.Node, fx.Node | None, fx.Node]:
    """``(W_gate, W_up, W_down)`` of ``down(act(gate x) * up x)`` over ``x``'s rows (``W_up``
    None: gate and up are the halves of ``W_gate``)."""
    product, w_down = _plain_linear(down, "down projection")
    if op_name(product) == "act_mul":
        gate, up, kind = product.args
    else:
        expect(op_name(product) == "mul" and len(product.args) == 2, "the shared expert is not act(gate) * up")
        act = next((a for a in product.args if op_name(a) in ("silu", "gelu")), None)
        expect(act is not None and only_user(act) is product, "the shared expert is not act(gate) * up")
        gate, up, kind = act.args[0], product.args[1] if product.args[0] is act else product.args[0], activation_of(act)
    expect(kind == activation, f"the shared expert's activation {kind} is not the routed experts' {activation}")
    expect(all(len(n.users) == 1 for n in (gate, up, product, down)), "a shared expert's value is read elsewhere")
    rows, w_gate, w_up = _gate_and_up_of(gate, up)
    expect(_rows(rows) is _rows(x), "the shared expert reads other rows")
    return w_gate, w_up, w_down


def _per_row_factor(mul: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(value, factor)`` when ``mul`` multiplies a value by one number per row (``[..., 1]``)."""
    if op_name(mul) != "mul" or len(mul.args) != 2 or not all(isinstance(a, fx.Node) for a in mul.args):
        return None
    for value, factor in (mul.args, mul.args[::-1]):
        if val(value) is not None and val(factor) is not None and val(value).shape[-1] > 1 \
                and tuple(val(factor).shape) == (*val(value).shape[:-1], 1):
            return value, factor
    return None


def _sum_with(moe: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """``(chain, add)`` when ``add`` adds something to ``chain[-1]``, the fused MoE's output past
    casts, views and scalings by a constant (``chain`` starts at ``moe``)."""
    chain = [moe]
    while len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        scaled = op_name(user) == "mul" and constant_factor(user) is not None and user.args[0] is chain[-1]
        if op_name(user) not in PASS_THROUGH and not scaled:
            break
        chain.append(user)
    add = next(iter(chain[-1].users)) if len(chain[-1].users) == 1 else None
    if add is None or op_name(add) != "add" or len(add.args) != 2 or add.kwargs or chain[-1] not in add.args:
        return None
    return chain, add


def _take_shared_expert(graph: fx.Graph, moe: fx.Node) -> None:
    """``chain(fused_moe(x, ...)) + shared(x) * factors`` as ``chain(fused_moe(x, ..., shared))``,
    where ``chain`` is casts, views and constant scalings (which move into the routing weights) and
    the factors are per row (Qwen2-MoE's sigmoid gate, the owner mark of expert routing),
    multiplied into ``s_scale``."""
    call = FusedMoeCall.of(moe)
    expect(not call.has_biases and not call.has_shared_expert, "experts with biases, or a shared expert already")
    chain, add = _sum_with(moe)
    expect(shapes_match(val(add).shape, val(chain[-1]).shape) and val(add).dtype == val(chain[-1]).dtype,
           "the sum has another shape or dtype than the experts' output")
    term = add.args[1] if add.args[0] is chain[-1] else add.args[0]
    factors = []
    while isinstance(term, fx.Node) and len(term.users) == 1:
        if op_name(term) in PASS_THROUGH and _rows(term) is not term:  # a view, or a widening to float32
            term = term.args[0]
        elif (split := _per_row_factor(term)) is not None:
            term, factor = split
            factors.append(factor)
        else:
            break
    # the same rows as the experts' (checked by _shared_mlp), as [tokens, H] or shaped like the sum
    expect(val(term) is not None and val(term).shape in (val(moe).shape, val(add).shape),
           "the shared expert's rows are not the experts' rows")
    w_gate, w_up, w_down = _shared_mlp(term, call.x, call.activation)
    with graph.inserting_before(add):
        if w_up is None:
            w_gate, w_up = _weight_halves(graph, w_gate)
        shared = {"s_gate": w_gate, "s_up": w_up, "s_down": w_down}
        for factor in factors:
            flat = graph.call_function(torch.ops.aten.view.default, (factor, [-1]))
            flat.meta["val"] = val(factor).reshape(-1)
            if "s_scale" in shared:
                product = graph.call_function(torch.ops.aten.mul.Tensor, (shared["s_scale"], flat))
                product.meta["val"] = val(shared["s_scale"]) * val(flat)
                flat = product
            shared["s_scale"] = flat
        arguments = call.arguments()
        scaling = math.prod(c for c in map(constant_factor, chain[1:]) if c is not None)
        if scaling != 1.0:  # the routed sum's scaling, not the shared expert's: into the routing weights
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (call.topk_weights, scaling))
            scaled.meta["val"] = val(call.topk_weights) * scaling
            arguments["topk_weights"] = scaled
        out = FusedMoeCall.emit(graph, **{**arguments, **shared})
        out.meta = dict(moe.meta)
        for node in chain[1:]:  # the same casts and views, now of the sum
            if constant_factor(node) is None:
                out = graph.call_function(node.target, (out, *node.args[1:]), dict(node.kwargs))
                out.meta = dict(node.meta)
    add.replace_all_uses_with(out)
    erase_unused(graph, [add])


def _rewrite_router(graph: fx.Graph, topk: fx.Node) -> None:
    if op_name(topk.args[0]) == "masked_fill":
        _rewrite_grouped_router(graph, topk)
        return
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
    erase_unused(graph, [topk])


def _getitem_of(node, index: int) -> fx.Node:
    expect(isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == index,
           f"{getattr(node, 'name', node)} is not output {index} of a tuple")
    return node.args[0]


def _group_mask(mask: fx.Node, choice: fx.Node, experts: int) -> tuple[int, int]:
    """DeepSeek-V3's group limit, read back from the mask it builds: ``~(scatter of the best
    groups' ids, expanded to their experts)`` over groups scored by their top-2 sum. Returns
    ``(n_group, topk_group)``."""
    expect(op_name(mask) == "bitwise_not", "the mask is not the complement of the kept groups")
    flat = strip_float_casts(mask.args[0])
    if op_name(flat) in ("to", "_to_copy"):
        flat = flat.args[0]
    expect(op_name(flat) in ("reshape", "view") and list(flat.args[1]) == [-1, experts], "mask not over experts")
    expand = flat.args[0]
    expect(op_name(expand) == "expand" and op_name(expand.args[0]) == "unsqueeze", "groups not expanded to experts")
    kept = expand.args[0].args[0]
    expect(op_name(kept) in ("scatter", "scatter_") and kept.args[1] == 1 and kept.args[3] == 1, "not a group mask")
    expect(op_name(kept.args[0]) == "zeros_like", "the kept groups are not marked on zeros")
    best = _getitem_of(kept.args[2], 1)
    expect(op_name(best) == "topk" and arg(best, 2, "dim", -1) == -1, "groups not chosen by top-k")
    group_scores = best.args[0]
    expect(kept.args[0].args[0] is group_scores, "the mask is not shaped like the group scores")
    expect(op_name(group_scores) == "sum" and list(group_scores.args[1]) == [-1], "a group's score is not a sum")
    top2 = _getitem_of(group_scores.args[0], 0)
    expect(op_name(top2) == "topk" and top2.args[1] == 2 and arg(top2, 2, "dim", -1) == -1, "not the top-2 sum")
    grouped = top2.args[0]
    expect(op_name(grouped) in ("view", "reshape") and grouped.args[0] is choice, "groups are not of the choices")
    n_group, per_group = list(grouped.args[1])[-2:]
    expect(n_group * per_group == experts, "groups do not tile the experts")
    return n_group, best.args[1]


def _rewrite_grouped_router(graph: fx.Graph, topk: fx.Node) -> None:
    """DeepSeek-V3's router: sigmoid scores, a per-expert bias for the choice only, the best
    ``topk_group`` of ``n_group`` groups by their top-2 sum, top-k, weights gathered from the
    unbiased scores, renormalized (+1e-20) and scaled."""
    masked, k = topk.args[0], topk.args[1]
    choice, mask, fill = masked.args
    expect(fill == float("-inf"), "other groups are not excluded with -inf")
    expect(op_name(choice) == "add" and len(choice.args) == 2, "the choice is not score + bias")
    scores, bias = choice.args
    expect(op_name(scores) == "sigmoid" and val(scores).dtype == torch.float32, "scores are not float32 sigmoids")
    experts = val(scores).shape[-1]
    expect(val(scores).dim() == 2 and tuple(val(bias).shape) == (experts,), "bias is not one per expert")
    n_group, topk_group = _group_mask(mask, choice, experts)
    ids = next((u for u in topk.users if u.args[1] == 1), None)
    expect(ids is not None and all(u.args[1] == 1 for u in topk.users), "the top-k values are used")
    picked = [u for u in ids.users if op_name(u) == "gather"]
    expect(len(picked) == 1 and picked[0].args[:2] == (scores, 1), "weights not gathered from the scores")
    weights = picked[0]
    total = next((u for u in weights.users if op_name(u) == "sum"), None)
    expect(total is not None and len(weights.users) == 2, "weights not renormalized")
    eps = only_user(total)
    division = only_user(eps)
    expect(op_name(eps) == "add" and eps.args[1] == 1e-20 and op_name(division) in ("div", "div_")
           and division.args == (weights, eps), "not weights / (sum + 1e-20)")
    scaled = only_user(division)
    expect(op_name(scaled) == "mul" and isinstance(scaled.args[1], (int, float)), "weights not scaled")
    with graph.inserting_before(topk):
        route = graph.call_function(
            torch.ops.afdc.moe_route.default,
            (scores.args[0], k, "sigmoid", True, n_group, topk_group, "top2_sum", bias, float(scaled.args[1])),
        )
        new_weights = graph.call_function(operator.getitem, (route, 0))
        new_ids = graph.call_function(operator.getitem, (route, 1))
    route.meta["val"] = (val(scaled), val(ids))
    new_weights.meta, new_ids.meta = dict(scaled.meta), dict(ids.meta)
    scaled.replace_all_uses_with(new_weights)
    ids.replace_all_uses_with(new_ids)
    for node in (scaled, division, eps, total, weights):  # division is in place on weights, read by total
        graph.erase_node(node)
    erase_unused(graph, [ids, topk, scores])
