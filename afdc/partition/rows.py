"""Share a replicated term of a partial sum out over the FFN ranks by token rows.

In a sharded MoE segment, a term every rank holds whole (a shared expert with replicated weights,
for instance) is added to the ranks' partial sums once: computed by every rank for every token
and multiplied by zero on all but rank 0. When the term is computed token by token (each
token's output depends on that token's input only), rank r can instead compute it for its own
contiguous share of the tokens and pad the rest with zeros: the shares add up to the whole
term, and each rank does 1/F of the work.

Tokens lead a value's shape as ``[T, ...]`` or ``[b, s, ...]``. The term is computed on the
token-flattened ``[n, ...]`` share, so every op in it must ignore how the tokens are laid out:
linear maps, pointwise ops with constants no wider than the per-token part, and reductions or
softmaxes over per-token dims counted from the end. Anything else (a reshape, a size read from
outside, a reduction over tokens, an op not on the list) leaves the term to rank 0.

:func:`row_local` finds the nodes that compute only that term and checks them;
:class:`RowShares` emits the slicing and padding in the rewritten graph.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from afdc.passes import graph_facts as gf

_IDENTITY = {"to", "_to_copy", "type_as", "clone", "contiguous", "alias", "detach", "dropout"}
_CONTRACTIONS = {"linear", "mm", "matmul"}
_ALONG_DIM = {"softmax", "_softmax", "log_softmax", "_log_softmax", "sum", "mean", "amax", "amin"}
_SPLITS = {"chunk": 2, "split": 2, "split_with_sizes": 2, "unbind": 1}  # op -> position of its dim argument


def _name(node: fx.Node) -> str:
    target = node.target
    return target.__name__.split(".")[0] if isinstance(target, torch._ops.OpOverload) else ""


def _leading(node: fx.Node, tokens: sympy.Expr) -> int | None:
    """How many leading dims of ``node``'s tensor hold the ``tokens`` (1 for ``[T, ...]``, 2 for
    ``[b, s, ...]``), 0 for a tensor with no token dim, None for anything else."""
    if not gf.is_tensor(node):
        return None
    dims = [gf.sym_expr(d) for d in node.meta["val"].shape]
    symbolic = [bool(d.free_symbols) for d in dims]
    if not any(symbolic):
        return 0
    lead = symbolic.index(False) if False in symbolic else len(dims)
    if lead > 2 or any(symbolic[lead:]) or sympy.expand(math.prod(dims[:lead]) - tokens) != 0:
        return None
    return lead


@dataclass
class RowTerm:
    """A replicated term to share out by token rows."""

    nodes: set[fx.Node]  # what computes only the term (the term included)
    reads: list[fx.Node]  # token-led tensors the nodes read from outside
    like: fx.Node  # one of them whose leading dims are the term's (to give the term its shape back)


def row_local(graph: fx.Graph, operand: fx.Node) -> RowTerm | None:
    """The term ``operand`` when it can be computed on a share of the tokens, else None."""
    if not gf.is_tensor(operand) or not operand.meta["val"].dim():
        return None
    shape = [gf.sym_expr(d) for d in operand.meta["val"].shape]
    tokens = math.prod(d for d in shape[:2] if d.free_symbols)
    lead = _leading(operand, tokens)
    if not lead:
        return None
    nodes = {operand}
    node = operand.prev
    while node.op != "root":
        if node.op == "call_function" and node.users and all(user in nodes for user in node.users):
            nodes.add(node)
        node = node.prev
    reads: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg in nodes:
                continue
            arg_lead = _leading(arg, tokens)
            if arg_lead is None:
                return None  # a size, a tuple, or a tensor not led by these tokens
            if arg_lead and arg not in reads:
                reads.append(arg)
        if not _token_wise(node, tokens):
            return None
    like = next((r for r in reads if [gf.sym_expr(d) for d in r.meta["val"].shape[:lead]] == shape[:lead]), None)
    return RowTerm(nodes, reads, like) if like is not None else None


def _token_wise(node: fx.Node, tokens: sympy.Expr) -> bool:
    """Whether ``node`` computes the same on ``[n, ...]`` token-flattened inputs, token by token."""
    name = _name(node)
    if node.target is operator.getitem:
        return _name(node.args[0]) in _SPLITS  # a piece of a split along per-token dims (checked there)
    if name in _SPLITS:
        source = node.args[0]
        lead, pos = _leading(source, tokens), _SPLITS[name]
        dim = node.args[pos] if len(node.args) > pos else 0
        return bool(lead) and isinstance(dim, int) and -(source.meta["val"].dim() - lead) <= dim < 0
    leads = [_leading(a, tokens) for a in node.all_input_nodes]
    lead = _leading(node, tokens)
    if lead == 0 and all(x == 0 for x in leads):
        return True  # no token dimension anywhere (a weight's transpose, say)
    if not lead or None in leads:
        return False
    per_token = node.meta["val"].dim() - lead  # dims left once the tokens are flattened
    if name in _CONTRACTIONS:
        a, b = node.args[:2]
        return bool(_leading(a, tokens)) and _leading(b, tokens) == 0 and b.meta["val"].dim() <= 2
    if torch.Tag.pointwise in getattr(node.target, "tags", ()) or name in _IDENTITY:
        # a constant may broadcast over the per-token dims only
        return all(x or a.meta["val"].dim() <= per_token for a, x in zip(node.all_input_nodes, leads))
    if name in _ALONG_DIM and len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        source = node.args[0].meta["val"].dim() - _leading(node.args[0], tokens)
        return bool(dims) and all(isinstance(d, int) and -source <= d < 0 for d in dims)
    return False


class RowShares:
    """Emits, in the rewritten graph, rank ``rank``'s token share [lo, hi) of ``ranks`` and the
    slices and paddings that use it."""

    def __init__(self, graph: fx.Graph, rank: fx.Node, ranks: int):
        self.graph, self.rank, self.ranks = graph, rank, ranks
        self._bounds: tuple[fx.Node, fx.Node, fx.Node] | None = None
        self._slices: dict[fx.Node, fx.Node] = {}

    def _call(self, target, *args) -> fx.Node:
        return self.graph.call_function(target, args)

    def _flat(self, node: fx.Node, original: fx.Node) -> fx.Node:
        """``node`` (laid out as ``original``) as ``[tokens, per-token...]``."""
        shape = original.meta["val"].shape
        lead = len(shape) - sum(1 for d in shape if not gf.sym_expr(d).free_symbols)
        if lead == 1:
            return node
        return self._call(torch.ops.aten.reshape.default, node, [-1, *(int(d) for d in shape[lead:])])

    def _share(self, flat: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
        if self._bounds is None:
            total = self._call(torch.ops.aten.sym_size.int, flat, 0)
            lo = self._call(operator.floordiv, self._call(operator.mul, self.rank, total), self.ranks)
            after = self._call(operator.add, self.rank, 1)
            hi = self._call(operator.floordiv, self._call(operator.mul, after, total), self.ranks)
            self._bounds = (total, lo, hi)
        return self._bounds

    def slice(self, node: fx.Node, original: fx.Node) -> fx.Node:
        """This rank's tokens of ``node`` (the rewritten ``original``), flattened."""
        if node not in self._slices:
            flat = self._flat(node, original)
            _, lo, hi = self._share(flat)
            self._slices[node] = self._call(torch.ops.aten.slice.Tensor, flat, 0, lo, hi)
        return self._slices[node]

    def pad(self, part: fx.Node, term: fx.Node, like: fx.Node, like_original: fx.Node) -> fx.Node:
        """``part`` (this rank's tokens of ``term``) among all the tokens, zeros elsewhere, in
        ``term``'s layout; ``like`` is a rewritten token-led input laid out as ``like_original``."""
        total, lo, hi = self._share(self._flat(like, like_original))
        per_token = [int(d) for d in term.meta["val"].shape if not gf.sym_expr(d).free_symbols]
        pad = [0, 0] * len(per_token) + [lo, self._call(operator.sub, total, hi)]  # last dim first
        full = self._call(torch.ops.aten.constant_pad_nd.default, part, pad)
        lead = term.meta["val"].dim() - len(per_token)
        if lead == 1:
            return full
        sizes = [self._size(like, like_original, d) for d in term.meta["val"].shape[:lead]]
        return self._call(torch.ops.aten.reshape.default, full, [*sizes, *per_token])

    def _size(self, like: fx.Node, like_original: fx.Node, dim) -> fx.Node:
        expr = gf.sym_expr(dim)
        for i, d in enumerate(like_original.meta["val"].shape):
            if gf.sym_expr(d) == expr:
                return self._call(torch.ops.aten.sym_size.int, like, i)
        raise AssertionError(f"row_local chose {like_original.name}, which has no dimension of size {expr}")
