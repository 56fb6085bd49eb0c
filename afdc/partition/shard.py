"""Shard an FFN segment over the F ranks of a plan, so that the ranks' outputs add up.

Tensor parallel (``tp``) splits weights along their intermediate dimension: the projections
that read the segment's input are split by output column, the ones that read a split value by
input row, and each rank returns a partial sum. Expert parallel (``ep``) gives each rank E/F of
the stacked expert weights; a rank computes only its experts' rows and zeros elsewhere, again a
partial sum. Under ``ep`` the rest of a MoE segment (shared experts, dense layers) is ``tp``.

Which weights to split is found by propagating, through the segment graph, how each value is
laid out over the ranks (:class:`Layout`). A weight is split on its first use as a matmul
operand; when a split value reaches an op that cannot take it (a router's softmax or top-k over
the split dimension), the weights it came from are replicated and the propagation starts over.
Every rule is exact, and an op without a rule accepts only replicated inputs: a pattern that
does not fit ends up replicated (or refused under ``ep``), never wrong.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from afdc import segment
from afdc.errors import PlanError
from afdc.passes import graph_facts as gf
from afdc.segment import Split


class FFNParallel(enum.Enum):
    TP = "tp"
    EP = "ep"


class Kind(enum.Enum):
    REPLICATED = "R"  # the full value on every rank
    SPLIT = "S"  # rank r holds part r of each of `blocks` equal blocks (or of each section) along `dim`
    PARTIAL = "P"  # the full value is the sum over the ranks
    OWNED = "Z"  # every element is held by one rank and zero on the others (so also partial)
    OWNED_ONLY = "G"  # correct on the elements this rank holds, arbitrary elsewhere
    WEIGHT = "W"  # a weight whose split is not decided yet; `dims` maps value dims to weight dims
    EXPERTS = "E"  # an expert-parallel weight: this rank's experts along `dim`


@dataclass(frozen=True)
class Layout:
    kind: Kind
    dim: int = 0
    blocks: int = 1
    blame: frozenset[int] = frozenset()  # the weights whose split produced this layout
    weight: int = -1  # WEIGHT only
    dims: tuple[int | None, ...] = ()  # WEIGHT only
    sections: tuple[int, ...] = ()  # SPLIT: the dim is these unequal sections (a fused [q; k; v]), not blocks

    @property
    def pieces(self) -> tuple[int, tuple[int, ...]]:
        """What each rank's share is made of: equal blocks, or sections."""
        return self.blocks, self.sections

    @property
    def replicated(self) -> bool:
        return self.kind is Kind.REPLICATED


R = Layout(Kind.REPLICATED)
_ROW_WISE = (Kind.REPLICATED, Kind.OWNED, Kind.OWNED_ONLY)  # what a grouped matmul keeps row by row


@dataclass
class ShardedSegment:
    """A segment graph taking ``(weights..., inputs..., rank)``, how each rank holds each weight,
    and how the attention side combines the ranks' outputs: ``sum`` of partial results, the
    ``first`` rank's copy, or ``rows`` (every rank holds the whole segment and serves its own
    share of the tokens)."""

    graph: fx.Graph
    splits: list[Split]
    reduce: list[str]

    def describe(self) -> str:
        """``ep``, ``tp``, ``dp`` or ``replicated``: how the FFN ranks share this segment's work."""
        return segment.describe(self.splits, self.reduce)


class _Conflict(Exception):
    def __init__(self, blame: frozenset[int], reason: str):
        super().__init__(reason)
        self.blame, self.reason = blame, reason
        self.node: fx.Node | None = None  # where it arose (set by _Propagation.run)


class PartialSumsMeetNonLinearOps(PlanError):
    """The split leaves partial sums (of expert or row-split outputs) that an op not linear in
    them reads, as a norm after the experts does: the FFN ranks cannot reduce them, but the
    attention side can, if the cut leaves ``nodes`` (segment node names) to it."""

    def __init__(self, message: str, nodes: list[str]):
        super().__init__(message)
        self.nodes = nodes
        self.segment = -1  # which segment of the partition (set by the caller that knows)


class _NeedBlocks(Exception):
    def __init__(self, weights: frozenset[int], blocks: int = 1, sections: tuple[int, ...] = ()):
        super().__init__()
        self.weights, self.blocks, self.sections = weights, blocks, sections


_ZERO_AT_ZERO = {"silu", "gelu", "relu", "tanh", "neg", "erf", "abs", "leaky_relu", "elu", "sqrt", "sin"}
_ADD = {"add", "add_", "sub", "sub_"}
_MUL = {"mul", "mul_"}
_DIV = {"div", "div_"}
_GROUPED = {"grouped_mm_fallback", "_grouped_mm", "grouped_mm"}  # transformers' fallback, torch's kernels
_CONTRACTIONS = {"linear", "mm", "bmm", "matmul", "addmm", *_GROUPED}


def _slice_args(node: fx.Node) -> tuple:
    """``aten.slice(x, dim, start=None, end=None, step=1)``'s start (0 for None), end and step."""
    start, end, step = [*node.args[2:5], *[None] * (5 - max(len(node.args), 2))][:3]
    return start or 0, end, step or 1


def _shape(node: fx.Node) -> list:
    return [gf.sym_expr(d) for d in node.meta["val"].shape]


def _union(layouts) -> frozenset[int]:
    return frozenset().union(*(lay.blame for lay in layouts))


