"""Clean-up passes run on the captured graph before classification."""

from __future__ import annotations

import torch
import torch.fx as fx

# Run-time metadata checks export leaves behind; they hang off values without feeding anything
# and would otherwise have to be assigned to a side.
_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)


def strip_assertions(graph: fx.Graph) -> fx.Graph:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    return graph
