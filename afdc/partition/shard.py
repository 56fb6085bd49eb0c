"""Shard an FFN segment over the F ranks of a plan, so that the ranks' outputs add up.

Tensor parallel (``tp``) splits weights along their intermediate dimension: the projections
that read the segment's input are split by output column, the ones that read a split value by
input row, and each rank returns a partial sum. Expert parallel (``ep``) gives each rank E/F of
the stacked expert weights; a rank computes only its experts' rows and zeros elsewhere, again a
partial sum. Under ``ep`` the rest of a MoE segment (shared experts, dense layers) is ``tp``.

Which weights to split is found by propagating, through the segment graph, how each value is
laid out over the ranks (:mod:`afdc.partition.layout`), by the ops' rules
(:mod:`afdc.partition.op_rules`). A weight is split on its first use as a matmul operand; when a
split value reaches an op that cannot take it (a router's softmax or top-k over the split
dimension), the weights it came from are replicated and the propagation starts over. Every rule
is exact, and an op without a rule accepts only replicated inputs: a pattern that does not fit
ends up replicated (or refused under ``ep``), never wrong.

This module holds the propagation's driver (:class:`Propagation`), the rewrite of a graph to
what one rank runs (:func:`rewrite`), and the FFN's entry points; attention TP
(:mod:`afdc.partition.attention_tp`) drives the same propagation over the attention program.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from afdc import segment
from afdc.errors import PlanError
from afdc.partition import op_rules
from afdc.partition.layout import Conflict, Kind, Layout, NeedBlocks, R, shape
from afdc.partition.propagation import FFNParallel, PropagationState
from afdc.passes import graph_facts as gf
from afdc.segment import Split


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


class PartialSumsMeetNonLinearOps(PlanError):
    """The split leaves partial sums (of expert or row-split outputs) that an op not linear in
    them reads, as a norm after the experts does: the FFN ranks cannot reduce them, but the
    attention side can, if the cut leaves ``nodes`` (segment node names) to it."""

    def __init__(self, message: str, nodes: list[str]):
        super().__init__(message)
        self.nodes = nodes
        self.segment = -1  # which segment of the partition (set by the caller that knows)


class Propagation(PropagationState):
    """Layout propagation, node by node in graph order, deciding weights' splits on the way.

    When a conflict or a need for blocks changes some weights' decisions, :meth:`rewind` keeps
    everything computed before the first use of those weights and propagation goes on from
    there, so a graph with a conflict per layer costs a pass, not a pass per conflict.
    """

    def run(self) -> list[str]:
        """Propagate from where the last :meth:`rewind` left off; the output's reductions."""
        for pos in range(self._start, len(self._nodes)):
            node = self._nodes[pos]
            self._pos = pos
            if node.op in ("placeholder", "get_attr"):
                i = self.weights.get(node)
                self.env[node] = R if i is None else self.weight_layout(i, node)
            elif node.op == "call_function":
                try:
                    self.env[node] = op_rules.visit(self, node)
                except Conflict as conflict:
                    conflict.node = conflict.node or node
                    raise
                if gf.op_name(node).endswith("_") and node.args and isinstance(node.args[0], fx.Node):
                    written = node.args[0]  # in-place: the written tensor now has this layout
                    self._overwritten.append((pos, written, self.env[written]))
                    self.env[written] = self.env[node]
            elif node.op == "output":
                return [self._reduction(o) for o in node.args[0]]
        raise AssertionError("graph without output")

    def settle(self, refuse: Callable[[Conflict], None]) -> tuple[list[str], list[str]]:
        """Propagate; after each conflict keep whole the weights it blames and go on from their
        first use, until none is left. Returns the output's reductions and why weights were kept
        whole; ``refuse`` raises for a conflict that keeping weights whole must not answer."""
        reasons: list[str] = []
        for _ in range(4 * len(self._first_use) + 4):
            try:
                return self.run(), list(dict.fromkeys(reasons))
            except NeedBlocks as need:
                self.rewind({w: replace(self.decided[w], blocks=need.blocks, sections=need.sections)
                             for w in need.weights})
            except Conflict as conflict:
                if conflict.node is not None and any(
                    isinstance(self.env.get(a), Layout) and self.get(a).kind in (Kind.PARTIAL, Kind.OWNED)
                    for a in conflict.node.all_input_nodes
                ):
                    self.partial_at.append(conflict.node)
                refuse(conflict)
                self.rewind({w: Split() for w in conflict.blame})
                reasons.append(conflict.reason)
        raise AssertionError("sharding did not settle")

    def _reduction(self, arg) -> str:
        lay = self.replicate_undecided(self.get(arg))
        if lay.replicated:
            return "first"
        if lay.kind in (Kind.PARTIAL, Kind.OWNED):
            return "sum"
        raise Conflict(lay.blame, f"the segment returns a value laid out as {lay.kind.value}")


