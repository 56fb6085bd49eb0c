"""RMSNorm and LayerNorm, with the residual add before them, as afdc's fused norm kernels.

RMSNorm has no ATen op: models write it out (``x.float()``, ``pow(2).mean(-1)``, ``rsqrt``, a
multiply, a cast back, a weight or Gemma's ``1 + weight``). The pass anchors on ``rsqrt`` and
walks that chain; LayerNorm is one ``aten.layer_norm`` node, or the same chain over
``x - mean(x)`` (Cohere's norms, written out without a bias). When the normalized value is itself
a same-shape residual add that the residual stream reads on, the add goes into the kernel too:
``afdc::add_rms_norm`` returns both the sum and its norm, read and written in one pass.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from afdc.codegen import layer_norm as _layer_norm_ops  # noqa: F401 (defines the ops this pass emits)
from afdc.codegen import rms_norm as _rms_norm_ops  # noqa: F401
from afdc.passes.graph_facts import op_name, shapes_match
from afdc.passes.matching import FusionReport, arg, expect, only_user, run_matches, strip_float_casts, val


def fuse_norms(graph: fx.Graph) -> FusionReport:
    """Replace every exact RMSNorm and LayerNorm in ``graph`` with afdc's norm ops."""
    report = run_matches(graph, "rms_norm", [n for n in graph.nodes if op_name(n) == "rsqrt"],
                         lambda n: _rewrite_written_norm(graph, n))
    layer_norms = [n for n in graph.nodes if n.target is torch.ops.aten.layer_norm.default]  # not afdc's own
    report.merge(run_matches(graph, "layer_norm", layer_norms, lambda n: _rewrite_layer_norm(graph, n)))
    graph.lint()
    return report


