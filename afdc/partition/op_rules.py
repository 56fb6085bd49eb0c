"""The layout rules of the ops sharding knows: how each op maps its inputs' layouts to its output's.

:data:`RULES` is keyed by the op a node calls: its overload packet (``aten.add`` for
``aten.add.Tensor``, so ``foo::add`` is another op), or the callable itself for a Python target
(``operator.getitem``). A rule is registered with :func:`rule`, as DTensor registers sharding
strategies. An op tagged ``pointwise`` without a rule of its own takes :func:`pointwise`; any
other op accepts only replicated inputs (its undecided weights are kept whole), so a pattern
without a rule ends up replicated or refused, never wrong.

:func:`visit` applies them. Only the rules for structure (``always``: a tuple's element, a size
read) see every call; a scalar, or a value computed from replicated values only, is replicated
whatever the op. A rule returns None where it has no answer for the layouts it is given; the op
is then treated as one without a rule. Rules decide weights' splits through the
:class:`~afdc.partition.propagation.PropagationState` they are given, and raise
:class:`~afdc.partition.layout.Conflict` (or :class:`~afdc.partition.layout.NeedBlocks`) when
the decisions made so far do not fit.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
import transformers.integrations.moe  # noqa: F401 (registers transformers::grouped_mm_fallback)

from afdc.ops import AttentionCall
from afdc.partition.layout import Conflict, Kind, Layout, NeedBlocks, R, shape, union
from afdc.partition.propagation import FFNParallel, PropagationState
from afdc.passes import graph_facts as gf

aten = torch.ops.aten

Outcome = Layout | list[Layout] | None  # a value's layout, a tuple's, or None: no answer


@dataclass(frozen=True)
class Rule:
    apply: Callable[[PropagationState, fx.Node], Outcome]
    always: bool  # also for a scalar output or all inputs replicated (a rule for structure, not values)


RULES: dict[object, Rule] = {}


def rule(*ops, always: bool = False):
    """Register the decorated function as the rule of ``ops`` (overload packets, or callables as
    nodes call them)."""

    def register(fn: Callable[[PropagationState, fx.Node], Outcome]):
        for op in ops:
            if op in RULES:
                raise ValueError(f"{op} has two layout rules")
            RULES[op] = Rule(fn, always)
        return fn

    return register


def op_of(node: fx.Node):
    """What :data:`RULES` is keyed by for ``node``: its overload packet, or its target."""
    return getattr(node.target, "overloadpacket", node.target)


def visit(prop: PropagationState, node: fx.Node) -> Layout | list[Layout]:
    """The layout of the value ``node`` computes (a list for a tuple), by its op's rule."""
    found = RULES.get(op_of(node))
    if found is not None and found.always:
        return found.apply(prop, node)
    if not gf.is_tensor(node) and not isinstance(node.meta.get("val"), (tuple, list)):
        return R  # a size or a flag: the same on every rank
    tensors = [prop.get(a) for a in node.all_input_nodes if gf.is_tensor(a)]
    if all(t.replicated for t in tensors):
        return _replicated_outputs(node)
    apply = found.apply if found is not None else pointwise if _tagged_pointwise(node) else None
    if apply is not None and (out := apply(prop, node)) is not None:
        return out
    tensors = [prop.replicate_undecided(t) for t in tensors]  # a weight read by an op with no rule stays whole
    if all(t.replicated for t in tensors):
        return _replicated_outputs(node)
    raise Conflict(union(tensors), f"{gf.where(node)} has no rule for split or partial values")


