"""Whether an expert-parallel segment's tokens can go only to the ranks holding their experts.

An FFN rank under EP returns a partial result for every token it is sent; the attention side adds
the ranks' results. Sending a token only to the ranks holding experts it chose is exact when a
rank's result for any other token is exactly zero and a token's result depends on its own row
only. This pass proves both from the rank's segment graph rather than trusting a model family:
after kernel substitution (:func:`afdc.passes.fuse_moe.fuse_moe`) the segment's single output
must be one ``afdc::fused_moe`` (up to casts and views), whose op contract is "choices of experts
outside ``[first, first + E_local)`` add zero", with ``first = rank * E_local``; its activations
must be an input's rows; its expert ids must be an input, or the top-k of an input's scores; and
its routing weights must be computed row by row. Shared experts or dense terms added to the
output fail the first condition and keep the broadcast.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from afdc.passes import graph_facts as gf
from afdc.passes.fuse_moe import fuse_moe
from afdc.passes.fusion import copy_graph, val
from afdc.runtime.programs import ExpertRouting, row_major, token_major

_PASS_THROUGH = {"view", "reshape", "to", "_to_copy", "contiguous", "clone"}
# ops that compute each token's row from that row alone, given reductions over the last dim only
_ROW_LOCAL = _PASS_THROUGH | {
    "topk", "softmax", "sigmoid", "div", "div_", "mul", "mul_", "add", "sum", "amax", "unsqueeze",
}


def _source(node):
    while isinstance(node, fx.Node) and gf.op_name(node) in _PASS_THROUGH:
        node = node.args[0]
    return node


def _over_last_dim(node: fx.Node) -> bool:
    name = gf.op_name(node)
    last = val(node.args[0]).dim() - 1 if val(node.args[0]) is not None else -1
    if name == "topk":
        return (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)) in (-1, last)
    if name == "softmax":
        return node.args[1] in (-1, last)
    if name in ("sum", "amax"):
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return isinstance(dims, (list, tuple)) and list(dims) in ([-1], [last])
    if name == "unsqueeze":
        return node.args[1] in (-1, last + 1)
    return True


def _row_local(node, inputs: set[fx.Node], tokens) -> bool:
    """Whether ``node`` is computed from the ``inputs`` row by row (token-major all the way)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n in inputs:
            continue
        local = n.target is operator.getitem or (gf.op_name(n) in _ROW_LOCAL and _over_last_dim(n))
        token_major = val(n) is None or row_major(gf.token_layout(n, tokens))  # a tuple: its items are checked
        if n.op != "call_function" or not local or not token_major:
            return False
        stack += n.all_input_nodes
    return True


def _routing_key(ids, inputs: list[fx.Node]) -> tuple[int, int | None] | None:
    """``(input index, top_k)`` of the expert ids: an input itself, or ``topk(input, k)[1]``."""
    ids = _source(ids)
    if ids in inputs and not val(ids).is_floating_point():
        return inputs.index(ids), None
    if not (isinstance(ids, fx.Node) and ids.target is operator.getitem and ids.args[1] == 1):
        return None
    topk = ids.args[0]
    if gf.op_name(topk) != "topk" or not _over_last_dim(topk) or topk.args[0] not in inputs:
        return None
    largest = topk.args[3] if len(topk.args) > 3 else topk.kwargs.get("largest", True)
    return (inputs.index(topk.args[0]), int(topk.args[1])) if largest else None


def expert_routing(graph: fx.Graph, tokens) -> ExpertRouting | None:
    """How to send a sharded EP segment's tokens only to their experts' ranks, or None when the
    graph does not prove it exact. ``tokens`` are the capture's token symbols."""
    copy = copy_graph(graph)
    fuse_moe(copy)
    placeholders = copy.find_nodes(op="placeholder")
    inputs = [p for p in placeholders if p.name.startswith("x")]
    rank = placeholders[-1]
    (output,) = copy.find_nodes(op="output")
    outs = output.args[0]
    if len(outs) != 1 or not all(token_major(gf.token_layout(n, tokens)) for n in [*inputs, outs[0]]):
        return None
    moe = _source(outs[0])
    if gf.op_name(moe) != "fused_moe" or moe.target.namespace != "afdc":
        return None
    x, _, _, weights, ids, first, _ = moe.args
    # the expert split wrote first = rank * (experts per rank); placeholders keep the full shapes
    if not (isinstance(first, fx.Node) and first.target is operator.mul and first.args[0] is rank):
        return None
    local = first.args[1]
    key = _routing_key(ids, inputs)
    if not isinstance(local, int) or key is None or _source(x) not in inputs:
        return None
    if not _row_local(weights, set(inputs), tokens):
        return None
    return ExpertRouting(input=key[0], per_rank=local, top_k=key[1])
