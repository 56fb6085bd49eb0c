"""What a layout propagation knows about one graph, and how the op rules decide weights' splits.

:class:`PropagationState` holds each value's :class:`~afdc.partition.layout.Layout` so far, the
split decided for each weight, and what the rewrite to one rank must change (local sizes,
addends counted on one rank only, whole operands narrowed to a rank's share, partial sums
all-reduced). The op rules (:mod:`afdc.partition.op_rules`) read and decide through it; the
driver that walks the graph and answers conflicts (:class:`afdc.partition.shard.Propagation`)
extends it. Decisions record where they were made, so that :meth:`PropagationState.rewind` can
forget what followed one and the propagation go on from there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.fx as fx

from afdc import segment
from afdc.partition.layout import Conflict, Kind, Layout, R
from afdc.segment import Split


class FFNParallel(enum.Enum):
    TP = "tp"
    EP = "ep"


@dataclass
class PropagationState:
    """The layouts found so far over ``graph``, whose values ``ranks`` ranks share in ``mode``,
    and the weights' decisions (``decided``: weight index -> :class:`Split`)."""

    graph: fx.Graph
    mode: FFNParallel
    ranks: int
    decided: dict[int, Split]
    weights: dict[fx.Node, int] | None = None  # weight nodes -> index (default: the segment's weights)
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
        self._pos = 0  # the node being visited
        self._decided_at: dict[int, int] = {}  # weight -> where its decision was made (-1: pinned)
        self._sized_at: dict[tuple, int] = {}  # local_sizes key -> where it was recorded
        self._overwritten: list[tuple[int, fx.Node, Layout]] = []  # in-place writes: (where, value, before)
        self._start = 0  # where the next pass of the driver starts

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

    def local_size(self, key: tuple[fx.Node, int, int | None], full: int) -> None:
        """Argument ``key`` of a node is the ``full`` size of a dim each rank holds 1/ranks of."""
        self.local_sizes[key] = full
        self._sized_at[key] = self._pos

    def reduce_partial(self, node: fx.Node, lay: Layout) -> Layout:
        """``node``'s layout ``lay``, all-reduced where it is made if it is a partial sum that the
        propagation reduces at once (attention TP)."""
        if self.reduce_partials and lay.kind is Kind.PARTIAL:
            self.reduced.add(node)
            return R
        return lay

    # -- weights ---------------------------------------------------------------------------------

    def weight_layout(self, i: int, node: fx.Node) -> Layout:
        """The layout of weight ``i`` (the value of ``node``), as decided or still open."""
        lay = Layout(Kind.WEIGHT, weight=i, dims=tuple(range(node.meta["val"].dim())))
        return self.decided_layout(lay) if i in self.decided else lay

    def size(self, lay: Layout, value_dim: int) -> int:
        """The size of the weight behind ``lay`` along value dim ``value_dim``."""
        return self._weight_nodes[lay.weight].meta["val"].shape[lay.dims[value_dim]]

    def decided_layout(self, lay: Layout) -> Layout:
        """The layout of a value read from a weight (``lay``, of kind WEIGHT) whose split is decided."""
        split = self.decided[lay.weight]
        if split.dim is None:
            return R
        if split.dim not in lay.dims:
            raise Conflict(frozenset({lay.weight}), "a weight's split dimension was indexed away")
        kind = Kind.EXPERTS if split.experts else Kind.SPLIT
        return Layout(kind, lay.dims.index(split.dim), split.blocks, frozenset({lay.weight}), sections=split.sections)

    def decide(
        self, lay: Layout, value_dim: int | None, blocks: int = 1, experts: bool = False, sections: tuple = ()
    ) -> Layout:
        """Fix the split of the weight behind ``lay`` so that value dim ``value_dim`` is split."""
        weight_dim = None if value_dim is None else lay.dims[value_dim]
        self.decided[lay.weight] = Split(weight_dim, blocks, experts, sections)
        self._decided_at[lay.weight] = self._pos
        return self.decided_layout(lay)

    def get(self, arg) -> Layout:
        """The layout of ``arg``, a graph value (a constant is replicated)."""
        if not isinstance(arg, fx.Node):
            return R
        lay = self.env[arg]
        if isinstance(lay, list):
            raise AssertionError(f"{arg.name} is a tuple")
        if lay.kind is Kind.WEIGHT and lay.weight in self.decided:
            return self.decided_layout(lay)
        return lay

    def replicate_undecided(self, lay: Layout) -> Layout:
        """A weight reaching an op with no rule for undecided weights is replicated."""
        return self.decide(lay, None) if lay.kind is Kind.WEIGHT else lay
