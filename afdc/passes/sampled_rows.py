"""Run the LM head on the sampled rows only.

A serving step samples one token per request, at its last scheduled token; the captured program
computes logits for every token of the step, so a long prefill pays the LM head (the widest
matmul of the model) and a ``[T, vocab]`` tensor for logits it throws away. This pass puts
``afdc::sampled_rows`` in front of the LM head: it keeps the rows the active step names
(``PagedBatch.last_rows``) and passes everything through otherwise.

The LM head is found from the program's ``logits`` output by walking back through pointwise ops
(a final soft-capping, a cast) to a matmul by a weight. A program where that walk ends anywhere
else is left unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from afdc.passes.graph_facts import IDENTITY_OPS, op_name

_HEADS = {"linear", "mm", "matmul"}


def _logits(graph: fx.Graph, out_spec: pytree.TreeSpec) -> fx.Node | None:
    """The output node's ``logits`` value (by the output structure's key)."""
    keys = list(out_spec.context or []) if isinstance(out_spec.context, (list, tuple)) else []
    if "logits" not in keys or out_spec.num_leaves != len(keys):
        return None
    (output,) = graph.find_nodes(op="output")
    value = output.args[0][keys.index("logits")]
    return value if isinstance(value, fx.Node) else None


def _is_weight(node) -> bool:
    while isinstance(node, fx.Node) and op_name(node) in ("t", "transpose", "permute", *IDENTITY_OPS):
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "get_attr"


def lm_head(graph: fx.Graph, out_spec: pytree.TreeSpec) -> fx.Node | None:
    """The matmul that computes the logits from the last hidden states, if the walk finds one
    (every value on the way used by the next one only, so nothing else sees fewer rows)."""
    node = _logits(graph, out_spec)
    while isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1:
        name = op_name(node)
        if name in _HEADS:
            return node if _is_weight(node.args[1]) else None
        pointwise = torch.Tag.pointwise in getattr(node.target, "tags", ()) or name in IDENTITY_OPS
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr"]
        if not pointwise or len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def sample_rows_only(module: fx.GraphModule, out_spec: pytree.TreeSpec) -> bool:
    """Insert ``afdc::sampled_rows`` before ``module``'s LM head; False when none was found."""
    head = lm_head(module.graph, out_spec)
    if head is None:
        return False
    hidden = head.args[0]
    with module.graph.inserting_before(head):
        rows = module.graph.call_function(torch.ops.afdc.sampled_rows.default, (hidden,))
    head.replace_input_with(hidden, rows)
    module.recompile()
    return True
