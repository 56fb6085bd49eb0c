"""A gated MLP's ``act(gate) * up`` as afdc's fused activation-and-multiply kernel.

Anchored on ``silu`` and ``gelu`` nodes: the activation's only user must multiply it by a tensor
of exactly its shape (no broadcast), which is the gated-MLP product whatever the model calls its
projections. The gate and up halves are often two chunks of one projection; the kernel reads them
through their strides, so nothing is copied.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from afdc.codegen import act_mul as _act_mul_op  # noqa: F401 (defines the op this pass emits)
from afdc.passes.graph_facts import op_name, shapes_match
from afdc.passes.matching import FusionReport, activation_of, expect, only_user, run_matches, val


def fuse_activations(graph: fx.Graph) -> FusionReport:
    """Replace every exact ``silu(a) * b`` and ``gelu(a) * b`` in ``graph`` with ``afdc::act_mul``."""
    anchors = [n for n in graph.nodes if op_name(n) in ("silu", "gelu")]
    report = run_matches(graph, "act_mul", anchors, lambda n: _rewrite(graph, n))
    graph.lint()
    return report


def _rewrite(graph: fx.Graph, act: fx.Node) -> None:
    kind = activation_of(act)
    mul = only_user(act)
    expect(op_name(mul) == "mul" and len(mul.args) == 2 and not mul.kwargs, "the activation is not multiplied")
    gate = act.args[0]
    up = mul.args[1] if mul.args[0] is act else mul.args[0]
    expect(up is not act and isinstance(up, fx.Node) and val(up) is not None, "not multiplied by a tensor")
    expect(shapes_match(val(up).shape, val(gate).shape) and shapes_match(val(up).shape, val(mul).shape),
           "the product broadcasts")
    with graph.inserting_before(mul):
        fused = graph.call_function(torch.ops.afdc.act_mul.default, (gate, up, kind))
    fused.meta = dict(mul.meta)
    mul.replace_all_uses_with(fused)
    graph.erase_node(mul)
    graph.erase_node(act)