def single_rank(graph: fx.Graph) -> ShardedSegment:
    """The segment for a plan with one FFN rank: unchanged, plus the (unused) rank input."""
    outputs = len(segment.outputs(graph))
    unchanged = rewrite(graph, Propagation(graph, FFNParallel.TP, 1, {}), 1)
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
    prop = Propagation(graph, mode, ranks, {i: Split() for i in whole})

    def refuse(conflict: Conflict) -> None:
        if any(prop.decided.get(w, Split()).experts for w in conflict.blame):
            raise PlanError(
                f"{label}: cannot split the experts over {ranks} FFN ranks ({conflict.reason}); use --ffn-parallel tp "
                "(ffn_parallel='tp')"
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
    def tp_fits() -> bool:  # asked only to word an error: whether the other way to split would do
        try:
            shard_segment(graph, FFNParallel.TP, ranks, label, names, whole)
        except PlanError:
            return False
        return True

    _check_divisible(names, weights, splits, ranks, label, tp_fits)
    return ShardedSegment(rewrite(graph, prop, ranks), splits, reduce)


def _check_divisible(
    names: list[str], weights: list[fx.Node], splits: list[Split], ranks: int, label: str, tp_fits: Callable[[], bool]
) -> None:
    for name, w, s in zip(names, weights, splits):
        if s.dim is None:
            continue
        size = w.meta["val"].shape[s.dim]
        if not s.divides(size, ranks):
            full = tuple(w.meta["val"].shape)
            what = f"the {size} experts of {name}" if s.experts else f"dimension {s.dim} ({size}) of {name} {full}"
            if not s.experts:
                fix = "an F dividing it"
            else:
                fix = "a plan whose F divides the expert count"
                if tp_fits():
                    fix += ", or --ffn-parallel tp (ffn_parallel='tp')"
            raise PlanError(f"{label}: {ranks} FFN ranks do not divide {what}; use {fix}")


def rewrite(graph: fx.Graph, prop: PropagationState, ranks: int) -> fx.Graph:
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
        op = op_rules.op_of(node)
        experts = _experts_operand(node, prop)
        if experts is not None:
            first = new.call_function(operator.mul, (rank, experts))
            if op in op_rules.GROUPED:
                offs = args[2] if len(args) > 2 else kwargs["offs"]
                target, args, kwargs = torch.ops.afdc.grouped_mm_local.default, (*args[:2], offs, first), {}
            else:
                target, args = torch.ops.afdc.gather_local.default, (args[0], args[1][0], first)
        if prop.lead_only.get(node) == -1:  # a bias after a row split: add it once
            bias_pos = 0 if op is torch.ops.aten.addmm else 2
            bias = args[bias_pos]
            args = tuple(a for i, a in enumerate(args) if i != bias_pos)
            target = torch.ops.aten.mm.default if op is torch.ops.aten.addmm else torch.ops.aten.linear.default
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


def _experts_operand(node: fx.Node, prop: PropagationState) -> int | None:
    """The local expert count when ``node`` reads expert-parallel weights, else None."""
    op = op_rules.op_of(node)
    if op in op_rules.GROUPED:
        operand = node.args[1]
    elif op is torch.ops.aten.index and isinstance(node.args[0], fx.Node):
        operand = node.args[0]
    else:
        return None
    lay = prop.env.get(operand)
    if isinstance(lay, Layout) and lay.kind is Kind.WEIGHT and lay.weight in prop.decided:
        lay = prop.decided_layout(lay)
    if not isinstance(lay, Layout) or lay.kind is not Kind.EXPERTS:
        return None
    return int(shape(operand)[lay.dim]) // prop.ranks
