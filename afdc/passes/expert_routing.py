"""Whether an expert-parallel segment's tokens can go only to the ranks holding their experts.

An FFN rank under EP returns a partial result for every token it is sent; the attention side adds
the ranks' results. Sending a token only to the ranks holding experts it chose is exact when a
rank's result for any other token is exactly zero and a token's result depends on its own row
only. This pass proves both from the rank's segment graph rather than trusting a model family:
after kernel substitution (:func:`afdc.passes.moe_experts.experts_as_op`) the segment's single output
must be one ``afdc::fused_moe`` (up to casts, views and scalings by a finite constant), whose op
contract is "choices of experts outside ``[first, first + E_local)`` add zero", with
``first = rank * E_local``; its activations must be an input's rows; its expert ids must be an
input, or the top-k of an input's scores; and its routing weights must be computed row by row.

A term added to the fused MoE on one rank only (a shared expert every rank holds whole, which
sharding adds where ``rank == 0``) would be lost for tokens rank 0 is not sent. :func:`owner_mask`
rewrites that condition into a per-row mask input that the attention side fills, marking for each
token one of the ranks it is sent to; the proof then also accepts ``fused_moe + term * mask`` with
``term`` computed row by row from the inputs and weights.
"""

from __future__ import annotations

import operator
from collections.abc import Collection

import torch
import torch.fx as fx

from afdc import segment
from afdc.codegen.fused_moe import FusedMoeCall
from afdc.passes import graph_facts as gf
from afdc.passes.matching import constant_factor, copy_graph, val
from afdc.passes.moe_experts import experts_as_op
from afdc.segment import ExpertRouting, row_major, token_major

_PASS_THROUGH = {"view", "reshape", "to", "_to_copy", "type_as", "contiguous", "clone"}
# ops that compute each token's row from that row alone, given reductions over the last dim only
_ROW_LOCAL = _PASS_THROUGH | {
    "topk", "softmax", "sigmoid", "div", "div_", "mul", "mul_", "add", "sub", "neg", "sum", "amax", "unsqueeze",
    "silu", "gelu", "relu", "tanh", "exp", "chunk", "linear",  # linear contracts its input's last dim only
}


def _source(node):
    while isinstance(node, fx.Node) and gf.op_name(node) in _PASS_THROUGH:
        node = node.args[0]
    return node


def _scaled_source(node):
    """``node`` past pass-through ops and scalings by a finite constant (a routed scaling factor),
    which keep a row that is zero zero."""
    node = _source(node)
    while constant_factor(node) is not None:
        node = _source(node.args[0])
    return node


