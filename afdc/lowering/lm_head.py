"""The attention program's LM head: found, and split off to run once per step.

The LM head is found from the program's ``logits`` output by walking back through pointwise ops
(a final soft-capping, a cast) to a matmul by a weight. Two passes use it: ``sampled_rows`` runs
it on the rows a serving step samples, and :func:`split_head` cuts the program in two, a body
that returns the head's input rows where it returned the logits, and the head. A step split into
micro-batches runs each micro-batch's body and then the head once over all their rows: in decode
the head (the widest matmul of the model) is bound by reading its weight, which micro-batches
that each ran it read once per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from afdc.passes.graph_facts import IDENTITY_OPS, op_name
from afdc.passes.matching import copy_graph

_HEADS = {"linear", "mm", "matmul"}
_WEIGHT_VIEWS = {"t", "transpose", "permute", *IDENTITY_OPS}


def logits_index(out_spec: pytree.TreeSpec) -> int | None:
    """Which flat output is the ``logits`` (by the output structure's key), if any."""
    keys = list(out_spec.context or []) if isinstance(out_spec.context, (list, tuple)) else []
    if "logits" not in keys or out_spec.num_leaves != len(keys):
        return None
    return keys.index("logits")


def _logits(graph: fx.Graph, out_spec: pytree.TreeSpec) -> fx.Node | None:
    index = logits_index(out_spec)
    if index is None:
        return None
    (output,) = graph.find_nodes(op="output")
    value = output.args[0][index]
    return value if isinstance(value, fx.Node) else None


def _is_weight(node) -> bool:
    """A get_attr, or a view or cast of one (nothing that depends on the program's inputs)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        return True
    return node.op == "call_function" and op_name(node) in _WEIGHT_VIEWS and all(map(_is_weight, node.all_input_nodes))


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


@dataclass
class HeadSplit:
    """A program cut before its LM head: ``body`` returns the head's input at flat output
    ``index`` (in place of the logits), ``head`` maps those rows to the logits."""

    body: fx.GraphModule
    head: fx.GraphModule
    index: int


def _head_chain(graph: fx.Graph, out_spec: pytree.TreeSpec) -> list[fx.Node] | None:
    """The head's nodes, matmul first and logits last; None if the program has no LM head that
    works on each row alone (a bias or scale computed from the program's inputs, say)."""
    head = lm_head(graph, out_spec)
    if head is None:
        return None
    chain, logits = [head], _logits(graph, out_spec)
    while chain[-1] is not logits:
        (user,) = chain[-1].users
        chain.append(user)
    outside = [a for n in chain for a in n.all_input_nodes if a not in chain and a is not head.args[0]]
    return chain if all(map(_is_weight, outside)) else None


def split_head(module: fx.GraphModule, out_spec: pytree.TreeSpec) -> HeadSplit | None:
    """``module`` cut before its LM head, or None when it has none (``module`` is unchanged)."""
    chain = _head_chain(module.graph, out_spec)
    if chain is None:
        return None
    hidden = chain[0].args[0]

    head = fx.Graph()
    rows = head.placeholder("hidden")
    rows.meta = dict(hidden.meta)
    env = {hidden: rows}

    def copied(node: fx.Node) -> fx.Node:  # the head's weights and their views come along
        if node not in env:
            env[node] = head.node_copy(node, copied)
        return env[node]

    for node in chain:
        copied(node)
    head.output((env[chain[-1]],))

    body = copy_graph(module.graph)
    by_name = {n.name: n for n in body.nodes}
    (output,) = body.find_nodes(op="output")
    index = logits_index(out_spec)
    values = list(output.args[0])
    values[index] = by_name[hidden.name]
    output.args = (tuple(values),)
    # the head's nodes, then the weights and views only it used, leave the body
    for node in reversed([by_name[n.name] for n in env if n is not hidden]):
        if not node.users:
            body.erase_node(node)
    return HeadSplit(fx.GraphModule(module, body), fx.GraphModule(module, head), index)
