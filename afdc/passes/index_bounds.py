"""Which inputs of an FFN segment are indices, and the range each must lie in.

The attention side sends a segment its inputs; some are integers the segment indexes with: expert
ids from a router on the attention side, token ids that a hash-routed MoE looks its experts up
by. An id out of the indexed dimension makes the indexing op raise on a CPU, and on a GPU is a
device-side assert that ends the FFN server's CUDA context, for every peer it serves: so the
server checks each such input's values before it runs the layer (:mod:`afdc.runtime.server`).

The rule, read from the graph alone: an integer input that reaches, through ops that keep its
values (views, reshapes, casts, copies), the index argument of an indexing op whose indexed
dimension has a static size ``n`` must lie in ``[0, n)``; over several such uses, the smallest
``n``. The indexing ops are aten's (``index``, ``index_put``, ``embedding``, ``gather``,
``index_select``, ``scatter``, ``index_add`` and their kin, ``one_hot``) and the routed-experts
op, whose expert ids index its stacked experts: the segment's experts are matched as that op on
a copy (:func:`~afdc.passes.moe_experts.experts_as_op`) to read them, since transformers' own form
only sorts and counts the ids. A negative index, which some of these ops wrap and others refuse,
is refused: no id the attention side computes is negative.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from afdc import segment
from afdc.codegen.fused_moe import FusedMoeCall
from afdc.ops.call import bound
from afdc.passes.graph_facts import IDENTITY_OPS, op_name
from afdc.passes.matching import copy_graph, val
from afdc.passes.moe_experts import experts_as_op
from afdc.segment import IndexBound

# ops whose first argument's values come out unchanged (some of them, or cast, or rearranged)
_KEEP_VALUES = IDENTITY_OPS | {
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "unsqueeze", "squeeze", "expand", "permute",
    "transpose", "t", "select", "slice", "narrow",
}
# ops indexing their ``self`` along ``dim`` with ``index``
_ALONG_DIM = {
    "gather", "index_select", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
    "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
    "index_reduce", "index_reduce_",
}
# ops indexing dim d of their ``self`` with ``indices[d]``
_PER_DIM = {"index", "_unsafe_index", "index_put", "index_put_", "_unsafe_index_put", "_index_put_impl_"}


def index_bounds(graph: fx.Graph) -> tuple[IndexBound, ...]:
    """The range of each input of segment ``graph`` that it indexes with, in input order."""
    if not any(_integral(x) for x in segment.inputs(graph)):  # a dense layer's: no copy, no matching
        return ()
    experts = copy_graph(graph)
    experts_as_op(experts)
    sizes: dict[int, int] = {}
    for g in (graph, experts):
        for i, x in enumerate(segment.inputs(g)):
            found = _sizes_indexed(x)
            if found:
                sizes[i] = min(found + ([sizes[i]] if i in sizes else []))
    return tuple(IndexBound(i, n) for i, n in sorted(sizes.items()))


def _sizes_indexed(x: fx.Node) -> list[int]:
    """The static sizes of the dimensions that ``x``'s values index, through ops keeping them."""
    if not _integral(x):
        return []
    sizes, stack, seen = [], [x], set()
    while stack:
        value = stack.pop()
        for user in value.users:
            if user.op != "call_function" or (user, value) in seen:
                continue
            seen.add((user, value))
            if op_name(user) in _KEEP_VALUES and user.args[0] is value:
                stack.append(user)
            sizes += [n for n in _indexed(user, value) if isinstance(n, int) and n > 0]
    return sizes


def _integral(x: fx.Node) -> bool:
    """Whether ``x`` is an integer tensor (what can index)."""
    v = val(x)
    return v is not None and v.dtype != torch.bool and not v.is_floating_point() and not v.is_complex()


def _indexed(user: fx.Node, value: fx.Node) -> list:
    """The sizes of the dimensions ``user`` indexes with ``value`` (ints where static)."""
    if FusedMoeCall.matches(user):
        call = FusedMoeCall.of(user)
        return [_size(call.w_gate_up, 0)] if call.topk_ids is value else []
    name = op_name(user)
    if name not in _ALONG_DIM | _PER_DIM | {"embedding", "one_hot"}:
        return []
    args = bound(user, user.target)
    if name in _ALONG_DIM:
        return [_size(args["self"], args["dim"])] if args.get("index") is value else []
    if name in _PER_DIM:
        return [_size(args["self"], d) for d, index in enumerate(args.get("indices") or ()) if index is value]
    if name == "embedding":
        return [_size(args["weight"], 0)] if args["indices"] is value else []
    return [args["num_classes"]] if args["self"] is value else []  # one_hot (-1: from the values, no bound)


def _size(node, dim) -> int | None:
    shape = val(node).shape if val(node) is not None else None
    if shape is None or not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
        return None
    size = shape[dim]
    return size if isinstance(size, int) else None