def _tagged_pointwise(node: fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _replicated_outputs(node: fx.Node) -> Layout | list[Layout]:
    val = node.meta.get("val")
    return [R] * len(val) if isinstance(val, (tuple, list)) else R


def _all_replicated(prop: PropagationState, node: fx.Node, args) -> Layout:
    lays = [prop.replicate_undecided(prop.get(a)) for a in args]
    if all(lay.replicated for lay in lays):
        return R
    raise Conflict(union(lays), f"{gf.where(node)} has no rule for split values")


# -- structure -------------------------------------------------------------------------------------


@rule(operator.getitem, always=True)
def _getitem(prop: PropagationState, node: fx.Node) -> Layout:
    parent = prop.env[node.args[0]]
    return parent[node.args[1]] if isinstance(parent, list) else prop.get(node.args[0])


@rule(aten.sym_size, always=True)
def _sym_size(prop: PropagationState, node: fx.Node) -> Layout:
    lay = prop.get(node.args[0])
    if lay.kind in (Kind.SPLIT, Kind.EXPERTS) and node.args[1] % len(shape(node.args[0])) == lay.dim:
        raise Conflict(lay.blame, "the size of a split dimension is read")
    return R


# -- elementwise -----------------------------------------------------------------------------------

# f(0) == 0: the zeros of rows a rank does not own stay zeros
_ZERO_AT_ZERO = {
    aten.silu, aten.gelu, aten.relu, aten.tanh, aten.neg, aten.erf, aten.abs, aten.leaky_relu, aten.elu,
    aten.sqrt, aten.sin,
}
_ADD = {aten.add, aten.add_, aten.sub, aten.sub_}
_MUL = {aten.mul, aten.mul_}
_DIV = {aten.div, aten.div_}
_IDENTITY = {getattr(aten, name) for name in gf.IDENTITY_OPS}  # the value passes through unchanged


@rule(*_IDENTITY, aten.copy, aten.copy_)  # copy_: the written value, elementwise
def pointwise(prop: PropagationState, node: fx.Node) -> Layout:
    """Elementwise ops: split operands split alike (whole ones broadcast, or split along with
    them), partial sums through ops linear in them, and rows owned by one rank through ops that
    keep the other ranks' zeros zero."""
    op = op_of(node)
    tensors = [a for a in node.args if isinstance(a, fx.Node) and gf.is_tensor(a)]
    lays = [prop.get(a) for a in tensors]
    if any(lay.kind is Kind.SPLIT for lay in lays):
        return _pointwise_split(prop, node, tensors, lays)
    lays = [prop.replicate_undecided(lay) for lay in lays]
    kinds = {lay.kind for lay in lays} - {Kind.REPLICATED}
    blame = union(lays)
    if not kinds:
        return R
    if Kind.PARTIAL in kinds or Kind.EXPERTS in kinds:
        if kinds <= {Kind.PARTIAL, Kind.OWNED}:
            return _pointwise_partial(prop, node, tensors, lays, blame)
        raise Conflict(blame, f"{gf.where(node)} mixes a partial sum with another layout")
    # Only OWNED / OWNED_ONLY / REPLICATED remain: track which elements are exact zeros.
    args = [prop.get(a) if isinstance(a, fx.Node) else a for a in node.args]
    owned = [isinstance(a, Layout) and a.kind is Kind.OWNED for a in args]
    if op in _MUL and any(owned):
        return Layout(Kind.OWNED, blame=blame)
    if op in _DIV and owned[0] and not any(owned[1:]):
        return Layout(Kind.OWNED, blame=blame)
    if op in _ADD and all(o or a == 0 for o, a in zip(owned, args[:2])):
        return Layout(Kind.OWNED, blame=blame)
    # a masked_fill's mask only says where: filling with zero keeps every zero, whatever the mask's layout
    if owned[0] and _zero_at_zero(op, args) and (len(tensors) == 1 or op is aten.masked_fill):
        return Layout(Kind.OWNED, blame=blame)
    return Layout(Kind.OWNED_ONLY, blame=blame)


def _zero_at_zero(op, args) -> bool:
    if op in _ZERO_AT_ZERO or op in _IDENTITY or op in _MUL or op in _DIV:
        return True
    if op is aten.clamp:
        lo, hi = [*args[1:], None, None][:2]
        return (lo is None or lo <= 0) and (hi is None or hi >= 0)
    if op is aten.pow:
        return isinstance(args[1], (int, float)) and args[1] > 0
    if op is aten.masked_fill:
        return args[2] == 0
    return False


def _pointwise_partial(prop: PropagationState, node, tensors, lays, blame) -> Layout:
    op = op_of(node)
    linear_in_first = op in _MUL or op in _DIV or op in _IDENTITY or op is aten.neg
    partial = [lay.kind in (Kind.PARTIAL, Kind.OWNED) for lay in lays]
    if op in _ADD:
        for t, is_partial in zip(tensors, partial):
            if not is_partial:
                prop.lead_only[node] = node.args.index(t)  # a replicated addend counts once
        return Layout(Kind.PARTIAL, blame=blame)
    if linear_in_first and sum(partial) == 1 and (partial[0] or op in _MUL):
        return Layout(Kind.PARTIAL, blame=blame)
    raise Conflict(blame, f"{gf.where(node)} is not linear in the partial sum")


def _pointwise_split(prop: PropagationState, node, tensors, lays) -> Layout:
    out_rank = node.meta["val"].dim()
    split = [(t, lay) for t, lay in zip(tensors, lays) if lay.kind is Kind.SPLIT]
    dims = {(lay.dim + out_rank - t.meta["val"].dim(), lay.pieces) for t, lay in split}
    if len(dims) > 1:
        raise Conflict(union(lays), f"{gf.where(node)} combines values split differently")
    (dim, (blocks, sections)), = dims
    out_size = shape(node)[dim]
    for t, lay in zip(tensors, lays):
        own_dim = dim - (out_rank - t.meta["val"].dim())
        size = shape(t)[own_dim] if own_dim >= 0 else 1
        if lay.kind is Kind.WEIGHT and size == out_size:
            prop.decide(lay, own_dim, blocks, sections=sections)  # a bias or scale along the dim splits with it
        elif lay.kind is Kind.SPLIT or size == 1 or _broadcast_locally(prop, t, own_dim):
            continue
        elif not (lay.replicated and size == out_size and _narrow(prop, node, t, own_dim, blocks, sections)):
            raise Conflict(union(lays), f"{gf.where(node)} mixes a split value with a full one")
    return Layout(Kind.SPLIT, dim, blocks, union(prop.get(t) for t in tensors), sections=sections)


def _narrow(
    prop: PropagationState, node: fx.Node, operand: fx.Node, dim: int, blocks: int, sections: tuple[int, ...]
) -> bool:
    """Whether each FFN rank can take its share of a whole ``operand`` (Gemma 4's per-layer
    input, gating a split projection) where ``node`` meets it with a split value. Attention TP
    ranks run one program with no rank input, so they keep the conflict."""
    size = shape(operand)[dim]
    if prop.reduce_partials or any(n % prop.ranks for n in sections or (size // blocks,) * blocks):
        return False
    for pos, arg in enumerate(node.args):
        if arg is operand:
            prop.narrowed[(node, pos)] = (dim, size, blocks, sections)
    return True


def _broadcast_locally(prop: PropagationState, node: fx.Node, dim: int) -> bool:
    """Whether ``node`` is an ``expand`` of a size-1 dim (one value for every head, as MLA's
    rotary key) read only here, which can expand to each rank's share of ``dim`` instead."""
    if op_of(node) is not aten.expand or len(node.users) != 1 or not prop.get(node).replicated:
        return False
    sizes = node.args[1]
    src_dim = dim - (len(sizes) - node.args[0].meta["val"].dim())
    if src_dim >= 0 and node.args[0].meta["val"].shape[src_dim] != 1:
        return False
    if not (isinstance(sizes[dim], int) and sizes[dim] > 0):
        return False
    prop.local_size((node, 1, dim), sizes[dim])
    return True


@rule(aten.index_add, aten.index_add_)
def _index_add(prop: PropagationState, node: fx.Node) -> Layout:
    """``index_add(x, dim, index, source)`` is ``x`` plus ``source`` scattered: linear in the
    two together, so a partial ``source`` (experts' outputs summed back into their tokens)
    makes a partial result, ``x`` counting once if it is whole."""
    x, index, source = (prop.replicate_undecided(prop.get(a)) for a in (node.args[0], node.args[2], node.args[3]))
    partial = (Kind.PARTIAL, Kind.OWNED)
    blame = union((x, index, source))
    if not index.replicated or not {x.kind, source.kind} <= {Kind.REPLICATED, *partial}:
        raise Conflict(blame, f"{gf.where(node)} has no rule for split values")
    if source.replicated and x.replicated:
        return R
    if x.replicated:
        prop.lead_only[node] = 0
    elif source.replicated:
        prop.lead_only[node] = 3
    return prop.reduce_partial(node, Layout(Kind.PARTIAL, blame=blame))


@rule(aten.view_as_complex, aten.view_as_real)  # these fold or add a trailing dim of 2
def _view_as(prop: PropagationState, node: fx.Node) -> Layout | None:
    lay = prop.get(node.args[0])
    if lay.kind is Kind.SPLIT and lay.dim < min(len(shape(node)), len(shape(node.args[0]))) - 1:
        return lay
    return None


@rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)
def _softmax(prop: PropagationState, node: fx.Node) -> Layout | None:
    lay = prop.get(node.args[0])
    if lay.kind is Kind.SPLIT and node.args[1] % len(shape(node)) != lay.dim:
        return lay  # normalized along another dim (a head's keys): each rank has whole rows
    return None


@rule(aten.layer_norm)
def _layer_norm(prop: PropagationState, node: fx.Node) -> Layout:
    """A norm over trailing dims that leave the split dim alone (per head) keeps the split."""
    lay = prop.replicate_undecided(prop.get(node.args[0]))
    normalized = len(node.args[1])
    params = [prop.replicate_undecided(prop.get(a)) for a in node.args[2:4]]
    if lay.replicated and all(p.replicated for p in params):
        return R
    per_head = lay.kind is Kind.SPLIT and lay.dim < len(shape(node.args[0])) - normalized
    if per_head and all(p.replicated for p in params):
        return lay
    raise Conflict(union([lay, *params]), f"{gf.where(node)} normalizes over a split dimension")


@rule(aten.sum, aten.mean)
def _sum(prop: PropagationState, node: fx.Node) -> Layout:
    return prop.reduce_partial(node, _sum_layout(prop, node))


def _sum_layout(prop: PropagationState, node: fx.Node) -> Layout:
    lay = prop.replicate_undecided(prop.get(node.args[0]))
    rank = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(rank))
    dims = sorted(d % rank for d in dims)
    keep = (len(node.args) > 2 and node.args[2]) or node.kwargs.get("keepdim", False)
    if lay.kind in (Kind.PARTIAL, Kind.OWNED):
        return Layout(Kind.PARTIAL, blame=lay.blame)
    if lay.kind is Kind.SPLIT:
        if lay.dim in dims:
            if op_of(node) is aten.sum:
                return Layout(Kind.PARTIAL, blame=lay.blame)
            if prop.reduce_partials and prop.average_means:  # the mean of equal parts: the mean of their means
                prop.averaged.add(node)
                return Layout(Kind.PARTIAL, blame=lay.blame)
            prop.mean_refused = prop.reduce_partials
        else:
            return replace(lay, dim=lay.dim - (0 if keep else sum(d < lay.dim for d in dims)))
    raise Conflict(lay.blame, f"{gf.where(node)} reduces a value laid out as {lay.kind.value}")


# -- contractions ----------------------------------------------------------------------------------

GROUPED = {aten._grouped_mm, torch.ops.transformers.grouped_mm_fallback}  # torch's kernel, transformers' fallback
_ROW_WISE = (Kind.REPLICATED, Kind.OWNED, Kind.OWNED_ONLY)  # what a grouped matmul keeps row by row


@rule(aten.linear, aten.mm, aten.bmm, aten.matmul, aten.addmm, *GROUPED)
def _contraction(prop: PropagationState, node: fx.Node) -> Layout:
    return prop.reduce_partial(node, _contraction_layout(prop, node))


def _contraction_layout(prop: PropagationState, node: fx.Node) -> Layout:
    op = op_of(node)
    bias = None
    if op is aten.addmm:
        bias, a, b = node.args[:3]
    elif op is aten.linear:
        a, b = node.args[:2]
        bias = node.args[2] if len(node.args) > 2 else None
    else:
        a, b = node.args[:2]
    ra, rb = len(shape(a)), len(shape(b))
    # Each operand dim maps to an output dim, "k" (contracted) or "e" (the expert index).
    if op is aten.linear:
        map_a = {i: i for i in range(ra - 1)} | {ra - 1: "k"}
        map_b = {0: ra - 1, 1: "k"}
    elif op in GROUPED:
        map_a, map_b = {0: 0, 1: "k"}, {0: "e", 1: "k", 2: 1}
    elif rb == 2:  # mm, addmm, matmul by a matrix
        map_a = {i: i for i in range(ra - 1)} | {ra - 1: "k"}
        map_b = {0: "k", 1: ra - 1}
    elif ra == rb:  # bmm, batched matmul
        map_a = {i: i for i in range(ra - 1)} | {ra - 1: "k"}
        map_b = {i: i for i in range(rb - 2)} | {rb - 2: "k", rb - 1: rb - 1}
    else:
        return _all_replicated(prop, node, [a, b])
    la, lb = prop.get(a), prop.get(b)
    out = _contract(prop, node, (a, b), la, lb, map_a, map_b)
    if bias is not None:
        out = _bias(prop, node, bias, out)
    return out


def _contract(prop: PropagationState, node, operands, la: Layout, lb: Layout, map_a, map_b) -> Layout:
    def k_dim(mapping):
        return next(d for d, m in mapping.items() if m == "k")

    grouped = op_of(node) in GROUPED
    if lb.kind is Kind.WEIGHT:
        if la.kind is Kind.SPLIT and map_a[la.dim] == "k":
            lb = prop.decide(lb, k_dim(map_b), la.blocks, sections=la.sections)
        elif prop.mode is FFNParallel.EP and "e" in map_b.values() and la.kind in _ROW_WISE:
            lb = prop.decide(lb, next(d for d, m in map_b.items() if m == "e"), experts=True)
        elif la.replicated:  # a column split, unless there are fewer columns than ranks (a gate's one)
            column = max(d for d, m in map_b.items() if isinstance(m, int))
            lb = prop.decide(lb, column if prop.size(lb, column) >= prop.ranks else None)
        else:
            lb = prop.decide(lb, None)
    la = prop.replicate_undecided(la)
    if lb.kind is Kind.EXPERTS:
        if not grouped or map_b[lb.dim] != "e":
            raise Conflict(lb.blame, f"{gf.where(node)} uses expert weights other than as a grouped matmul")
        if la.kind not in _ROW_WISE:
            raise Conflict(la.blame | lb.blame, "a grouped matmul over split inputs")
        return Layout(Kind.OWNED, blame=la.blame | lb.blame)
    blame = la.blame | lb.blame
    if la.replicated and lb.replicated:
        return R
    if la.kind is Kind.SPLIT and lb.kind is Kind.SPLIT:
        if map_a[la.dim] == "k" and map_b[lb.dim] == "k" and la.pieces == lb.pieces:
            return Layout(Kind.PARTIAL, blame=blame)
        if isinstance(map_a[la.dim], int) and map_a[la.dim] == map_b[lb.dim] and la.pieces == lb.pieces:
            return replace(la, dim=map_a[la.dim], blame=blame)  # the same batch dim (heads)
        raise Conflict(blame, f"{gf.where(node)} contracts values split differently")
    split = la if la.kind is Kind.SPLIT else lb if lb.kind is Kind.SPLIT else None
    if split is not None:
        own, other, other_map, other_shape = (
            (map_a, lb, map_b, shape(operands[1])) if split is la else (map_b, la, map_a, shape(operands[0]))
        )
        out_dim = own[split.dim]
        # a batch dim both operands have (heads) is split in both, unless the other broadcasts it
        shared = [d for d, m in other_map.items() if m == out_dim]
        if isinstance(out_dim, int) and other.replicated and all(other_shape[d] == 1 for d in shared):
            return replace(split, dim=out_dim, blame=blame)
        raise Conflict(blame, f"{gf.where(node)} contracts a split value with a full one")
    kinds = {la.kind, lb.kind} - {Kind.REPLICATED}
    if len(kinds) == 1 and Kind.REPLICATED in {la.kind, lb.kind}:
        (kind,) = kinds  # linear in one operand: partial stays partial, owned rows stay owned
        if kind is Kind.OWNED_ONLY or (kind is Kind.OWNED and grouped and lb.replicated):
            return Layout(kind, blame=blame)
        return Layout(Kind.PARTIAL if kind is Kind.OWNED else kind, blame=blame)
    raise Conflict(blame, f"{gf.where(node)} multiplies two split or partial values")


def _bias(prop: PropagationState, node: fx.Node, bias: fx.Node, out: Layout) -> Layout:
    lay = prop.get(bias)
    if out.kind is Kind.SPLIT:
        if lay.kind is Kind.WEIGHT:
            lay = prop.decide(lay, lay.dims.index(lay.dims[-1]), out.blocks, sections=out.sections)
        if lay.kind is Kind.SPLIT and lay.pieces == out.pieces:
            return replace(out, blame=out.blame | lay.blame)
    elif out.kind is Kind.PARTIAL:
        if prop.replicate_undecided(lay).replicated:
            prop.lead_only[node] = -1  # the bias is added by rank 0 only
            return out
    elif prop.replicate_undecided(lay).replicated:
        return out
    raise Conflict(out.blame | lay.blame, f"{gf.where(node)}: the bias cannot follow the split")


@rule(torch.ops.afdc.attention)
def _attention(prop: PropagationState, node: fx.Node) -> Layout:
    """``afdc::attention`` by heads: q, k and v split along their heads (dim 1), or one key/value
    head (MQA) that every rank holds; the output ``[b, s, hq, d]`` is split along its heads, and
    so are the per-head sinks."""
    call = AttentionCall.of(node)
    q, k, v, mask = (prop.replicate_undecided(prop.get(a)) for a in (call.q, call.k, call.v, call.mask))
    sinks = prop.get(call.sinks) if call.sinks is not None else None
    heads = [lay for lay in (q, k, v) if lay.kind is Kind.SPLIT and lay.dim == 1 and lay.pieces == (1, ())]
    blame = union([q, k, v, mask] + ([sinks] if sinks else []))
    if q.replicated and k.replicated and v.replicated and mask.replicated:
        if sinks is not None:
            prop.replicate_undecided(sinks)
        return R
    single_kv = k.replicated and v.replicated and call.k.meta["val"].shape[1] == 1
    # a mask of its own per head (Doge's dynamic mask) must be split with the heads
    per_head = isinstance(call.mask, fx.Node) and len(shape(call.mask)) == 4 and shape(call.mask)[1] != 1
    by_heads = mask.kind is Kind.SPLIT and mask.dim == 1 and mask.pieces == (1, ())
    mask_fits = by_heads if per_head else mask.replicated
    if q in heads and mask_fits and (len(heads) == 3 or single_kv):
        if sinks is not None and sinks.kind is Kind.WEIGHT:
            sinks = prop.decide(sinks, 0)
        if sinks is None or (sinks.kind is Kind.SPLIT and sinks.dim == 0 and sinks.pieces == (1, ())):
            return Layout(Kind.SPLIT, 2, 1, blame)
    if q in heads and not mask_fits:
        raise Conflict(blame, "the attention mask has a value per head (a dynamic mask), not split with them")
    raise Conflict(blame, f"{gf.where(node)}: queries, keys and values are not split by the same heads")


# -- data movement ---------------------------------------------------------------------------------


@rule(aten.transpose, aten.permute, aten.t)
def _permute(prop: PropagationState, node: fx.Node) -> Layout:
    op = op_of(node)
    lay = prop.get(node.args[0])
    rank = len(shape(node.args[0]))
    if op is aten.t:
        order = list(range(rank))[::-1]
    elif op is aten.transpose:
        order = list(range(rank))
        i, j = node.args[1] % rank, node.args[2] % rank
        order[i], order[j] = order[j], order[i]
    else:
        order = [d % rank for d in node.args[1]]
    if lay.kind is Kind.WEIGHT:
        return replace(lay, dims=tuple(lay.dims[d] for d in order))
    if lay.kind in (Kind.SPLIT, Kind.EXPERTS):
        return replace(lay, dim=order.index(lay.dim))
    return lay


def _per_expert(prop: PropagationState, weight: fx.Node) -> bool:
    """Whether ``weight`` holds a row per expert (a bias picked by expert id), as many rows as
    the stacked experts; otherwise it is a table looked up by something else (DeepSeek-V4's
    experts by token id), which every rank keeps whole."""
    experts = {shape(w)[0] for w in prop.weights if len(shape(w)) >= 3}
    return shape(weight)[0] in experts or not experts


@rule(aten.index, aten.index_select)
def _index(prop: PropagationState, node: fx.Node) -> Layout:
    op = op_of(node)
    src = node.args[0]
    lay = prop.get(src)
    if op is aten.index_select:
        dim, idx = node.args[1] % len(shape(src)), [node.args[2]]
        pos = [None] * dim + idx
    else:
        pos = list(node.args[1])
    if any(prop.get(i).kind is not Kind.REPLICATED for i in pos if isinstance(i, fx.Node)):
        return _all_replicated(prop, node, [src, *[i for i in pos if isinstance(i, fx.Node)]])
    if lay.replicated or lay.kind in (Kind.PARTIAL, Kind.OWNED, Kind.OWNED_ONLY):
        return lay  # gathering is linear and moves elements with their owners
    indexed = [d for d, i in enumerate(pos) if i is not None]
    if indexed != [0]:
        return _all_replicated(prop, node, [src])
    added = pos[0].meta["val"].dim() - 1  # dims the index tensor adds in place of dim 0
    if lay.kind is Kind.WEIGHT:
        if prop.mode is FFNParallel.EP and op is aten.index and _per_expert(prop, src):
            lay = prop.decide(lay, 0, experts=True)
            return Layout(Kind.OWNED, blame=lay.blame)
        return replace(lay, dims=(None,) * (added + 1) + lay.dims[1:])
    if lay.kind is Kind.EXPERTS and lay.dim == 0:
        return Layout(Kind.OWNED, blame=lay.blame)
    if lay.kind is Kind.SPLIT and lay.dim > 0:
        return replace(lay, dim=lay.dim + added)
    raise Conflict(lay.blame, f"{gf.where(node)} indexes a split dimension")


@rule(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.expand, aten.unsqueeze, aten.squeeze)
def _reshape(prop: PropagationState, node: fx.Node) -> Layout:
    lay = prop.replicate_undecided(prop.get(node.args[0]))
    if lay.kind is not Kind.SPLIT:
        if lay.kind is Kind.EXPERTS:
            raise Conflict(lay.blame, f"{gf.where(node)} reshapes expert weights")
        return lay
    src, out = shape(node.args[0]), shape(node)
    before = math.prod(src[: lay.dim])
    for j in range(len(out)):
        if math.prod(out[:j]) != before:
            continue
        kept = out[j] == src[lay.dim]
        # [.., H*D] -> [.., H, D] splits the heads H, when every rank holds whole heads
        unmerged = lay.pieces == (1, ()) and out[j].is_Integer and int(out[j]) % prop.ranks == 0 and any(
            math.prod(out[j:m]) == src[lay.dim] for m in range(j + 2, len(out) + 1)
        )
        # [.., H, D] -> [.., H*D]: each rank's heads are a contiguous range of the merged dim
        merged = lay.pieces == (1, ()) and any(
            math.prod(src[lay.dim : m]) == out[j] for m in range(lay.dim + 2, len(src) + 1)
        )
        if kept or unmerged or merged:
            sizes = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else None
            if sizes is not None and j < len(sizes) and isinstance(sizes[j], int) and sizes[j] > 0:
                prop.local_size((node, 1, j), sizes[j])
            return replace(lay, dim=j)
    raise Conflict(lay.blame, f"{gf.where(node)} reshapes across a split dimension")


@rule(aten.chunk, aten.split, aten.split_with_sizes, aten.unbind)
def _chunk(prop: PropagationState, node: fx.Node) -> list[Layout]:
    op = op_of(node)
    lay = prop.replicate_undecided(prop.get(node.args[0]))
    n = len(node.meta["val"])
    rank = len(shape(node.args[0]))
    dim_pos = 1 if op is aten.unbind else 2
    dim = (node.args[dim_pos] if len(node.args) > dim_pos else 0) % rank
    if lay.kind is not Kind.SPLIT or lay.dim != dim:
        if lay.kind is Kind.SPLIT and op is aten.unbind and lay.dim > dim:
            return [replace(lay, dim=lay.dim - 1)] * n
        if lay.kind is Kind.EXPERTS:
            raise Conflict(lay.blame, f"{gf.where(node)} splits expert weights")
        return [lay] * n
    sizes = tuple(int(t.shape[dim]) for t in node.meta["val"])
    if op is aten.split_with_sizes and len(set(sizes)) > 1:  # a fused [q; k; v]: one section each
        if lay.pieces == (1, ()):
            raise NeedBlocks(lay.blame, sections=sizes)
        if lay.sections != sizes:
            raise Conflict(lay.blame, f"{gf.where(node)} splits a split dimension unlike its sections")
        for i, size in enumerate(node.args[1]):
            prop.local_size((node, 1, i), size)
        return [replace(lay, sections=())] * n
    if op is aten.unbind or len(set(sizes)) != 1 or lay.sections:
        raise Conflict(lay.blame, f"{gf.where(node)} splits a split dimension unevenly")
    if lay.blocks % n:
        raise NeedBlocks(lay.blame, lay.blocks * n // math.gcd(lay.blocks, n))
    if op is aten.split:
        prop.local_size((node, 1, None), node.args[1])
    elif op is aten.split_with_sizes:
        for i, size in enumerate(node.args[1]):
            prop.local_size((node, 1, i), size)
    return [replace(lay, blocks=lay.blocks // n)] * n


def _slice_args(node: fx.Node) -> tuple:
    """``aten.slice(x, dim, start=None, end=None, step=1)``'s start (0 for None), end and step."""
    start, end, step = [*node.args[2:5], *[None] * (5 - max(len(node.args), 2))][:3]
    return start or 0, end, step or 1


@rule(aten.slice, aten.select)
def _slice(prop: PropagationState, node: fx.Node) -> Layout:
    op = op_of(node)
    lay = prop.get(node.args[0])
    rank = len(shape(node.args[0]))
    dim = node.args[1] % rank if len(node.args) > 1 else 0
    if lay.kind is Kind.WEIGHT and op is aten.select:  # one expert of a stack (JetMoE's loop): undecided
        return replace(lay, dims=lay.dims[:dim] + lay.dims[dim + 1 :])
    lay = prop.replicate_undecided(lay)
    if lay.kind not in (Kind.SPLIT, Kind.EXPERTS):
        return lay
    if dim != lay.dim:
        return replace(lay, dim=lay.dim - 1) if op is aten.select and dim < lay.dim else lay
    start, end, step = _slice_args(node)
    full = shape(node.args[0])[dim]
    if lay.kind is Kind.SPLIT and op is aten.slice and step == 1 and full.is_Integer:
        return _slice_section(prop, node, lay, int(full), start, int(full) if end is None else min(end, int(full)))
    whole = (end is None or end >= full) and (start or 0) < step
    # An interleaved [gate0, up0, gate1, ...] keeps its pairs on one rank.
    interleaved = whole and step > 1 and lay.blocks == 1 and (full // prop.ranks) % step == 0
    if lay.kind is Kind.SPLIT and op is aten.slice and interleaved:
        return lay
    raise Conflict(lay.blame, f"{gf.where(node)} slices a split dimension")


def _slice_section(prop: PropagationState, node: fx.Node, lay: Layout, full: int, start: int, end: int) -> Layout:
    """``x[..., start:end]`` of a split dim made of sections (a fused [q; k; v] cut by slices):
    the sections are where the source's slices along the dim start and end."""
    source, dim = node.args[0], lay.dim
    bounds = {0, full}
    for user in source.users:
        if op_of(user) is aten.slice and user.args[1] % len(shape(source)) == dim:
            lo, hi, step = _slice_args(user)
            if step == 1 and isinstance(lo, int) and isinstance(hi or full, int):
                bounds |= {lo, min(hi or full, full)}
    bounds = sorted(bounds)
    sections = tuple(b - a for a, b in itertools.pairwise(bounds))
    if lay.pieces == (1, ()) and len(sections) > 1:
        raise NeedBlocks(lay.blame, sections=sections)
    if lay.sections != sections or start not in bounds or end not in bounds:
        raise Conflict(lay.blame, f"{gf.where(node)} slices a split dimension")
    prop.local_size((node, 2, None), start)
    if len(node.args) > 3 and node.args[3] is not None and node.args[3] < full:
        prop.local_size((node, 3, None), end)
    kept = sections[bounds.index(start) : bounds.index(end)]
    return replace(lay, sections=kept if len(kept) > 1 else ())


@rule(aten.new_empty, aten.new_zeros, aten.new_ones, aten.new_full)
def _new_like(prop: PropagationState, node: fx.Node) -> Layout:
    """A new tensor the full shape of a split one it is made from is split like it (what is
    written into it must then be split the same way, or the writes conflict)."""
    lay = prop.get(node.args[0])
    sizes = node.args[1]
    like = shape(node.args[0])
    same = lay.kind is Kind.SPLIT and len(sizes) == len(like) and sizes[lay.dim] == like[lay.dim]
    if same and isinstance(sizes[lay.dim], int):
        prop.local_size((node, 1, lay.dim), sizes[lay.dim])
        return lay
    raise Conflict(lay.blame, f"{gf.where(node)} makes a tensor unlike the split one it is made from")


@rule(aten.cat, aten.stack)
def _cat(prop: PropagationState, node: fx.Node) -> Layout:
    lays = [prop.replicate_undecided(prop.get(a)) for a in node.args[0]]
    rank = len(shape(node))
    dim = (node.args[1] if len(node.args) > 1 else 0) % rank
    if len(set(lays)) == 1 and lays[0].kind is not Kind.EXPERTS:
        lay = lays[0]
        if lay.kind is not Kind.SPLIT:
            return lay
        if op_of(node) is aten.cat and lay.dim != dim:
            return lay
        if op_of(node) is aten.stack:  # a new dim at `dim`: the split dim moves past it
            return replace(lay, dim=lay.dim + (dim <= lay.dim))
    raise Conflict(union(lays), f"{gf.where(node)} joins values laid out differently")
