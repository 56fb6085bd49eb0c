"""Make graphs captured on the meta device run on any device.

Libraries choose device-specific code while they are traced, and on the meta device they take
the accelerator's path. One choice breaks CPUs: transformers counts tokens per expert with
``histc`` on integers off-CPU, and the CPU kernel of ``histc`` takes floating point only.
Expert ids are small integers, exact in float32, so the cast changes no count.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from afdc.passes import graph_facts as gf


def portable(graph: fx.Graph) -> fx.Graph:
    for node in list(graph.nodes):
        if gf.is_op(node, torch.ops.aten.histc) and not node.args[0].meta["val"].is_floating_point():
            with graph.inserting_before(node):
                cast = graph.call_function(torch.ops.aten.to.dtype, (node.args[0], torch.float32))
            cast.meta["val"] = node.args[0].meta["val"].float()
            node.replace_input_with(node.args[0], cast)
    return graph