@dataclass
class _Propagation:
    """Layout propagation, node by node in graph order, deciding weights' splits on the way.

    When a conflict or a need for blocks changes some weights' decisions, :meth:`rewind` keeps
    everything computed before the first use of those weights and propagation goes on from
    there, so a graph with a conflict per layer costs a pass, not a pass per conflict.
    """

    graph: fx.Graph
    mode: FFNParallel
    ranks: int
    decided: dict[int, Split]
    weights: dict[fx.Node, int] | None = None  # weight nodes -> index (default: the w* placeholders)
    # Attention TP: a partial sum is all-reduced where it is made (the residual stream stays whole)
    reduce_partials: bool = False
    average_means: bool = True  # with reduce_partials: a mean over a split dim is all-reduced
    reduced: set[fx.Node] = field(default_factory=set)
    averaged: set[fx.Node] = field(default_factory=set)  # reduced means: the all-reduced sum / ranks
    env: dict[fx.Node, Layout | list[Layout]] = field(default_factory=dict)
    # (node, arg position, list index or None) -> a full size that each rank holds 1/ranks of
    local_sizes: dict[tuple[fx.Node, int, int | None], int] = field(default_factory=dict)
    lead_only: dict[fx.Node, int] = field(default_factory=dict)  # node -> operand added only on rank 0
    # (node, arg position) -> how a whole operand meets a split one: (dim, full size, blocks, sections)
    narrowed: dict[tuple[fx.Node, int], tuple[int, int, int, tuple[int, ...]]] = field(default_factory=dict)
    pinned: dict[int, Split] = field(default_factory=dict)  # decisions made from outside, by rewind
    mean_refused: bool = False  # a mean over a split dim was refused (average_means was off)
    partial_at: list[fx.Node] = field(default_factory=list)  # ops that refused a partial sum

    def __post_init__(self) -> None:
        if self.weights is None:
            self.weights = {w: i for i, w in enumerate(segment.weights(self.graph))}
        self._nodes = list(self.graph.nodes)
        self._order = {n: i for i, n in enumerate(self._nodes)}
        self._first_use: dict[int, int] = {}
        for node, w in self.weights.items():
            uses = [self._order[u] for u in node.users]
            self._first_use[w] = min([self._first_use.get(w, len(self._nodes)), *uses])
        self._weight_nodes = {i: node for node, i in self.weights.items()}
        self._pos = 0
        self._decided_at: dict[int, int] = {}  # weight -> where its decision was made (-1: pinned)
        self._sized_at: dict[tuple, int] = {}  # local_sizes key -> where it was recorded
        self._overwritten: list[tuple[int, fx.Node, Layout]] = []  # in-place writes: (where, value, before)
        self._start = 0

    def run(self) -> list[str]:
        """Propagate from where the last :meth:`rewind` left off; the output's reductions."""
        for pos in range(self._start, len(self._nodes)):
            node = self._nodes[pos]
            self._pos = pos
            if node.op in ("placeholder", "get_attr"):
                i = self.weights.get(node)
                self.env[node] = R if i is None else self._weight(i, node)
            elif node.op == "call_function":
                try:
                    self.env[node] = self._visit(node)
                except _Conflict as conflict:
                    conflict.node = conflict.node or node
                    raise
                if gf.op_name(node).endswith("_") and node.args and isinstance(node.args[0], fx.Node):
                    written = node.args[0]  # in-place: the written tensor now has this layout
                    self._overwritten.append((pos, written, self.env[written]))
                    self.env[written] = self.env[node]
            elif node.op == "output":
                return [self._reduction(o) for o in node.args[0]]
        raise AssertionError("graph without output")

    def settle(self, refuse: Callable[[_Conflict], None]) -> tuple[list[str], list[str]]:
        """Propagate; after each conflict keep whole the weights it blames and go on from their
        first use, until none is left. Returns the output's reductions and why weights were kept
        whole; ``refuse`` raises for a conflict that keeping weights whole must not answer."""
        reasons: list[str] = []
        for _ in range(4 * len(self._first_use) + 4):
            try:
                return self.run(), list(dict.fromkeys(reasons))
            except _NeedBlocks as need:
                self.rewind({w: replace(self.decided[w], blocks=need.blocks, sections=need.sections)
                             for w in need.weights})
            except _Conflict as conflict:
                if conflict.node is not None and any(
                    isinstance(self.env.get(a), Layout) and self._get(a).kind in (Kind.PARTIAL, Kind.OWNED)
                    for a in conflict.node.all_input_nodes
                ):
                    self.partial_at.append(conflict.node)
                refuse(conflict)
                self.rewind({w: Split() for w in conflict.blame})
                reasons.append(conflict.reason)
        raise AssertionError("sharding did not settle")

    def rewind(self, pins: dict[int, Split]) -> None:
        """Fix the decisions ``pins`` and forget what followed the first use of those weights."""
        start = min(min(self._first_use[w] for w in pins), len(self._nodes) - 1)
        for pos, written, before in reversed(self._overwritten):
            if pos >= start:
                self.env[written] = before
        self._overwritten = [o for o in self._overwritten if o[0] < start]
        kept = self._order.__getitem__
        self.env = {n: v for n, v in self.env.items() if kept(n) < start}
        self.reduced = {n for n in self.reduced if kept(n) < start}
        self.averaged = {n for n in self.averaged if kept(n) < start}
        self.lead_only = {n: v for n, v in self.lead_only.items() if kept(n) < start}
        self.narrowed = {k: v for k, v in self.narrowed.items() if kept(k[0]) < start}
        self.local_sizes = {k: v for k, v in self.local_sizes.items() if self._sized_at[k] < start}
        self.pinned.update(pins)
        self.decided = {w: s for w, s in self.decided.items() if self._decided_at.get(w, -1) < start}
        self.decided.update(self.pinned)
        self._decided_at.update({w: -1 for w in pins})
        self._start = start

    def _local_size(self, key: tuple[fx.Node, int, int | None], full: int) -> None:
        self.local_sizes[key] = full
        self._sized_at[key] = self._pos

    # -- weights ---------------------------------------------------------------------------------

    def _weight(self, i: int, node: fx.Node) -> Layout:
        lay = Layout(Kind.WEIGHT, weight=i, dims=tuple(range(node.meta["val"].dim())))
        return self._decided_layout(lay) if i in self.decided else lay

    def _size(self, lay: Layout, value_dim: int) -> int:
        """The size of the weight behind ``lay`` along value dim ``value_dim``."""
        return self._weight_nodes[lay.weight].meta["val"].shape[lay.dims[value_dim]]

    def _decided_layout(self, lay: Layout) -> Layout:
        split = self.decided[lay.weight]
        if split.dim is None:
            return R
        if split.dim not in lay.dims:
            raise _Conflict(frozenset({lay.weight}), "a weight's split dimension was indexed away")
        kind = Kind.EXPERTS if split.experts else Kind.SPLIT
        return Layout(kind, lay.dims.index(split.dim), split.blocks, frozenset({lay.weight}), sections=split.sections)

    def _decide(
        self, lay: Layout, value_dim: int | None, blocks: int = 1, experts: bool = False, sections: tuple = ()
    ) -> Layout:
        """Fix the split of the weight behind ``lay`` so that value dim ``value_dim`` is split."""
        weight_dim = None if value_dim is None else lay.dims[value_dim]
        self.decided[lay.weight] = Split(weight_dim, blocks, experts, sections)
        self._decided_at[lay.weight] = self._pos
        return self._decided_layout(lay)

    def _get(self, arg) -> Layout:
        if not isinstance(arg, fx.Node):
            return R
        lay = self.env[arg]
        if isinstance(lay, list):
            raise AssertionError(f"{arg.name} is a tuple")
        if lay.kind is Kind.WEIGHT and lay.weight in self.decided:
            return self._decided_layout(lay)
        return lay

    def _settle(self, lay: Layout) -> Layout:
        """A weight reaching an op with no rule for undecided weights is replicated."""
        return self._decide(lay, None) if lay.kind is Kind.WEIGHT else lay

    # -- ops -------------------------------------------------------------------------------------

    def _visit(self, node: fx.Node):
        name = gf.op_name(node)
        if node.target is operator.getitem:
            parent = self.env[node.args[0]]
            return parent[node.args[1]] if isinstance(parent, list) else self._get(node.args[0])
        if not gf.is_tensor(node) and not isinstance(node.meta.get("val"), (tuple, list)):
            return self._scalar(node)
        if name in _CONTRACTIONS:
            return self._reduced(node, self._contraction(node, name))
        if name == "attention":
            return self._attention(node)
        if name in ("transpose", "permute", "t"):
            return self._permute(node, name)
        if name in ("index", "index_select"):
            return self._index(node, name)
        tensors = [self._get(a) for a in node.all_input_nodes if gf.is_tensor(a)]
        if all(t.replicated for t in tensors):
            return self._replicated_outputs(node)
        if node.target is not None and torch.Tag.pointwise in getattr(node.target, "tags", ()):
            return self._pointwise(node, name)
        if name in gf.IDENTITY_OPS or name in ("copy", "copy_"):  # copy_: the written value, elementwise
            return self._pointwise(node, name)
        if name in ("view", "reshape", "_unsafe_view", "flatten", "expand", "unsqueeze", "squeeze"):
            return self._reshape(node)
        if name in ("chunk", "split", "split_with_sizes", "unbind"):
            return self._chunk(node, name)
        if name == "layer_norm":
            return self._layer_norm(node)
        if name in ("new_empty", "new_zeros", "new_ones", "new_full"):
            return self._new_like(node)
        if name in ("view_as_complex", "view_as_real"):  # these fold or add a trailing dim of 2
            lay = self._get(node.args[0])
            if lay.kind is Kind.SPLIT and lay.dim < min(len(_shape(node)), len(_shape(node.args[0]))) - 1:
                return lay
        if name in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
            lay = self._get(node.args[0])
            if lay.kind is Kind.SPLIT and node.args[1] % len(_shape(node)) != lay.dim:
                return lay  # normalized along another dim (a head's keys): each rank has whole rows
        if name in ("slice", "select"):
            return self._slice(node, name)
        if name in ("cat", "stack"):
            return self._cat(node)
        if name in ("sum", "mean"):
            return self._reduced(node, self._sum(node))
        if name in ("index_add", "index_add_"):
            return self._index_add(node)
        tensors = [self._settle(t) for t in tensors]  # a weight read by an op with no rule stays whole
        if all(t.replicated for t in tensors):
            return self._replicated_outputs(node)
        raise _Conflict(_union(tensors), f"{gf.where(node)} has no rule for split or partial values")

    def _reduced(self, node: fx.Node, lay: Layout) -> Layout:
        if self.reduce_partials and lay.kind is Kind.PARTIAL:
            self.reduced.add(node)
            return R
        return lay

    def _attention(self, node: fx.Node) -> Layout:
        """``afdc::attention(q, k, v, mask, slot, scale, softcap, sinks, window)`` by heads: q, k and
        v split along their heads (dim 1), or one key/value head (MQA) that every rank holds; the
        output ``[b, s, hq, d]`` is split along its heads, and so are the per-head sinks."""
        q, k, v, mask = (self._settle(self._get(a)) for a in node.args[:4])
        sinks = self._get(node.args[7]) if node.args[7] is not None else None
        heads = [lay for lay in (q, k, v) if lay.kind is Kind.SPLIT and lay.dim == 1 and lay.pieces == (1, ())]
        blame = _union([q, k, v, mask] + ([sinks] if sinks else []))
        if q.replicated and k.replicated and v.replicated and mask.replicated:
            if sinks is not None:
                self._settle(sinks)
            return R
        single_kv = k.replicated and v.replicated and node.args[1].meta["val"].shape[1] == 1
        # a mask of its own per head (Doge's dynamic mask) must be split with the heads
        per_head = isinstance(node.args[3], fx.Node) and len(_shape(node.args[3])) == 4 and _shape(node.args[3])[1] != 1
        by_heads = mask.kind is Kind.SPLIT and mask.dim == 1 and mask.pieces == (1, ())
        mask_fits = by_heads if per_head else mask.replicated
        if q in heads and mask_fits and (len(heads) == 3 or single_kv):
            if sinks is not None and sinks.kind is Kind.WEIGHT:
                sinks = self._decide(sinks, 0)
            if sinks is None or (sinks.kind is Kind.SPLIT and sinks.dim == 0 and sinks.pieces == (1, ())):
                return Layout(Kind.SPLIT, 2, 1, blame)
        if q in heads and not mask_fits:
            raise _Conflict(blame, "the attention mask has a value per head (a dynamic mask), not split with them")
        raise _Conflict(blame, f"{gf.where(node)}: queries, keys and values are not split by the same heads")

    def _replicated_outputs(self, node: fx.Node):
        val = node.meta.get("val")
        return [R] * len(val) if isinstance(val, (tuple, list)) else R

    def _scalar(self, node: fx.Node) -> Layout:
        if gf.op_name(node) == "sym_size":
            lay = self._get(node.args[0])
            if lay.kind in (Kind.SPLIT, Kind.EXPERTS) and node.args[1] % len(_shape(node.args[0])) == lay.dim:
                raise _Conflict(lay.blame, "the size of a split dimension is read")
        return R

    def _pointwise(self, node: fx.Node, name: str) -> Layout:
        tensors = [a for a in node.args if isinstance(a, fx.Node) and gf.is_tensor(a)]
        lays = [self._get(a) for a in tensors]
        if any(lay.kind is Kind.SPLIT for lay in lays):
            return self._pointwise_split(node, tensors, lays)
        lays = [self._settle(lay) for lay in lays]
        kinds = {lay.kind for lay in lays} - {Kind.REPLICATED}
        blame = _union(lays)
        if not kinds:
            return R
        if Kind.PARTIAL in kinds or Kind.EXPERTS in kinds:
            if kinds <= {Kind.PARTIAL, Kind.OWNED}:
                return self._pointwise_partial(node, name, tensors, lays, blame)
            raise _Conflict(blame, f"{gf.where(node)} mixes a partial sum with another layout")
        # Only OWNED / OWNED_ONLY / REPLICATED remain: track which elements are exact zeros.
        args = [self._get(a) if isinstance(a, fx.Node) else a for a in node.args]
        owned = [isinstance(a, Layout) and a.kind is Kind.OWNED for a in args]
        if name in _MUL and any(owned):
            return Layout(Kind.OWNED, blame=blame)
        if name in _DIV and owned[0] and not any(owned[1:]):
            return Layout(Kind.OWNED, blame=blame)
        if name in _ADD and all(o or a == 0 for o, a in zip(owned, args[:2])):
            return Layout(Kind.OWNED, blame=blame)
        if len(tensors) == 1 and owned[0] and self._zero_at_zero(name, args):
            return Layout(Kind.OWNED, blame=blame)
        return Layout(Kind.OWNED_ONLY, blame=blame)

    def _index_add(self, node: fx.Node) -> Layout:
        """``index_add(x, dim, index, source)`` is ``x`` plus ``source`` scattered: linear in the
        two together, so a partial ``source`` (experts' outputs summed back into their tokens)
        makes a partial result, ``x`` counting once if it is whole."""
        x, index, source = (self._settle(self._get(a)) for a in (node.args[0], node.args[2], node.args[3]))
        partial = (Kind.PARTIAL, Kind.OWNED)
        blame = _union((x, index, source))
        if not index.replicated or not {x.kind, source.kind} <= {Kind.REPLICATED, *partial}:
            raise _Conflict(blame, f"{gf.where(node)} has no rule for split values")
        if source.replicated and x.replicated:
            return R
        if x.replicated:
            self.lead_only[node] = 0
        elif source.replicated:
            self.lead_only[node] = 3
        return self._reduced(node, Layout(Kind.PARTIAL, blame=blame))

    def _zero_at_zero(self, name: str, args) -> bool:
        if name in _ZERO_AT_ZERO or name in gf.IDENTITY_OPS or name in _MUL or name in _DIV:
            return True
        if name == "clamp":
            lo, hi = [*args[1:], None, None][:2]
            return (lo is None or lo <= 0) and (hi is None or hi >= 0)
        if name == "pow":
            return isinstance(args[1], (int, float)) and args[1] > 0
        if name == "masked_fill":
            return args[2] == 0
        return False

    def _pointwise_partial(self, node, name, tensors, lays, blame) -> Layout:
        linear_in_first = name in _MUL or name in _DIV or name in gf.IDENTITY_OPS or name == "neg"
        partial = [lay.kind in (Kind.PARTIAL, Kind.OWNED) for lay in lays]
        if name in _ADD:
            for t, is_partial in zip(tensors, partial):
                if not is_partial:
                    self.lead_only[node] = node.args.index(t)  # a replicated addend counts once
            return Layout(Kind.PARTIAL, blame=blame)
        if linear_in_first and sum(partial) == 1 and (partial[0] or name in _MUL):
            return Layout(Kind.PARTIAL, blame=blame)
        raise _Conflict(blame, f"{gf.where(node)} is not linear in the partial sum")

    def _pointwise_split(self, node, tensors, lays) -> Layout:
        out_rank = node.meta["val"].dim()
        split = [(t, lay) for t, lay in zip(tensors, lays) if lay.kind is Kind.SPLIT]
        dims = {(lay.dim + out_rank - t.meta["val"].dim(), lay.pieces) for t, lay in split}
        if len(dims) > 1:
            raise _Conflict(_union(lays), f"{gf.where(node)} combines values split differently")
        (dim, (blocks, sections)), = dims
        out_size = _shape(node)[dim]
        for t, lay in zip(tensors, lays):
            own_dim = dim - (out_rank - t.meta["val"].dim())
            size = _shape(t)[own_dim] if own_dim >= 0 else 1
            if lay.kind is Kind.WEIGHT and size == out_size:
                self._decide(lay, own_dim, blocks, sections=sections)  # a bias or scale along the dim splits with it
            elif lay.kind is Kind.SPLIT or size == 1 or self._broadcast_locally(t, own_dim):
                continue
            elif not (lay.replicated and size == out_size and self._narrow(node, t, own_dim, blocks, sections)):
                raise _Conflict(_union(lays), f"{gf.where(node)} mixes a split value with a full one")
        return Layout(Kind.SPLIT, dim, blocks, _union(self._get(t) for t in tensors), sections=sections)

    def _narrow(self, node: fx.Node, operand: fx.Node, dim: int, blocks: int, sections: tuple[int, ...]) -> bool:
        """Whether each FFN rank can take its share of a whole ``operand`` (Gemma 4's per-layer
        input, gating a split projection) where ``node`` meets it with a split value. Attention TP
        ranks run one program with no rank input, so they keep the conflict."""
        size = _shape(operand)[dim]
        if self.reduce_partials or any(n % self.ranks for n in sections or (size // blocks,) * blocks):
            return False
        for pos, arg in enumerate(node.args):
            if arg is operand:
                self.narrowed[(node, pos)] = (dim, size, blocks, sections)
        return True

    def _broadcast_locally(self, node: fx.Node, dim: int) -> bool:
        """Whether ``node`` is an ``expand`` of a size-1 dim (one value for every head, as MLA's
        rotary key) read only here, which can expand to each rank's share of ``dim`` instead."""
        if gf.op_name(node) != "expand" or len(node.users) != 1 or not self._get(node).replicated:
            return False
        sizes = node.args[1]
        src_dim = dim - (len(sizes) - node.args[0].meta["val"].dim())
        if src_dim >= 0 and node.args[0].meta["val"].shape[src_dim] != 1:
            return False
        if not (isinstance(sizes[dim], int) and sizes[dim] > 0):
            return False
        self._local_size((node, 1, dim), sizes[dim])
        return True

    # -- contractions ----------------------------------------------------------------------------

    def _contraction(self, node: fx.Node, name: str) -> Layout:
        bias = None
        if name == "addmm":
            bias, a, b = node.args[:3]
        elif name == "linear":
            a, b = node.args[:2]
            bias = node.args[2] if len(node.args) > 2 else None
        else:
            a, b = node.args[:2]
        ra, rb = len(_shape(a)), len(_shape(b))
        # Each operand dim maps to an output dim, "k" (contracted) or "e" (the expert index).
        if name == "linear":
            map_a = {i: i for i in range(ra - 1)} | {ra - 1: "k"}
            map_b = {0: ra - 1, 1: "k"}
        elif name in _GROUPED:
            map_a, map_b = {0: 0, 1: "k"}, {0: "e", 1: "k", 2: 1}
        elif rb == 2:  # mm, addmm, matmul by a matrix
            map_a = {i: i for i in range(ra - 1)} | {ra - 1: "k"}
            map_b = {0: "k", 1: ra - 1}
        elif ra == rb:  # bmm, batched matmul
            map_a = {i: i for i in range(ra - 1)} | {ra - 1: "k"}
            map_b = {i: i for i in range(rb - 2)} | {rb - 2: "k", rb - 1: rb - 1}
        else:
            return self._all_replicated(node, [a, b])
        la, lb = self._get(a), self._get(b)
        out = self._contract(node, name, (a, b), la, lb, map_a, map_b)
        if bias is not None:
            out = self._bias(node, bias, out)
        return out

    def _contract(self, node, name, operands, la: Layout, lb: Layout, map_a, map_b) -> Layout:
        def k_dim(mapping):
            return next(d for d, m in mapping.items() if m == "k")

        if lb.kind is Kind.WEIGHT:
            if la.kind is Kind.SPLIT and map_a[la.dim] == "k":
                lb = self._decide(lb, k_dim(map_b), la.blocks, sections=la.sections)
            elif self.mode is FFNParallel.EP and "e" in map_b.values() and la.kind in _ROW_WISE:
                lb = self._decide(lb, next(d for d, m in map_b.items() if m == "e"), experts=True)
            elif la.replicated:  # a column split, unless there are fewer columns than ranks (a gate's one)
                column = max(d for d, m in map_b.items() if isinstance(m, int))
                lb = self._decide(lb, column if self._size(lb, column) >= self.ranks else None)
            else:
                lb = self._decide(lb, None)
        la = self._settle(la)
        if lb.kind is Kind.EXPERTS:
            if name not in _GROUPED or map_b[lb.dim] != "e":
                raise _Conflict(lb.blame, f"{gf.where(node)} uses expert weights other than as a grouped matmul")
            if la.kind not in _ROW_WISE:
                raise _Conflict(la.blame | lb.blame, "a grouped matmul over split inputs")
            return Layout(Kind.OWNED, blame=la.blame | lb.blame)
        blame = la.blame | lb.blame
        if la.replicated and lb.replicated:
            return R
        if la.kind is Kind.SPLIT and lb.kind is Kind.SPLIT:
            if map_a[la.dim] == "k" and map_b[lb.dim] == "k" and la.pieces == lb.pieces:
                return Layout(Kind.PARTIAL, blame=blame)
            if isinstance(map_a[la.dim], int) and map_a[la.dim] == map_b[lb.dim] and la.pieces == lb.pieces:
                return replace(la, dim=map_a[la.dim], blame=blame)  # the same batch dim (heads)
            raise _Conflict(blame, f"{gf.where(node)} contracts values split differently")
        split = la if la.kind is Kind.SPLIT else lb if lb.kind is Kind.SPLIT else None
        if split is not None:
            own, other, other_map, other_shape = (
                (map_a, lb, map_b, _shape(operands[1])) if split is la else (map_b, la, map_a, _shape(operands[0]))
            )
            out_dim = own[split.dim]
            # a batch dim both operands have (heads) is split in both, unless the other broadcasts it
            shared = [d for d, m in other_map.items() if m == out_dim]
            if isinstance(out_dim, int) and other.replicated and all(other_shape[d] == 1 for d in shared):
                return replace(split, dim=out_dim, blame=blame)
            raise _Conflict(blame, f"{gf.where(node)} contracts a split value with a full one")
        kinds = {la.kind, lb.kind} - {Kind.REPLICATED}
        if len(kinds) == 1 and Kind.REPLICATED in {la.kind, lb.kind}:
            (kind,) = kinds  # linear in one operand: partial stays partial, owned rows stay owned
            if kind is Kind.OWNED_ONLY or (kind is Kind.OWNED and name in _GROUPED and lb.replicated):
                return Layout(kind, blame=blame)
            return Layout(Kind.PARTIAL if kind is Kind.OWNED else kind, blame=blame)
        raise _Conflict(blame, f"{gf.where(node)} multiplies two split or partial values")

    def _bias(self, node: fx.Node, bias: fx.Node, out: Layout) -> Layout:
        lay = self._get(bias)
        if out.kind is Kind.SPLIT:
            if lay.kind is Kind.WEIGHT:
                lay = self._decide(lay, lay.dims.index(lay.dims[-1]), out.blocks, sections=out.sections)
            if lay.kind is Kind.SPLIT and lay.pieces == out.pieces:
                return replace(out, blame=out.blame | lay.blame)
        elif out.kind is Kind.PARTIAL:
            if self._settle(lay).replicated:
                self.lead_only[node] = -1  # the bias is added by rank 0 only
                return out
        elif self._settle(lay).replicated:
            return out
        raise _Conflict(out.blame | lay.blame, f"{gf.where(node)}: the bias cannot follow the split")

    def _all_replicated(self, node: fx.Node, args) -> Layout:
        lays = [self._settle(self._get(a)) for a in args]
        if all(lay.replicated for lay in lays):
            return R
        raise _Conflict(_union(lays), f"{gf.where(node)} has no rule for split values")

    # -- data movement ---------------------------------------------------------------------------

    def _permute(self, node: fx.Node, name: str) -> Layout:
        lay = self._get(node.args[0])
        rank = len(_shape(node.args[0]))
        if name == "t":
            order = list(range(rank))[::-1]
        elif name == "transpose":
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

    def _index(self, node: fx.Node, name: str) -> Layout:
        src = node.args[0]
        lay = self._get(src)
        if name == "index_select":
            dim, idx = node.args[1] % len(_shape(src)), [node.args[2]]
            pos = [None] * dim + idx
        else:
            pos = list(node.args[1])
        if any(self._get(i).kind is not Kind.REPLICATED for i in pos if isinstance(i, fx.Node)):
            return self._all_replicated(node, [src, *[i for i in pos if isinstance(i, fx.Node)]])
        if lay.replicated or lay.kind in (Kind.PARTIAL, Kind.OWNED, Kind.OWNED_ONLY):
            return lay  # gathering is linear and moves elements with their owners
        indexed = [d for d, i in enumerate(pos) if i is not None]
        if indexed != [0]:
            return self._all_replicated(node, [src])
        added = pos[0].meta["val"].dim() - 1  # dims the index tensor adds in place of dim 0
        if lay.kind is Kind.WEIGHT:
            if self.mode is FFNParallel.EP and name == "index":
                lay = self._decide(lay, 0, experts=True)
                return Layout(Kind.OWNED, blame=lay.blame)
            return replace(lay, dims=(None,) * (added + 1) + lay.dims[1:])
        if lay.kind is Kind.EXPERTS and lay.dim == 0:
            return Layout(Kind.OWNED, blame=lay.blame)
        if lay.kind is Kind.SPLIT and lay.dim > 0:
            return replace(lay, dim=lay.dim + added)
        raise _Conflict(lay.blame, f"{gf.where(node)} indexes a split dimension")

    def _reshape(self, node: fx.Node) -> Layout:
        lay = self._settle(self._get(node.args[0]))
        if lay.kind is not Kind.SPLIT:
            if lay.kind is Kind.EXPERTS:
                raise _Conflict(lay.blame, f"{gf.where(node)} reshapes expert weights")
            return lay
        src, out = _shape(node.args[0]), _shape(node)
        before = math.prod(src[: lay.dim])
        for j in range(len(out)):
            if math.prod(out[:j]) != before:
                continue
            kept = out[j] == src[lay.dim]
            # [.., H*D] -> [.., H, D] splits the heads H, when every rank holds whole heads
            unmerged = lay.pieces == (1, ()) and out[j].is_Integer and int(out[j]) % self.ranks == 0 and any(
                math.prod(out[j:m]) == src[lay.dim] for m in range(j + 2, len(out) + 1)
            )
            # [.., H, D] -> [.., H*D]: each rank's heads are a contiguous range of the merged dim
            merged = lay.pieces == (1, ()) and any(
                math.prod(src[lay.dim : m]) == out[j] for m in range(lay.dim + 2, len(src) + 1)
            )
            if kept or unmerged or merged:
                sizes = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else None
                if sizes is not None and j < len(sizes) and isinstance(sizes[j], int) and sizes[j] > 0:
                    self._local_size((node, 1, j), sizes[j])
                return replace(lay, dim=j)
        raise _Conflict(lay.blame, f"{gf.where(node)} reshapes across a split dimension")

    def _chunk(self, node: fx.Node, name: str):
        lay = self._settle(self._get(node.args[0]))
        n = len(node.meta["val"])
        rank = len(_shape(node.args[0]))
        dim_pos = 1 if name == "unbind" else 2
        dim = (node.args[dim_pos] if len(node.args) > dim_pos else 0) % rank
        if lay.kind is not Kind.SPLIT or lay.dim != dim:
            if lay.kind is Kind.SPLIT and name == "unbind" and lay.dim > dim:
                return [replace(lay, dim=lay.dim - 1)] * n
            if lay.kind is Kind.EXPERTS:
                raise _Conflict(lay.blame, f"{gf.where(node)} splits expert weights")
            return [lay] * n
        sizes = tuple(int(t.shape[dim]) for t in node.meta["val"])
        if name == "split_with_sizes" and len(set(sizes)) > 1:  # a fused [q; k; v]: one section each
            if lay.pieces == (1, ()):
                raise _NeedBlocks(lay.blame, sections=sizes)
            if lay.sections != sizes:
                raise _Conflict(lay.blame, f"{gf.where(node)} splits a split dimension unlike its sections")
            for i, size in enumerate(node.args[1]):
                self._local_size((node, 1, i), size)
            return [replace(lay, sections=())] * n
        if name == "unbind" or len(set(sizes)) != 1 or lay.sections:
            raise _Conflict(lay.blame, f"{gf.where(node)} splits a split dimension unevenly")
        if lay.blocks % n:
            raise _NeedBlocks(lay.blame, lay.blocks * n // math.gcd(lay.blocks, n))
        if name == "split":
            self._local_size((node, 1, None), node.args[1])
        elif name == "split_with_sizes":
            for i, size in enumerate(node.args[1]):
                self._local_size((node, 1, i), size)
        return [replace(lay, blocks=lay.blocks // n)] * n

    def _slice(self, node: fx.Node, name: str) -> Layout:
        lay = self._get(node.args[0])
        rank = len(_shape(node.args[0]))
        dim = node.args[1] % rank if len(node.args) > 1 else 0
        if lay.kind is Kind.WEIGHT and name == "select":  # one expert of a stack (JetMoE's loop): undecided
            return replace(lay, dims=lay.dims[:dim] + lay.dims[dim + 1 :])
        lay = self._settle(lay)
        if lay.kind not in (Kind.SPLIT, Kind.EXPERTS):
            return lay
        if dim != lay.dim:
            return replace(lay, dim=lay.dim - 1) if name == "select" and dim < lay.dim else lay
        start, end, step = _slice_args(node)
        full = _shape(node.args[0])[dim]
        if lay.kind is Kind.SPLIT and name == "slice" and step == 1 and full.is_Integer:
            return self._slice_section(node, lay, int(full), start, int(full) if end is None else min(end, int(full)))
        whole = (end is None or end >= full) and (start or 0) < step
        # An interleaved [gate0, up0, gate1, ...] keeps its pairs on one rank.
        interleaved = whole and step > 1 and lay.blocks == 1 and (full // self.ranks) % step == 0
        if lay.kind is Kind.SPLIT and name == "slice" and interleaved:
            return lay
        raise _Conflict(lay.blame, f"{gf.where(node)} slices a split dimension")

    def _slice_section(self, node: fx.Node, lay: Layout, full: int, start: int, end: int) -> Layout:
        """``x[..., start:end]`` of a split dim made of sections (a fused [q; k; v] cut by slices):
        the sections are where the source's slices along the dim start and end."""
        source, dim = node.args[0], lay.dim
        bounds = {0, full}
        for user in source.users:
            if gf.op_name(user) == "slice" and user.args[1] % len(_shape(source)) == dim:
                lo, hi, step = _slice_args(user)
                if step == 1 and isinstance(lo, int) and isinstance(hi or full, int):
                    bounds |= {lo, min(hi or full, full)}
        bounds = sorted(bounds)
        sections = tuple(b - a for a, b in itertools.pairwise(bounds))
        if lay.pieces == (1, ()) and len(sections) > 1:
            raise _NeedBlocks(lay.blame, sections=sections)
        if lay.sections != sections or start not in bounds or end not in bounds:
            raise _Conflict(lay.blame, f"{gf.where(node)} slices a split dimension")
        self._local_size((node, 2, None), start)
        if len(node.args) > 3 and node.args[3] is not None and node.args[3] < full:
            self._local_size((node, 3, None), end)
        kept = sections[bounds.index(start) : bounds.index(end)]
        return replace(lay, sections=kept if len(kept) > 1 else ())

    def _new_like(self, node: fx.Node) -> Layout:
        """A new tensor the full shape of a split one it is made from is split like it (what is
        written into it must then be split the same way, or the writes conflict)."""
        lay = self._get(node.args[0])
        sizes = node.args[1]
        like = _shape(node.args[0])
        same = lay.kind is Kind.SPLIT and len(sizes) == len(like) and sizes[lay.dim] == like[lay.dim]
        if same and isinstance(sizes[lay.dim], int):
            self._local_size((node, 1, lay.dim), sizes[lay.dim])
            return lay
        raise _Conflict(lay.blame, f"{gf.where(node)} makes a tensor unlike the split one it is made from")

    def _layer_norm(self, node: fx.Node) -> Layout:
        """A norm over trailing dims that leave the split dim alone (per head) keeps the split."""
        lay = self._settle(self._get(node.args[0]))
        normalized = len(node.args[1])
        params = [self._settle(self._get(a)) for a in node.args[2:4]]
        if lay.replicated and all(p.replicated for p in params):
            return R
        per_head = lay.kind is Kind.SPLIT and lay.dim < len(_shape(node.args[0])) - normalized
        if per_head and all(p.replicated for p in params):
            return lay
        raise _Conflict(_union([lay, *params]), f"{gf.where(node)} normalizes over a split dimension")

    def _cat(self, node: fx.Node) -> Layout:
        lays = [self._settle(self._get(a)) for a in node.args[0]]
        rank = len(_shape(node))
        dim = (node.args[1] if len(node.args) > 1 else 0) % rank
        if len(set(lays)) == 1 and lays[0].kind is not Kind.EXPERTS:
            lay = lays[0]
            if lay.kind is not Kind.SPLIT:
                return lay
            if gf.op_name(node) == "cat" and lay.dim != dim:
                return lay
            if gf.op_name(node) == "stack":  # a new dim at `dim`: the split dim moves past it
                return replace(lay, dim=lay.dim + (dim <= lay.dim))
        raise _Conflict(_union(lays), f"{gf.where(node)} joins values laid out differently")

    def _sum(self, node: fx.Node) -> Layout:
        lay = self._settle(self._get(node.args[0]))
        rank = len(_shape(node.args[0]))
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(rank))
        dims = sorted(d % rank for d in dims)
        keep = (len(node.args) > 2 and node.args[2]) or node.kwargs.get("keepdim", False)
        if lay.kind in (Kind.PARTIAL, Kind.OWNED):
            return Layout(Kind.PARTIAL, blame=lay.blame)
        if lay.kind is Kind.SPLIT:
            if lay.dim in dims:
                if gf.op_name(node) == "sum":
                    return Layout(Kind.PARTIAL, blame=lay.blame)
                if self.reduce_partials and self.average_means:  # the mean of equal parts: the mean of their means
                    self.averaged.add(node)
                    return Layout(Kind.PARTIAL, blame=lay.blame)
                self.mean_refused = self.reduce_partials
            else:
                return replace(lay, dim=lay.dim - (0 if keep else sum(d < lay.dim for d in dims)))
        raise _Conflict(lay.blame, f"{gf.where(node)} reduces a value laid out as {lay.kind.value}")

    def _reduction(self, arg) -> str:
        lay = self._settle(self._get(arg))
        if lay.replicated:
            return "first"
        if lay.kind in (Kind.PARTIAL, Kind.OWNED):
            return "sum"
        raise _Conflict(lay.blame, f"the segment returns a value laid out as {lay.kind.value}")


def single_rank(graph: fx.Graph) -> ShardedSegment:
    """The segment for a plan with one FFN rank: unchanged, plus the (unused) rank input."""
    outputs = len(next(n for n in graph.nodes if n.op == "output").args[0])
    unchanged = _rewrite(graph, _Propagation(graph, FFNParallel.TP, 1, {}), 1)
    return ShardedSegment(unchanged, [Split()] * len(segment.weights(graph)), ["first"] * outputs)


def data_parallel(graph: fx.Graph) -> ShardedSegment:
    """The segment whole on every FFN rank, each serving its own share of the tokens."""
    whole = single_rank(graph)
    return replace(whole, reduce=["rows"] * len(whole.reduce))


def shard_segment(
    graph: fx.Graph,
    mode: FFNParallel,
    ranks: int,
    label: str = "",
    names: list[str] | None = None,
    whole: Collection[int] = (),
) -> ShardedSegment:
    """Decide how ``ranks`` FFN ranks hold the segment's weights and rewrite it to run on one rank;
    the weights at indices ``whole`` are kept whole on every rank.

    ``label`` (the layer) and ``names`` (its weights) only name things in errors.
    """
    weights = segment.weights(graph)
    names = names or [w.name for w in weights]
    prop = _Propagation(graph, mode, ranks, {i: Split() for i in whole})

    def refuse(conflict: _Conflict) -> None:
        if any(prop.decided.get(w, Split()).experts for w in conflict.blame):
            raise PlanError(
                f"{label}: cannot split the experts over {ranks} FFN ranks ({conflict.reason}); use --ffn-parallel tp"
            ) from None
        if not conflict.blame:
            raise PlanError(f"{label}: cannot shard this FFN segment: {conflict.reason}") from None

    try:
        reduce, reasons = prop.settle(refuse)
        splits = [prop.decided.get(i, Split()) for i in range(len(weights))]
        if all(s.dim is None for s in splits) and any(w.meta["val"].dim() >= 2 for w in weights):
            why = "; then ".join(reasons) or "no op it runs has a rule that splits its weights"
            raise PlanError(f"{label}: the FFN cannot be split over {ranks} ranks ({why}); use one FFN rank")
    except PlanError as err:
        if prop.partial_at:
            raise PartialSumsMeetNonLinearOps(str(err), [n.name for n in prop.partial_at]) from None
        raise
    _check_divisible(names, weights, splits, ranks, label)
    return ShardedSegment(_rewrite(graph, prop, ranks), splits, reduce)


def _check_divisible(names: list[str], weights: list[fx.Node], splits: list[Split], ranks: int, label: str) -> None:
    for name, w, s in zip(names, weights, splits):
        if s.dim is None:
            continue
        size = w.meta["val"].shape[s.dim]
        if not s.divides(size, ranks):
            shape = tuple(w.meta["val"].shape)
            what = f"the {size} experts of {name}" if s.experts else f"dimension {s.dim} ({size}) of {name} {shape}"
            fix = "a plan whose F divides the expert count, or --ffn-parallel tp" if s.experts else "an F dividing it"
            raise PlanError(f"{label}: {ranks} FFN ranks do not divide {what}; use {fix}")


def _rewrite(graph: fx.Graph, prop: _Propagation, ranks: int) -> fx.Graph:
    """The graph as one rank runs it: local sizes, local experts, rank-0-only addends, and (for
    attention TP) the all-reduce of each partial sum; attention TP needs no ``rank`` input."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    rank = None
    for node in graph.nodes:
        if node.op == "output":
            new.output(fx.map_arg(node.args[0], env.get))
            continue
        args, kwargs = fx.map_arg(node.args, env.get), fx.map_arg(node.kwargs, env.get)
        for (n, pos, i), full in prop.local_sizes.items():
            if n is node:
                args = list(args)
                if i is None:
                    args[pos] = full // ranks
                else:
                    args[pos] = [*args[pos][:i], full // ranks, *args[pos][i + 1 :]]
                args = tuple(args)
        for (n, pos), piece in prop.narrowed.items():
            if n is node:
                args = (*args[:pos], _rank_share(new, args[pos], rank, ranks, *piece), *args[pos + 1 :])
        target = node.target
        name = gf.op_name(node)
        experts = _experts_operand(node, prop)
        if experts is not None:
            first = new.call_function(operator.mul, (rank, experts))
            if name in _GROUPED:
                offs = args[2] if len(args) > 2 else kwargs["offs"]
                target, args, kwargs = torch.ops.afdc.grouped_mm_local.default, (*args[:2], offs, first), {}
            else:
                target, args = torch.ops.afdc.gather_local.default, (args[0], args[1][0], first)
        if prop.lead_only.get(node) == -1:  # a bias after a row split: add it once
            bias_pos = 0 if name == "addmm" else 2
            bias = args[bias_pos]
            args = tuple(a for i, a in enumerate(args) if i != bias_pos)
            target = torch.ops.aten.mm.default if name == "addmm" else torch.ops.aten.linear.default
            out = new.call_function(target, args, kwargs)
            if node in prop.reduced:  # all-reduce the partial sums, then add the bias
                out = new.call_function(torch.ops.afdc.tp_all_reduce.default, (out,))
            else:
                bias = new.call_function(torch.ops.aten.mul.Tensor, (bias, new.call_function(operator.eq, (rank, 0))))
            env[node] = new.call_function(torch.ops.aten.add.Tensor, (out, bias))
            env[node].meta = dict(node.meta)
            continue
        if node in prop.lead_only:
            lead = new.call_function(operator.eq, (rank, 0))
            args = list(args)
            pos = prop.lead_only[node]
            scaled = new.call_function(torch.ops.aten.mul.Tensor, (args[pos], lead))
            scaled.meta["val"] = args[pos].meta.get("val")  # times a bool: the same shape and dtype
            args[pos] = scaled
            args = tuple(args)
        env[node] = new.create_node(node.op, target, args, kwargs, name=node.name)
        env[node].meta = dict(node.meta)
        if node in prop.reduced:
            env[node] = new.call_function(torch.ops.afdc.tp_all_reduce.default, (env[node],))
            if node in prop.averaged:
                env[node] = new.call_function(torch.ops.aten.div.Tensor, (env[node], ranks))
        if node is placeholders[-1] and not prop.reduce_partials:
            rank = segment.add_rank(new)
    new.lint()
    return new


def _rank_share(
    graph: fx.Graph, value: fx.Node, rank, ranks: int, dim: int, size: int, blocks: int, sections: tuple[int, ...]
) -> fx.Node:
    """``rank``'s part of a whole ``value``, as :class:`ShardSlice` lays it out (sizes divide)."""
    pieces, start = [], 0
    for n in sections or (size // blocks,) * blocks:
        offset = graph.call_function(operator.add, (start, graph.call_function(operator.mul, (rank, n // ranks))))
        pieces.append(graph.call_function(torch.ops.aten.narrow.default, (value, dim, offset, n // ranks)))
        start += n
    return pieces[0] if len(pieces) == 1 else graph.call_function(torch.ops.aten.cat.default, (pieces, dim))


def _experts_operand(node: fx.Node, prop: _Propagation) -> int | None:
    """The local expert count when ``node`` reads expert-parallel weights, else None."""
    name = gf.op_name(node)
    if name in _GROUPED:
        operand = node.args[1]
    elif name == "index" and isinstance(node.args[0], fx.Node):
        operand = node.args[0]
    else:
        return None
    lay = prop.env.get(operand)
    if isinstance(lay, Layout) and lay.kind is Kind.WEIGHT and lay.weight in prop.decided:
        lay = prop._decided_layout(lay)
    if not isinstance(lay, Layout) or lay.kind is not Kind.EXPERTS:
        return None
    return int(_shape(operand)[lay.dim]) // prop.ranks


@dataclass
class ShardedAttention:
    """The attention program as each of an attention rank's TP ranks runs it, and how they hold
    the weights (by name; a weight not in ``splits`` is whole on every TP rank). ``replicated``
    says why weights that could not be split were kept whole."""

    graph: fx.Graph
    splits: dict[str, Split]
    replicated: list[str]


def shard_attention(graph: fx.Graph, ranks: int) -> ShardedAttention:
    """Tensor parallelism inside an attention rank, found by the same layout propagation as the
    FFN's: projections that read the residual stream are split by output column (q, k, v by
    heads), the attention op runs on each rank's heads, and the projection that reads the split
    heads back (o) is split by input row and its partial sums are all-reduced at once
    (``afdc::tp_all_reduce``), so the residual stream, norms, router and LM head stay whole.
    What cannot follow a split (a norm over all heads, an embedding, a weight whose size the ranks
    do not divide) keeps its weights whole, which is correct, only not parallel.
    """
    nodes = graph.find_nodes(op="get_attr")
    names = sorted({n.target for n in nodes})
    index = {n: names.index(n.target) for n in nodes}
    shapes = {index[n]: tuple(n.meta["val"].shape) for n in nodes}
    # All-reducing a mean over split heads (a norm over all of q) lets OLMo 2 split its heads,
    # but makes MLA split its small q latent instead of its heads: keep whichever splits more.
    tried = [_settle_attention(graph, ranks, index, names, shapes, average=False)]
    if tried[0][0].mean_refused:
        tried.append(_settle_attention(graph, ranks, index, names, shapes, average=True))
    prop, reasons = max(tried, key=lambda t: sum(math.prod(shapes[w]) for w, s in t[0].decided.items() if s.dim))
    splits = {names[w]: s for w, s in sorted(prop.decided.items()) if s.dim is not None}
    if not splits:
        raise PlanError(
            f"--attn-tp {ranks}: no attention weight can be split over {ranks} ranks "
            f"({'; then '.join(reasons) or 'none is a projection'}); use --attn-tp 1 and more attention ranks"
        )
    sharded = _rewrite(graph, prop, ranks)
    for node in sharded.nodes:  # sizes changed: values are propagated again where needed
        node.meta.pop("val", None)
    return ShardedAttention(sharded, splits, reasons)


def _settle_attention(
    graph: fx.Graph, ranks: int, index: dict[fx.Node, int], names: list[str], shapes: dict[int, tuple], average: bool
) -> tuple[_Propagation, list[str]]:
    """Settle, then keep whole the weights the ranks do not divide and settle again."""
    prop = _Propagation(graph, FFNParallel.TP, ranks, {}, weights=index, reduce_partials=True, average_means=average)

    def refuse(conflict: _Conflict) -> None:
        if not conflict.blame:
            raise PlanError(f"--attn-tp {ranks}: cannot shard the attention program: {conflict.reason}") from None

    reasons: list[str] = []
    while True:  # each round keeps more weights whole, so it ends
        reasons += prop.settle(refuse)[1]
        undivided = {w for w, s in prop.decided.items() if s.dim is not None and not s.divides(shapes[w][s.dim], ranks)}
        if not undivided:
            return prop, list(dict.fromkeys(reasons))
        prop.rewind({w: Split() for w in undivided})
        reasons.append(f"{ranks} ranks do not divide {', '.join(names[w] for w in sorted(undivided))}")