def _scalar(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _last_dim(dims, rank: int) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _mean_over_last_dim(node, of: fx.Node) -> bool:
    return (op_name(node) == "mean" and node.args[0] is of and _last_dim(arg(node, 1, "dim"), val(of).dim())
            and arg(node, 2, "keepdim", False))


def _centered(h: fx.Node) -> fx.Node | None:
    """The mean ``m`` when ``h = x - m`` with ``m = mean(x, -1, keepdim=True)``."""
    if op_name(h) != "sub" or len(h.args) != 2 or h.kwargs or not isinstance(h.args[1], fx.Node):
        return None
    return h.args[1] if _mean_over_last_dim(h.args[1], h.args[0]) else None


def _rewrite_written_norm(graph: fx.Graph, rsqrt: fx.Node) -> str:
    """``h * rsqrt(mean(h**2) + eps)``: RMSNorm of ``h``, or LayerNorm of ``x`` when ``h`` is
    ``x - mean(x)`` (then the multiplied ``h`` may be a second, identical ``x - mean(x)``)."""
    add = rsqrt.args[0]
    expect(op_name(add) == "add" and _scalar(add.args[1]) and not add.kwargs, "rsqrt of something other than x + eps")
    mean = add.args[0]
    expect(op_name(mean) == "mean", "no mean of squares under the rsqrt")
    square = mean.args[0]
    h = square.args[0]
    expect(op_name(square) == "pow" and square.args[1] == 2, "the mean is not over x ** 2")
    expect(_mean_over_last_dim(mean, square), "not over the last dim")
    expect(val(h).dtype == torch.float32, "computed in a half type (the kernel computes in float32)")
    expect(bool(only_user(add) and only_user(mean) and only_user(square)), "a partial value is reused")
    norm = only_user(rsqrt)
    expect(op_name(norm) == "mul" and rsqrt in norm.args, "nothing is multiplied by rsqrt(mean(x**2) + eps)")
    scaled = norm.args[0] if norm.args[1] is rsqrt else norm.args[1]
    center = _centered(h)
    if center is None:
        expect(scaled is h, "x is not multiplied by rsqrt(mean(x**2) + eps)")
        x = strip_float_casts(h)
        end, weight, offset = _weighting(norm, val(x).shape[-1])
        chain = {rsqrt, add, mean, square, norm, h} | _between(end, norm)
        _substitute(graph, x, end, chain, "rms_norm", (weight, float(add.args[1]), offset))
        return "rms_norm"
    source = h.args[0]
    expect(scaled is h or (_centered(scaled) is center and scaled.args[0] is source),
           "x - mean(x) is not multiplied by rsqrt(var + eps)")
    expect(set(center.users) <= {h, scaled} and set(h.users) <= {square, norm} and len(scaled.users) == 1,
           "a partial value is reused")
    x = strip_float_casts(source)
    end, weight, offset = _weighting(norm, val(x).shape[-1])
    expect(offset == 0.0, "a (1 + w) weight on a LayerNorm")
    chain = {rsqrt, add, mean, square, norm, h, scaled, center, source} | _between(end, norm)
    _substitute(graph, x, end, chain, "layer_norm", (weight, None, float(add.args[1])))
    return "layer_norm"


def _weighting(norm: fx.Node, hidden: int) -> tuple[fx.Node, fx.Node | None, float]:
    """Past the normalization: an optional cast, the weight (``w`` or ``1 + w``), an optional
    cast; returns the last node of the chain, the weight and its offset."""
    end = norm
    if len(end.users) == 1 and op_name(only_user(end)) in ("to", "_to_copy", "type_as"):
        end = only_user(end)
    if len(end.users) != 1:
        return end, None, 0.0
    mul = only_user(end)
    if op_name(mul) != "mul" or len(mul.args) != 2 or end not in mul.args:
        return end, None, 0.0
    other = mul.args[1] if mul.args[0] is end else mul.args[0]
    if not isinstance(other, fx.Node) or val(other) is None or tuple(val(other).shape) != (hidden,):
        return end, None, 0.0
    weight, offset = strip_float_casts(other), 0.0
    if op_name(weight) == "add" and len(weight.users) == 1 and weight.args[1] in (1, 1.0) and not weight.kwargs:
        weight, offset = strip_float_casts(weight.args[0]), 1.0
    end = mul
    if len(end.users) == 1 and op_name(only_user(end)) in ("to", "_to_copy", "type_as"):
        end = only_user(end)
    return end, weight, offset


def _between(end: fx.Node, start: fx.Node) -> set[fx.Node]:
    """The nodes from ``end`` back to ``start`` along first inputs and the weight side."""
    nodes, frontier = set(), [end]
    while frontier:
        node = frontier.pop()
        if node is start or node in nodes or node.op != "call_function":
            continue
        nodes.add(node)
        frontier += [a for a in node.args if isinstance(a, fx.Node) and len(a.users) == 1]
    return nodes


def _rewrite_layer_norm(graph: fx.Graph, node: fx.Node) -> None:
    x, shape = node.args[0], node.args[1]
    expect(list(shape) == [val(x).shape[-1]], "normalizes more than the last dim")
    weight, bias, eps = arg(node, 2, "weight"), arg(node, 3, "bias"), arg(node, 4, "eps", 1e-5)
    _substitute(graph, x, node, {node}, "layer_norm", (weight, bias, float(eps)))


def _substitute(graph: fx.Graph, x: fx.Node, end: fx.Node, chain: set[fx.Node], kind: str, params: tuple) -> None:
    """Put the norm op (fused with ``x``'s residual add when there is one) where ``end`` was."""
    out_dtype = val(end).dtype
    inputs = [p for p in params if isinstance(p, fx.Node)]
    residual = _residual_add(x)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if residual is not None and all(order[p] < order[x] for p in inputs):
        with graph.inserting_after(x):
            fused = graph.call_function(getattr(torch.ops.afdc, f"add_{kind}").default,
                                        (*residual, *params, out_dtype))
        with graph.inserting_after(fused):
            summed = graph.call_function(operator.getitem, (fused, 1))
            normed = graph.call_function(operator.getitem, (fused, 0))
        fused.meta["val"] = (val(end), val(x))
        summed.meta, normed.meta = dict(x.meta), dict(end.meta)
        end.replace_all_uses_with(normed)
        x.replace_all_uses_with(summed)
        chain = chain | {x}
    else:
        anchor = max([x, *inputs], key=order.__getitem__)
        with graph.inserting_after(anchor):
            normed = graph.call_function(getattr(torch.ops.afdc, kind).default, (x, *params, out_dtype))
        normed.meta = dict(end.meta)
        end.replace_all_uses_with(normed)
    for node in sorted(chain, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def _residual_add(x: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` when ``x = a + b`` of two same-shape, same-dtype tensors (a residual add)."""
    if op_name(x) != "add" or x.kwargs or len(x.args) != 2:
        return None
    a, b = x.args
    if val(a) is None or val(b) is None:
        return None
    if not (shapes_match(val(a).shape, val(x).shape) and shapes_match(val(b).shape, val(x).shape)):
        return None
    if val(a).dtype != val(b).dtype:
        return None
    return a, b