def _row_local(node, inputs: set[fx.Node], tokens, whole: frozenset[fx.Node] = frozenset()) -> bool:
    """Whether ``node`` is computed from the ``inputs`` row by row (token-major all the way),
    the same on every rank: weights may enter only if every rank holds them ``whole``, as a
    linear's weight and bias or broadcast over the rows."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n in inputs or n in whole:
            continue
        if gf.op_name(n) == "linear" and not all(w in whole for w in n.args[1:] if w is not None):
            return False  # a token-dependent weight would mix rows
        local = n.target is operator.getitem or (gf.op_name(n) in _ROW_LOCAL and gf.over_last_dim(n))
        token_major = val(n) is None or row_major(gf.token_layout(n, tokens))  # a tuple: its items are checked
        if n.op != "call_function" or not local or not token_major:
            return False
        # a view's sizes are shape reads (the token count), not data: only its tensor is followed
        stack += [n.args[0]] if gf.op_name(n) in ("view", "reshape") else n.all_input_nodes
    return True


def _routing_key(ids, inputs: list[fx.Node]) -> tuple[int, int | None] | None:
    """``(input index, top_k)`` of the expert ids: an input itself, or ``topk(input, k)[1]``."""
    ids = _source(ids)
    if ids in inputs and not val(ids).is_floating_point():
        return inputs.index(ids), None
    if not (isinstance(ids, fx.Node) and ids.target is operator.getitem and ids.args[1] == 1):
        return None
    topk = ids.args[0]
    if gf.op_name(topk) != "topk" or not gf.over_last_dim(topk) or topk.args[0] not in inputs:
        return None
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    return (inputs.index(topk.args[0]), int(topk.args[1])) if largest else None


def _lead_terms(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]] | None:
    """``(rank == 0, term * (rank == 0))`` for each term sharding added on rank 0 only; None when
    such a condition is used any other way."""
    rank = segment.rank(graph)
    leads = [u for u in rank.users if u.target is operator.eq and u.args == (rank, 0)]
    uses = [(lead, m) for lead in leads for m in lead.users]
    if not all(gf.op_name(m) == "mul" and m.args[1] is lead and len(m.users) for lead, m in uses):
        return None
    return uses


def owner_mask(graph: fx.Graph, tokens) -> fx.Graph | None:
    """The segment with its rank-0-only terms added instead on the rows that a new last input
    (a bool per token, ``[tokens..., 1]``) marks; None when there are none, or they are not all
    token-major rows of one shape."""
    uses = _lead_terms(graph)
    if not uses:
        return None
    layouts = [gf.token_layout(m.args[0], tokens) for _, m in uses]
    if not row_major(layouts[0]) or any(lay != layouts[0] for lay in layouts):
        return None
    new = copy_graph(graph)
    with new.inserting_before(segment.rank(new)):
        mask = segment.add_input(new, len(segment.inputs(new)))
    uses = _lead_terms(new)
    term = val(uses[0][1].args[0])
    mask.meta["val"] = term.new_empty((*term.shape[:-1], 1), dtype=torch.bool)
    for lead, m in uses:
        m.replace_input_with(lead, mask)
        if not lead.users:
            new.erase_node(lead)
    new.lint()
    return new


def _masked_term(node, inputs: list[fx.Node]) -> tuple[fx.Node, fx.Node, int] | None:
    """``(a, term, mask input index)`` when ``node`` is ``a + term * mask``."""
    if gf.op_name(node) != "add":
        return None
    for a, b in (node.args[:2], node.args[1::-1]):
        mask = b.args[1] if isinstance(b, fx.Node) and gf.op_name(b) == "mul" else None
        if mask in inputs and val(mask).dtype == torch.bool:
            return a, b.args[0], inputs.index(mask)
    return None


def expert_routing(graph: fx.Graph, tokens, whole: Collection[int] = ()) -> ExpertRouting | None:
    """How to send a sharded EP segment's tokens only to their experts' ranks, or None when the
    graph does not prove it exact. ``tokens`` are the capture's token symbols; ``whole`` the
    indices of the weights every rank holds whole (the graph keeps full shapes, so it cannot say)."""
    copy = copy_graph(graph)
    experts_as_op(copy)
    inputs, weight_inputs, rank = segment.inputs(copy), segment.weights(copy), segment.rank(copy)
    whole_weights = frozenset(weight_inputs[i] for i in whole)
    (output,) = copy.find_nodes(op="output")
    outs = output.args[0]
    if len(outs) != 1 or not all(token_major(gf.token_layout(n, tokens)) for n in [*inputs, outs[0]]):
        return None
    moe, owner = _scaled_source(outs[0]), None
    if (masked := _masked_term(moe, inputs)) is not None:
        moe, term, owner = _scaled_source(masked[0]), masked[1], masked[2]
        if not _row_local(term, set(inputs), tokens, whole_weights):
            return None
    if not FusedMoeCall.matches(moe):
        return None
    call = FusedMoeCall.of(moe)
    x, weights, ids, first = call.x, call.topk_weights, call.topk_ids, call.first_expert
    # the expert split wrote first = rank * (experts per rank); placeholders keep the full shapes
    if not (isinstance(first, fx.Node) and first.target is operator.mul and first.args[0] is rank):
        return None
    local = first.args[1]
    key = _routing_key(ids, inputs)
    if not isinstance(local, int) or key is None or _source(x) not in inputs:
        return None
    if not _row_local(weights, set(inputs), tokens, whole_weights):
        return None
    return ExpertRouting(input=key[0], per_rank=local, top_k=key[1], owner=owner)
