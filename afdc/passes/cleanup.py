"""Clean-up passes run on the captured graph before classification."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from afdc.passes.graph_facts import op_name, over_last_dim

# Run-time metadata checks export leaves behind; they hang off values without feeding anything
# and would otherwise have to be assigned to a side.
_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)
_SAME_VALUES = ("view", "reshape", "to", "_to_copy")


def strip_assertions(graph: fx.Graph) -> fx.Graph:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    return graph


def drop_sentinel_masks(graph: fx.Graph) -> fx.Graph:
    """Remove the zeroing of rows whose expert id is past the last expert, where the ids are a top-k.

    transformers' grouped-matmul experts sort the (token, choice) pairs by expert id, count them
    per expert (``histc``), and around each grouped matmul zero the rows of ids ``>= experts``
    (``masked_fill(rows, (ids >= experts)[:, None], 0)``; the ids are also clamped in place for the
    bias gathers): sentinels of transformers' own expert parallelism. 5.17 does it always, later
    versions only under that parallelism. Ids that are the indices of a top-k over at most
    ``experts`` scores are never out of range, so there the masks and the clamp change no value;
    left in, the mask would cross the cut as a tensor of its own and hide the experts' form from
    the kernel matcher."""
    for hist in [n for n in graph.nodes if op_name(n) == "histc"]:
        ids = hist.args[0]
        while op_name(ids) in ("to", "_to_copy"):
            ids = ids.args[0]
        experts = hist.args[1] if len(hist.args) > 1 else hist.kwargs.get("bins")
        if not isinstance(experts, int) or not _top_k_below(ids, experts):
            continue
        for user in list(ids.users):
            if op_name(user) == "clamp_" and user.args[1:] == (None, experts - 1):
                user.replace_all_uses_with(ids)
                graph.erase_node(user)
            elif op_name(user) == "ge" and user.args[1] == experts:
                for mask in [u for u in user.users if op_name(u) == "unsqueeze" and u.args[1] in (-1, 1)]:
                    for fill in [u for u in mask.users if _zeroes(u, mask)]:
                        fill.replace_all_uses_with(fill.args[0])
                        graph.erase_node(fill)
    graph.eliminate_dead_code()
    return graph


def _zeroes(node: fx.Node, mask: fx.Node) -> bool:
    return op_name(node) in ("masked_fill", "masked_fill_") and node.args[1] is mask and node.args[2] == 0


def _top_k_below(ids, experts: int) -> bool:
    """Whether ``ids`` (past a sort's values, views and casts) are top-k indices into a last dim
    of at most ``experts``."""
    if ids.target is operator.getitem and op_name(ids.args[0]) == "sort" and ids.args[1] == 0:
        ids = ids.args[0].args[0]
    while op_name(ids) in _SAME_VALUES:
        ids = ids.args[0]
    if not (ids.target is operator.getitem and op_name(ids.args[0]) == "topk" and ids.args[1] == 1):
        return False
    topk = ids.args[0]
    scores = topk.args[0].meta.get("val")
    return (scores is not None and over_last_dim(topk) and isinstance(scores.shape[-1], int)
            and scores.shape[-1] <= experts)
